"""Real OpenAI clients against live servers: LangChain, LiteLLM and lm-evaluation-harness.

References: the synchronous engine running a request alone (texts, token counts), and for lm-eval
its own in-process ``hf`` model (transformers) on the same float32 weights (scores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
import torch
from conftest import TEST_API_KEY, start_process, stop_process
from pydantic import BaseModel, Field

from server.engine import LLMEngine, Request
from server.models import DEFAULT_MODEL
from server.runner import BlockRunner
from server.sampling import SamplingParams

LMEVAL_TASKS = Path(__file__).parent / "data" / "lmeval"
PROMPT = "Name three colours of the rainbow."
DENSE = {"igserve": {"mask": "dense"}}


def engine_alone(lm, messages, engine: LLMEngine | None = None, **params) -> Request:
    """Reference: the synchronous engine (one slot) with this one chat request, dense."""
    ids = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    engine = engine or LLMEngine(BlockRunner(lm.model, max_batch=1, max_len=256), lm.tokenizer)
    blocks = 2 * lm.model.config.num_hidden_layers
    return engine.generate([Request(ids, torch.ones(blocks, dtype=torch.bool), SamplingParams(**params))])[0]


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=10)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]


# ---------------------------------------------------------------------------- LangChain
def test_langchain_chat_openai_invoke_stream_and_structured_output(live_server, tiny):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=live_server.base_url + "/v1", api_key=TEST_API_KEY, model=tiny.name, temperature=0,
                     max_tokens=10, max_retries=0, extra_body=DENSE)
    ref = engine_alone(tiny, [{"role": "user", "content": PROMPT}], max_tokens=10, temperature=0)
    out = llm.invoke(PROMPT)
    assert out.content == ref.text
    assert out.usage_metadata["input_tokens"] == len(ref.prompt_ids)
    assert out.usage_metadata["output_tokens"] == len(ref.output_ids)
    chunks = list(llm.stream(PROMPT))
    assert "".join(c.content for c in chunks) == ref.text
    assert sum(bool(c.content) for c in chunks) > 1  # streamed, not one block

    structured = ChatOpenAI(base_url=live_server.base_url + "/v1", api_key=TEST_API_KEY, model=tiny.name,
                            temperature=0, max_tokens=120, max_retries=0, extra_body=DENSE)
    person = structured.with_structured_output(Person, method="json_schema", include_raw=True).invoke(
        "Describe a person.")
    assert person["parsing_error"] is None and isinstance(person["parsed"], Person)
    jsonschema.validate(json.loads(person["raw"].content), Person.model_json_schema())
    with pytest.raises(ValueError):  # without the format the same request is no JSON: the grammar did it
        json.loads(structured.invoke("Describe a person.").content)


# ---------------------------------------------------------------------------- LiteLLM
def test_litellm_completion_plain_and_streaming(live_server, tiny):
    import litellm  # LITELLM_LOCAL_MODEL_COST_MAP is set in conftest, before any import of it

    messages = [{"role": "user", "content": PROMPT}]
    kwargs = dict(model=f"openai/{tiny.name}", api_base=live_server.base_url + "/v1", api_key=TEST_API_KEY,
                  messages=messages, max_tokens=10, temperature=0, extra_body=DENSE, num_retries=0)
    ref = engine_alone(tiny, messages, max_tokens=10, temperature=0)
    r = litellm.completion(**kwargs)
    assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_ids), len(ref.output_ids))
    chunks = list(litellm.completion(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1


# ---------------------------------------------------------------------------- lm-evaluation-harness
@pytest.fixture(scope="module")
def real_server(real_model_dir):
    """`igserve serve` in a process of its own (as deployed; lm-eval's in-process model then does
    not share this process's threads with the engine): the real model, dense (no bank), float32
    weights, what lm-eval's hf model computes. The token budget is given, not measured."""
    proc, base = start_process(DEFAULT_MODEL, "", "--weights", "fp32", "--max-model-len", "1024", "--max-batch", "8",
                               "--max-num-batched-tokens", "1024")
    yield base
    stop_process(proc)


def lm_eval_run(monkeypatch, model, model_args: dict, task: str, **kwargs) -> dict:
    """``lm_eval.simple_evaluate`` on one task of tests/data/lmeval, with its samples."""
    import lm_eval
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    monkeypatch.setattr(evaluator, "add_env_info", lambda results: None)  # runs pip, nvidia-smi...: seconds
    tasks = TaskManager(include_path=str(LMEVAL_TASKS), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks,
                                   log_samples=True, **kwargs)


def served_args(base_url: str, endpoint: str, tokenizer: Path) -> dict:
    return {"model": DEFAULT_MODEL, "base_url": base_url + endpoint, "tokenizer_backend": "huggingface",
            "tokenizer": str(tokenizer), "max_length": 1024, "max_retries": 1}


@pytest.mark.real_model
def test_lm_eval_local_completions_scores_as_the_in_process_hf_model(real_server, real_model_dir, monkeypatch):
    """Multiple choice by log-likelihood: lm-eval sends batches of token-id prompts with echo,
    max_tokens 1 and logprobs 1. Accuracy and every choice's log-likelihood equal lm-eval's
    transformers model on the same weights."""
    task = "igserve_arc_easy_40"
    served = lm_eval_run(monkeypatch, "local-completions", served_args(real_server, "/v1/completions", real_model_dir),
                         task, batch_size=8)
    hf = lm_eval_run(monkeypatch, "hf", {"pretrained": str(real_model_dir), "dtype": "float32", "device": "cpu"},
                     task, batch_size=16)
    for metric in ("acc,none", "acc_norm,none"):
        print(f"{metric}: igserve {served['results'][task][metric]:.4f}, hf {hf['results'][task][metric]:.4f}")
        assert served["results"][task][metric] == pytest.approx(hf["results"][task][metric], abs=0.01)

    def scores(out):
        return {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in out["samples"][task]}

    got, want = scores(served), scores(hf)
    assert len(got) == 40 and got.keys() == want.keys()
    print(f"largest log-likelihood difference: {max(abs(a - b) for d in want for a, b in zip(got[d], want[d])):.2e}")
    for doc in want:  # the server's float16 K/V cache (its default) moves a continuation's sum: up to
        # ~5e-3 on an AVX-512 BF16 EPYC, 1.1e-2 on an AMX Xeon (4.8e-5 there with a float32 cache)
        assert got[doc] == pytest.approx(want[doc], abs=2e-2), doc


@pytest.mark.real_model
def test_lm_eval_local_chat_completions_generates_as_the_engine(real_server, real, real_model_dir, monkeypatch):
    """generate_until through chat completions: every answer equals the engine's on the
    messages and stop strings lm-eval sent."""
    from lm_eval.models.utils import handle_stop_sequences

    task = "igserve_arc_easy_gen"
    args = {**served_args(real_server, "/v1/chat/completions", real_model_dir),
            "tokenizer_backend": None}  # as lm-eval's docs have it for chat: the server renders the template
    out = lm_eval_run(monkeypatch, "local-chat-completions", args, task, limit=4, apply_chat_template=True)
    samples = out["samples"][task]
    assert len(samples) == 4 and 0 <= out["results"][task]["exact_match,none"] <= 1
    refs = []
    for sample in samples:
        (prompt, gen_kwargs), = sample["arguments"]
        messages = json.loads(prompt[0])  # lm-eval's JsonChatStr: (the messages as JSON,)
        stop = handle_stop_sequences(gen_kwargs["until"], None)[:4]  # no tokenizer: no end-of-sequence string
        ids = real.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        refs.append(Request(ids, torch.ones(2 * real.model.config.num_hidden_layers, dtype=torch.bool),
                            SamplingParams(max_tokens=gen_kwargs["max_gen_toks"], temperature=0, stop=stop)))
    # one after another, as lm-eval sent them: float32 matmuls may round differently with other rows
    # beside them (seen on an AMX CPU), and a greedy near-tie then flips
    engine = LLMEngine(BlockRunner(real.model, max_batch=len(refs), max_len=1024, kv_dtype="auto"),  # as the server's
                       real.tokenizer)
    for r in refs:
        engine.generate([r])
    assert [s["resps"][0][0] for s in samples] == [r.text for r in refs]
    assert any(s["resps"][0][0].strip() for s in samples)
