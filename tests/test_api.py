"""The OpenAI-compatible API, driven by the official openai SDK against live uvicorn servers.

References: the synchronous engine running a request alone (outputs, usage), the router called
directly (routing), and HF generate (the real model). Errors must be OpenAI error objects with
the right status, param and code, and client input must never cause a 500.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from conftest import (TEST_API_KEY, TINY_BANK_TEXTS, LiveServer, free_port, metric_value, spawn_process, stop_process,
                      wait_process)

from router.router import Router, chat_routing_text
from server import api, cpu_kernels, loading, protocol, serving, weights
from server.engine import LLMEngine, Request
from server.runner import BlockRunner
from server.sampling import SamplingParams

PROMPTS = {
    "code": "def fibonacci(n):\n    # return the n-th Fibonacci number in Python",
    "math": "Compute 17 * 23 and solve the equation 2x + 6 = 20 step by step.",
    "chat": "Hey, how are you doing today? Any fun plans for the weekend?",
}
LONG = 240  # max_tokens that keeps a tiny-model request busy for a while (context 256)


@pytest.fixture(scope="module")
def client(live_server):
    return live_server.client()


@pytest.fixture(scope="module")
def model(tiny):
    return tiny.name


def run_alone(lm, prompt_ids, mask, **params) -> Request:
    """Reference: the synchronous engine with this one request."""
    runner = BlockRunner(lm.model, max_batch=1, max_len=256, kv_dtype="auto")  # as the server builds it
    engine = LLMEngine(runner, lm.tokenizer)
    return engine.generate([Request(list(prompt_ids), mask, SamplingParams(**params))])[0]


def chat_ids(lm, messages) -> list[int]:
    return lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


def mask_body(mask: str) -> dict:
    return {"igserve": {"mask": mask}}


def usage_of(r) -> tuple[int, int, int]:
    return r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens


# ---------------------------------------------------------------------------- basics
def test_models_and_health(live_server, client, model, tiny_bank):
    assert [m.id for m in client.models.list().data] == [model]
    health = httpx.get(live_server.base_url + "/health")  # no API key needed
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["routing"] == "ig"
    assert health.json()["masks"] == tiny_bank.all_mask_ids()
    body = health.json()
    # every format runs igserve's kernels where the fused blocks do (float32 activations), fp32 too
    expect = "igserve-avx2" if body["dtype"] == "float32" and cpu_kernels.available() else "torch"
    assert body["kernels"] == expect
    # auto: a float16 cache where the fused CPU blocks run (float32 activations with igserve's kernels)
    fused = body["dtype"] == "float32" and cpu_kernels.available()
    assert body["kv_cache_dtype"] == ("float16" if fused else body["dtype"])


def test_forced_masks_equal_the_engine_alone(client, model, tiny, tiny_bank):
    ids = tiny.tokenizer(PROMPTS["math"])["input_ids"]
    texts = set()
    for mask_id in tiny_bank.all_mask_ids():
        r = client.completions.create(model=model, prompt=PROMPTS["math"], max_tokens=12, temperature=0,
                                      extra_body=mask_body(mask_id))
        ref = run_alone(tiny, ids, tiny_bank.mask(mask_id), max_tokens=12, temperature=0)
        assert r.object == "text_completion" and r.model == model
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert usage_of(r) == (len(ids), len(ref.output_ids), len(ids) + len(ref.output_ids))
        assert r.igserve["mask"] == mask_id
        assert r.igserve["skip_ratio"] == pytest.approx(tiny_bank.skip_ratio(mask_id))
        assert r.igserve["router_ms"] == 0 and r.igserve["distance"] is None
        texts.add(ref.text)
    assert len(texts) == len(tiny_bank.all_mask_ids())  # every mask changes the output: the check has teeth


def test_auto_routing_uses_the_nearest_centroid(client, model, tiny, tiny_bank):
    router = Router(tiny_bank)
    for domain, prompt in PROMPTS.items():
        r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)  # "auto" by default
        expected = router.route([prompt])[0]
        assert r.igserve["mask"] == expected.mask_id == domain
        assert r.igserve["distance"] == pytest.approx(expected.distance, abs=1e-4)
        assert r.igserve["router_ms"] > 0
        ref = run_alone(tiny, tiny.tokenizer(prompt)["input_ids"], tiny_bank.mask(domain), max_tokens=6,
                        temperature=0)
        assert r.choices[0].text == ref.text


def test_bfloat16_server_routes_with_a_bfloat16_encoder(tiny_model_dir, tiny_bank, tiny_bank_file):
    loaded = loading.load_served(api.ServeConfig(model=str(tiny_model_dir), bank=str(tiny_bank_file), dtype="bfloat16"))
    router = loaded.engine.engine.router
    assert router.encoder.dtype == torch.bfloat16
    prompts = list(PROMPTS.values())
    assert [r.mask_id for r in router.route(prompts)] == [r.mask_id for r in Router(tiny_bank).route(prompts)]


def test_chat_routes_on_last_user_turn_and_system(client, model, tiny, tiny_bank):
    messages = [{"role": "system", "content": "You are a patient math tutor."},
                {"role": "user", "content": "Hi! Nice to meet you."},
                {"role": "assistant", "content": "Nice to meet you too."},
                {"role": "user", "content": PROMPTS["code"]}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    expected = Router(tiny_bank).route([chat_routing_text(messages)])[0]
    assert r.igserve["mask"] == expected.mask_id
    ids = chat_ids(tiny, messages)
    ref = run_alone(tiny, ids, tiny_bank.mask(expected.mask_id), max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert usage_of(r) == (len(ids), len(ref.output_ids), len(ids) + len(ref.output_ids))


# ---------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_equals_non_streaming(client, model, chat):
    kwargs = dict(model=model, max_tokens=10, temperature=0, extra_body=mask_body("code"))
    if chat:
        create, kwargs["messages"] = client.chat.completions.create, [{"role": "user", "content": PROMPTS["chat"]}]
    else:
        create, kwargs["prompt"] = client.completions.create, PROMPTS["chat"]
    full = create(**kwargs)
    chunks = list(create(**kwargs, stream=True, stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    text = "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text for c in body)
    assert text == (full.choices[0].message.content if chat else full.choices[0].text)
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == [full.choices[0].finish_reason]
    assert body[-1].choices[0].finish_reason is not None  # the finish reason ends the content
    assert chunks[-1].choices == [] and usage_of(chunks[-1]) == usage_of(full)
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.igserve["mask"] == "code" for c in chunks)
    if chat:
        assert body[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" for c in chunks)
    # without include_usage: no usage chunk
    plain = list(create(**kwargs, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


def test_sse_framing(live_server, model):
    body = {"model": model, "prompt": "Hello", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", live_server.base_url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


# ---------------------------------------------------------------------------- sampling parameters
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_sequences(client, model, tiny, stream):
    ids = tiny.tokenizer(PROMPTS["chat"])["input_ids"]
    dense = torch.ones(8, dtype=torch.bool)
    text = run_alone(tiny, ids, dense, max_tokens=24, temperature=0).text
    mid = len(text) // 2
    stop = text[mid:mid + 3]
    assert stop.strip(), text
    ref = run_alone(tiny, ids, dense, max_tokens=24, temperature=0, stop=[stop])
    assert ref.text == text[:text.index(stop)] and ref.finish_reason == "stop"
    for stop_arg in (stop, ["no such text", stop]):
        r = client.completions.create(model=model, prompt=PROMPTS["chat"], max_tokens=24, temperature=0,
                                      stop=stop_arg, stream=stream, extra_body=mask_body("dense"),
                                      **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
        else:
            got, finish, usage = r.choices[0].text, [r.choices[0].finish_reason], r.usage
        assert got == ref.text and finish == ["stop"]
        assert usage.completion_tokens == len(ref.output_ids) < 24


def test_seeded_sampling_matches_the_engine(client, model, tiny):
    ids = tiny.tokenizer(PROMPTS["code"])["input_ids"]
    dense = torch.ones(8, dtype=torch.bool)
    texts = []
    for seed in (123, 124):
        r = client.completions.create(model=model, prompt=PROMPTS["code"], max_tokens=12, temperature=0.9,
                                      top_p=0.95, seed=seed, extra_body=mask_body("dense"))
        ref = run_alone(tiny, ids, dense, max_tokens=12, temperature=0.9, top_p=0.95, seed=seed)
        assert r.choices[0].text == ref.text
        texts.append(ref.text)
    assert texts[0] != texts[1]


def test_penalties_top_k_min_p_and_logit_bias_match_the_engine(client, model, tiny):
    ids = tiny.tokenizer(PROMPTS["chat"])["input_ids"]
    dense = torch.ones(8, dtype=torch.bool)
    extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.3)
    r = client.completions.create(model=model, prompt=PROMPTS["chat"], max_tokens=12, temperature=0.8, seed=7,
                                  presence_penalty=0.6, frequency_penalty=0.4,
                                  extra_body={**extra, **mask_body("dense")})
    ref = run_alone(tiny, ids, dense, max_tokens=12, temperature=0.8, seed=7, presence_penalty=0.6,
                    frequency_penalty=0.4, **extra)
    assert r.choices[0].text == ref.text
    assert run_alone(tiny, ids, dense, max_tokens=12, temperature=0.8, seed=7).text != ref.text  # the fields bite
    # +100 on one token makes greedy decoding repeat it; the ignored fields change nothing
    r = client.completions.create(model=model, prompt=PROMPTS["chat"], max_tokens=4, temperature=0,
                                  logit_bias={"1000": 100}, user="u",
                                  extra_body={"store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                                              **mask_body("dense")})
    assert r.choices[0].text == tiny.tokenizer.decode([1000] * 4, skip_special_tokens=True)


def test_tool_messages_render_through_the_chat_template(client, model, tiny):
    messages = [{"role": "user", "content": "What is 6 * 7?"},
                {"role": "tool", "content": "42", "tool_call_id": "call-1"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                       tools=[{"type": "function", "function": {"name": "calc"}}], tool_choice="none",
                                       parallel_tool_calls=False, extra_body=mask_body("dense"))
    ids = chat_ids(tiny, messages)
    assert "<|im_start|>tool" in tiny.tokenizer.decode(ids)
    ref = run_alone(tiny, ids, torch.ones(8, dtype=torch.bool), max_tokens=6, temperature=0)
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == len(ids)


# ---------------------------------------------------------------------------- batching
def test_concurrent_requests_with_different_masks_equal_each_alone(client, model, tiny_bank):
    """More requests than slots (4), mixed masks, lengths, sampling and streaming: joins and
    leaves between steps, and a shared step must not change any request's result."""
    masks = tiny_bank.all_mask_ids() + ["auto"]
    jobs = [dict(prompt=list(PROMPTS.values())[i % 3] + " " * (i % 2), mask=masks[i % len(masks)],
                 max_tokens=6 + 3 * i, seed=i if i % 3 == 0 else None, stream=i % 2 == 1) for i in range(9)]

    def call(job):
        sampling = {"temperature": 0.8, "seed": job["seed"]} if job["seed"] is not None else {"temperature": 0}
        r = client.completions.create(model=model, prompt=job["prompt"], max_tokens=job["max_tokens"],
                                      stream=job["stream"], extra_body=mask_body(job["mask"]), **sampling,
                                      **({"stream_options": {"include_usage": True}} if job["stream"] else {}))
        if job["stream"]:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            return text, chunks[-1].usage.completion_tokens, chunks[0].igserve["mask"]
        return r.choices[0].text, r.usage.completion_tokens, r.igserve["mask"]

    alone = [call(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(call, jobs))
    assert together == alone
    assert len({mask for _, _, mask in together}) >= 4


def test_ignore_eos_generates_past_the_end_of_sequence(serve_tiny, tiny, model):
    """vLLM's ``ignore_eos``: the greedy first token is made an end-of-sequence token; without the
    flag the request stops there, with it it runs to max_tokens."""
    server = serve_tiny()
    prompt = [5, 6, 7, 8]
    dense = torch.ones(1, 2 * tiny.model.config.num_hidden_layers, dtype=torch.bool)
    first = int(BlockRunner(tiny.model, max_batch=1, max_len=256).prefill([prompt], dense, [0]).argmax())
    server.app.state.service.loaded.engine.engine.eos_ids.add(first)
    client = server.client()
    body = dict(model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"igserve": {"mask": "dense"}})
    stopped = client.completions.create(**body)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    body["extra_body"]["ignore_eos"] = True
    full = client.completions.create(**body)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 6


def test_a_router_fault_fails_only_the_requests_being_routed(serve_tiny, model):
    """An encoder failure is a server fault (500, OpenAI error object) for the requests it was
    routing; a request in flight with a forced mask finishes, and the server keeps serving."""
    server = serve_tiny(max_tokens_limit=LONG)
    engine = server.app.state.service.loaded.engine.engine
    original = engine.router.route
    client = server.client()
    running = client.completions.create(model=model, prompt="Once upon a time", max_tokens=LONG, temperature=0,
                                        stream=True, extra_body=mask_body("dense"))
    next(iter(running))  # in the batch

    def broken(texts):
        raise RuntimeError("encoder exploded")

    engine.router.route = broken
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=model, prompt="hello", max_tokens=2)
    assert info.value.status_code == 500 and set(info.value.body) == {"message", "type", "param", "code"}
    assert [c.choices[0].finish_reason for c in running][-1] == "length"
    engine.router.route = original
    assert client.completions.create(model=model, prompt="hello", max_tokens=2).usage.completion_tokens == 2


def test_engine_routes_the_requests_it_admits_in_one_encoder_batch(tiny, tiny_bank):
    """Requests without a mask are routed at admission: one encoder call per admitting step, each
    request getting the route Router.route gives it."""
    router = Router(tiny_bank)
    calls = []
    original = router.route
    router.route = lambda texts, *options: calls.append(list(texts)) or original(texts, *options)
    engine = LLMEngine(BlockRunner(tiny.model, max_batch=4, max_len=256), tiny.tokenizer, router=router)
    texts = list(TINY_BANK_TEXTS.values()) + ["Integrate x squared from zero to one.", "def add(a, b): return a + b"]
    params = SamplingParams(max_tokens=2, temperature=0)
    reqs = [Request([5, 6, 7], None, params, mask_id=None, routing_text=t) for t in texts]
    engine.generate(reqs)
    assert calls == [texts[:4], texts[4:]]  # 4 slots: four routed together, the fifth when a slot frees
    for req, route in zip(reqs, original(texts)):
        assert req.mask_id == route.mask_id and req.route.distance == pytest.approx(route.distance, abs=1e-5)
        assert torch.equal(req.mask, tiny_bank.mask(route.mask_id)) and req.finish_reason == "length"
    with pytest.raises(ValueError, match="routing text"):
        LLMEngine(BlockRunner(tiny.model, max_batch=1, max_len=256), tiny.tokenizer).add(
            Request([5], None, params, mask_id=None, routing_text="no router"))


# ---------------------------------------------------------------------------- errors
DELETE = object()
BASE = {"/completions": {"prompt": "hello", "max_tokens": 4},
        "/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}}
ERROR_CASES = [
    # path, change to a valid body, status, param, code
    ("/completions", {"temperature": "hot"}, 400, "temperature", None),
    ("/completions", {"temperature": 2.5}, 400, "temperature", None),
    ("/completions", {"top_p": 0}, 400, "top_p", None),
    ("/completions", {"max_tokens": 0}, 400, "max_tokens", None),
    ("/completions", {"max_tokens": 201}, 400, "max_tokens", None),  # over --max-tokens-limit
    ("/chat/completions", {"max_completion_tokens": 500}, 400, "max_completion_tokens", None),
    ("/completions", {"stop": 5}, 400, "stop", None),
    ("/completions", {"stop": ["a"] * (protocol.MAX_STOP_SEQUENCES + 1)}, 400, "stop", None),
    ("/completions", {"seed": "x"}, 400, "seed", None),
    ("/completions", {"stream": "yes"}, 400, "stream", None),
    ("/completions", {"stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/completions", {"prompt": DELETE}, 400, "prompt", None),
    ("/completions", {"prompt": 42}, 400, "prompt", None),
    ("/completions", {"prompt": [1, 10**9]}, 400, "prompt", None),
    ("/completions", {"prompt": ""}, 400, "prompt", None),
    ("/completions", {"ignore_eos": "yes"}, 400, "ignore_eos", None),
    ("/completions", {"igserve": {"mask": 7}}, 400, "igserve.mask", None),
    ("/completions", {"igserve": {"mask": "nope"}}, 400, "igserve.mask", "unknown_mask"),
    ("/completions", {"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/completions", {"prompt": [100] * 300}, 400, "prompt", "context_length_exceeded"),
    ("/completions", {"prompt": [100] * 200, "max_tokens": 100}, 400, "max_tokens", "context_length_exceeded"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]}, 400, "messages",
     "context_length_exceeded"),
    ("/chat/completions", {"messages": []}, 400, "messages", None),
    ("/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", None),
    ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content", None),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
    ("/chat/completions", {"tools": [{"type": "function"}]}, 400, "tools[0].function", None),
    ("/completions", {"logit_bias": {"49152": 1}}, 400, "logit_bias", None),
    ("/completions", {"frequency_penalty": 2.5}, 400, "frequency_penalty", None),
    ("/completions", {"tools": []}, 400, "tools", None),  # completions have no tools: unknown field
    ("/completions", {"n": protocol.MAX_N + 1}, 400, "n", None),
    ("/completions", {"logprobs": protocol.MAX_COMPLETION_LOGPROBS + 1}, 400, "logprobs", None),
    ("/completions", {"prompt": ["a"] * 3, "n": 5}, 400, "n", None),  # 15 choices > 4 slots + 8 waiting
    ("/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs", None),
    ("/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, 400,
     "response_format", None),
]


@pytest.mark.parametrize("path,change,status,param,code", ERROR_CASES,
                         ids=[f"{p}:{','.join(c)}:{s}" for p, c, s, _, _ in ERROR_CASES])
def test_error_objects(client, model, tiny, tiny_bank, path, change, status, param, code):
    body = {"model": model, **BASE[path], **change}
    body = {k: v for k, v in body.items() if v is not DELETE}
    with pytest.raises(openai.APIStatusError) as info:
        client.post(path, body=body, cast_to=object)
    err = info.value
    assert err.status_code == status
    assert set(err.body) == {"message", "type", "param", "code"}
    assert err.body["param"] == param and err.body["code"] == code
    message = err.body["message"]
    if code == "context_length_exceeded":  # names the context size and the prompt size
        n_prompt = len(chat_ids(tiny, body["messages"]) if "messages" in body else body["prompt"])
        assert "256" in message and str(n_prompt) in message
    else:
        assert param.split(".")[-1].split("[")[0] in message
    if code == "unknown_mask":
        assert all(m in message for m in tiny_bank.all_mask_ids())


def test_sdk_exception_classes(live_server, client, model):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", temperature=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    wrong = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.body["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}])
def test_api_key_required_on_v1_only(live_server, headers):
    for path in ("/v1/models",):
        r = httpx.get(live_server.base_url + path, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(live_server.base_url + "/v1/completions", headers=headers, json={"model": "x", "prompt": "y"})
    assert r.status_code == 401
    for path in ("/health", "/metrics"):
        assert httpx.get(live_server.base_url + path, headers=headers).status_code == 200


@pytest.mark.parametrize("raw", [b'{"model": ', b"[1, 2]", b"", b"\xff\xfe", b"null", b'"text"', b"{'a': 1}"])
def test_malformed_json_is_400(live_server, raw):
    r = httpx.post(live_server.base_url + "/v1/chat/completions", content=raw,
                   headers={"Authorization": f"Bearer {TEST_API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_client_input_never_causes_a_500(live_server, model):
    bodies = [None, True, 1, [], {}, {"model": None}, {"model": model, "prompt": {"a": 1}},
              {"model": model, "prompt": [True]}, {"model": model, "prompt": [-1]}, {"model": model, "prompt": [[1]]},
              {"model": model, "messages": "hi"}, {"model": model, "messages": [{}]},
              {"model": model, "messages": [None]}, {"model": model, "messages": [{"role": "user"}], "max_tokens": 2},
              {"model": model, "messages": [{"role": "assistant", "content": "x"}], "max_tokens": 2},
              {"model": model, "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
              {"model": model, "prompt": "x", "max_tokens": 1.5}, {"model": model, "prompt": "x", "top_p": -0.0},
              {"model": model, "prompt": "x", "seed": 2**70, "max_tokens": 2},
              {"model": model, "prompt": "x", "stop": [""], "max_tokens": 2},
              {"model": model, "prompt": "x", "igserve": None}, {"model": model, "prompt": "x", "igserve": {"x": 1}}]
    raw = [f'{{"model": "{model}", "prompt": "x", "{field}": {value}}}'.encode()
           for field in ("temperature", "top_p", "max_tokens", "seed") for value in ("NaN", "Infinity", "1e999")]
    headers = {"Authorization": f"Bearer {TEST_API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=live_server.base_url, headers=headers) as http:
        for body in [json.dumps(b).encode() for b in bodies] + raw:
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = http.post(path, content=body)
                assert r.status_code < 500, (path, body, r.text)
        assert http.get("/v1/nowhere").status_code == 404
        assert http.get("/v1/completions").status_code == 405


# ---------------------------------------------------------------------------- capacity and disconnects
@pytest.fixture(scope="module")
def small_server(serve_tiny):
    """One slot and one waiting place."""
    return serve_tiny(max_batch=1, max_queue=1, max_tokens_limit=LONG)


def _long_stream(client, model):
    return client.completions.create(model=model, prompt="Once upon a time", max_tokens=LONG, temperature=0,
                                     stream=True, extra_body=mask_body("dense"))


def test_queue_full_is_429_with_retry_after(small_server, model, tiny):
    ref = run_alone(tiny, tiny.tokenizer("Once upon a time")["input_ids"], torch.ones(8, dtype=torch.bool),
                    max_tokens=LONG, temperature=0)
    assert len(ref.output_ids) == LONG  # no early EOS: the two streams below stay in flight
    client = small_server.client()
    running, waiting = _long_stream(client, model), _long_stream(client, model)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
    assert info.value.response.headers["retry-after"] == "1"
    running.close()
    waiting.close()
    deadline = time.monotonic() + 10  # the disconnects free both places
    while True:
        try:
            assert client.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens == 2
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_disconnect_frees_the_slot(small_server, model):
    client = small_server.client()
    before = small_server.metrics()
    stream = _long_stream(client, model)
    assert next(iter(stream)).choices[0].text is not None  # running
    # a non-streaming request queued behind it whose client gives up
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.1).completions.create(model=model, prompt="hi", max_tokens=LONG)
    stream.close()
    r = client.completions.create(model=model, prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    time.sleep(0.1)  # the last step's metrics land after the response
    after = small_server.metrics()

    def delta(name, **labels):
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("igserve_request_success_total", finished_reason="abort") == 2
    assert delta("igserve_request_success_total", finished_reason="length") == 1
    generated = delta("igserve_generation_tokens_total")
    assert 3 < generated < LONG + 3  # the streamed request was stopped early, the queued one never ran
    assert metric_value(after, "igserve_num_requests_running") == 0
    assert metric_value(after, "igserve_num_requests_waiting") == 0


# ---------------------------------------------------------------------------- modes and process
def test_dense_mode_without_a_bank(tiny_model_dir, tmp_path, model):
    from server.api import ServeConfig

    server = LiveServer(ServeConfig(model=str(tiny_model_dir), bank=str(tmp_path / "missing.json"),
                                    max_batch=2, max_model_len=256)).start()
    try:
        assert httpx.get(server.base_url + "/health").json()["routing"] == "dense"
        client = server.client()
        r = client.completions.create(model=model, prompt=PROMPTS["code"], max_tokens=4)
        assert r.igserve["mask"] == "dense" and r.igserve["skip_ratio"] == 0
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="x", extra_body=mask_body("code"))
        assert "auto, dense" in info.value.body["message"]
    finally:
        server.stop()


def test_health_is_503_until_loaded(tiny_model_dir, monkeypatch, model):
    import threading

    release = threading.Event()
    load = serving.load_served
    monkeypatch.setattr(serving, "load_served", lambda *args: release.wait(60) and load(*args))
    server = LiveServer(api.ServeConfig(model=str(tiny_model_dir), bank=None, max_batch=1)).start(wait=False)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(server.base_url + "/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "loading"
        unavailable = dict(model_name=model, error_type="service_unavailable")
        before = metric_value(server.metrics(), "igserve_request_errors_total", **unavailable)
        with pytest.raises(openai.InternalServerError) as info:
            server.client().completions.create(model=model, prompt="x")
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "5"
        assert metric_value(server.metrics(), "igserve_request_errors_total", **unavailable) == before + 1
        release.set()
        server.wait_healthy()
        assert server.client().completions.create(model=model, prompt="x", max_tokens=1).usage.completion_tokens == 1
    finally:
        release.set()
        server.stop()


def test_mismatching_bank_exits_with_the_bank_error(tiny_model_dir, tmp_path, tiny_bank, capsys):
    from server import cli

    bad = dict(vars(tiny_bank), model={"name": "other", "fingerprint": "sha256:0000"})
    path = tmp_path / "bad.json"
    type(tiny_bank)(**bad).save(path)
    code = cli.main(["serve", "--model", str(tiny_model_dir), "--bank", str(path), "--port", str(free_port()),
                     "--log-level", "warning"])
    assert code == 1
    err = capsys.readouterr().err
    assert "error: mask bank was built for model 'other'" in err and "sha256:0000" in err
    assert "Traceback" not in err


def test_sigterm_drains_in_flight_requests(tiny_model_dir, tiny_bank_file, model):
    """`igserve serve` in a subprocess: a stream in flight when SIGTERM arrives completes."""
    proc, base = spawn_process(tiny_model_dir, tiny_bank_file, "--max-batch", "2", "--max-tokens-limit", str(LONG))
    try:
        wait_process(proc, base)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=LONG, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body=mask_body("dense"))
        chunks = iter(stream)
        first = next(chunks)
        proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] == ["length"]
        assert rest[-1].usage.completion_tokens == LONG
        assert len([first, *rest]) > 2
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after draining
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health")
    finally:
        stop_process(proc)


# ---------------------------------------------------------------------------- the real model
@pytest.mark.real_model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_chat_matches_hf_generate(real, dtype):
    import copy

    from server.api import ServeConfig

    server = LiveServer(ServeConfig(model=real.name, bank=None, max_batch=2, max_model_len=512, dtype=dtype)).start()
    try:
        health = httpx.get(server.base_url + "/health").json()
        assert health["dtype"] == dtype and health["kernels"] == (
            "igserve-avx2" if dtype == "float32" and cpu_kernels.available() else "torch")
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = server.client().chat.completions.create(model=real.name, messages=messages, max_tokens=12,
                                                    temperature=0)
        ids = real.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        reference = copy.deepcopy(real.model).to(getattr(torch, dtype))
        out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):]
        assert r.choices[0].message.content == real.tokenizer.decode(out, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out)
        assert "Paris" in r.choices[0].message.content
    finally:
        server.stop()


# ---------------------------------------------------------------------------- bench serve
def test_bench_serve_reports_every_run(live_server, tmp_path):
    from server import cli

    out = tmp_path / "serve.json"
    assert cli.main(["bench", "serve", "--url", live_server.base_url, "--api-key", live_server.api_key,
                     "--clients", "1,2", "--requests-per-client", "2", "--max-tokens", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["mode"], r["clients"]) for r in result["runs"]] == [("ig", 1), ("dense", 1), ("ig", 2), ("dense", 2)]
    keys = {"mode", "clients", "output_tok_s", "ttft_ms_p50", "ttft_ms_p95", "tpot_ms_p50", "router_ms_p50",
            "skip_ratio_mean", "requests", "errors"}
    for run in result["runs"]:
        assert keys <= set(run)
        assert run["requests"] == 2 * run["clients"] and run["errors"] == 0
        assert run["output_tokens"] == 3 * run["requests"] and run["output_tok_s"] > 0
        assert 0 < run["ttft_ms_p50"] <= run["ttft_ms_p95"] and run["tpot_ms_p50"] > 0
        if run["mode"] == "dense":
            assert run["skip_ratio_mean"] == 0 and run["router_ms_p50"] == 0
        else:
            assert run["skip_ratio_mean"] == pytest.approx(0.25) and run["router_ms_p50"] > 0
        assert 0 <= run["prompt_cached_share"] < 1
    # the dense runs' prompts share their chat template's start, which the prefix cache holds
    assert max(r["prompt_cached_share"] for r in result["runs"] if r["mode"] == "dense") > 0
    assert set(result["acceptance"]) >= {"router_ok", "ig_faster_ok", "scaling_ok"}
    # the machine the command ran on and the command itself, as every bench report records them
    assert result["machine"]["cpu_flags"] == weights.cpu_flags() and result["machine"]["cpus"] == os.cpu_count()
    assert result["command"].startswith("igserve bench serve --url ") and "--clients 1,2" in result["command"]


def test_tokenize_and_detokenize_as_vllm(live_server, model, tiny, tiny_bank):
    headers = {"Authorization": f"Bearer {TEST_API_KEY}"}
    with httpx.Client(base_url=live_server.base_url, headers=headers) as http:
        r = http.post("/tokenize", json={"model": model, "prompt": "Hello world"}).json()
        assert r["tokens"] == tiny.tokenizer("Hello world")["input_ids"] and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 256
        messages = [{"role": "user", "content": "hi"}]
        r = http.post("/tokenize", json={"model": model, "messages": messages}).json()
        assert r["tokens"] == chat_ids(tiny, messages)
        assert http.post("/detokenize", json={"model": model, "tokens": r["tokens"]}).json()["prompt"] == \
            tiny.tokenizer.decode(r["tokens"])
        bad = http.post("/tokenize", json={"model": model, "prompt": "x", "messages": messages})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        assert http.post("/detokenize", json={"model": model, "tokens": [-1]}).json()["error"]["param"] == "tokens"
        assert httpx.post(live_server.base_url + "/tokenize", json={"model": model, "prompt": "x"}).status_code == 401
    card = live_server.client().models.list().data[0]
    assert card.id == model and set(card.model_extra["masks"]) == set(tiny_bank.all_mask_ids())


# ---------------------------------------------------------------------------- logprobs, echo, choices
def test_logprobs_and_echo_equal_the_runner_log_softmax(client, model, tiny):
    """Sampled-token logprobs and echoed prompt logprobs (max_tokens 0 and 1) are log_softmax of
    the runner's full-sequence logits at those positions; the first prompt token has none."""
    ids = tiny.tokenizer(PROMPTS["math"])["input_ids"]
    r = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, logprobs=2,
                                  extra_body=mask_body("dense"))
    out = r.choices[0].logprobs
    full = ids + tiny.tokenizer(r.choices[0].text, add_special_tokens=False)["input_ids"]
    runner = BlockRunner(tiny.model, max_batch=1, max_len=256)
    lp = torch.log_softmax(runner.forward(torch.tensor([full]), torch.ones(8, dtype=torch.bool))[0].float(), -1)
    expected = [lp[len(ids) - 1 + i, full[len(ids) + i]].item() for i in range(len(out.token_logprobs))]
    # the server's float16 K/V cache moves them by up to ~1e-3 from this cache-free float32 forward
    assert out.token_logprobs == pytest.approx(expected, abs=2e-3) and len(out.token_logprobs) == 4
    assert all(len(top) == 2 for top in out.top_logprobs)
    prompt_lp = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    for max_tokens in (0, 1):
        e = client.completions.create(model=model, prompt=[ids, ids[:5]], max_tokens=max_tokens, echo=True,
                                      logprobs=1, temperature=0, extra_body=mask_body("dense"))
        assert [c.index for c in e.choices] == [0, 1]
        first = e.choices[0]
        assert first.logprobs.token_logprobs[0] is None
        assert first.logprobs.token_logprobs[1:len(ids)] == pytest.approx(prompt_lp, abs=2e-3)
        assert len(first.logprobs.token_logprobs) == len(ids) + max_tokens
        assert first.text.startswith(tiny.tokenizer.decode(ids))
        assert e.usage.prompt_tokens == len(ids) + 5 and e.usage.completion_tokens == 2 * max_tokens


def test_chat_logprobs_and_n(client, model):
    messages = [{"role": "user", "content": "Give me a person."}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0.9, seed=3, n=3,
                                       logprobs=True, top_logprobs=3, extra_body=mask_body("dense"))
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # seed + j per choice
    assert all(len(c.logprobs.content) == 5 and len(c.logprobs.content[0].top_logprobs) == 3 for c in r.choices)


# ---------------------------------------------------------------------------- n > 1: one prefill per prompt
def record_rows(runner: BlockRunner, monkeypatch) -> list[tuple[int, int]]:
    """(start, length) of every row the runner computes from now on (prefill chunks and decode)."""
    rows = []
    extend_hidden = runner.extend_hidden

    def spy(chunks, starts, *args):
        rows.extend(zip(starts, map(len, chunks)))
        return extend_hidden(chunks, starts, *args)

    monkeypatch.setattr(runner, "extend_hidden", spy)
    return rows


def prompt_positions(rows: list[tuple[int, int]], n: int) -> int:
    """How many computed positions lie in an n-token prompt (decode rows all start past it)."""
    return sum(max(0, min(start + length, n) - start) for start, length in rows)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_n_greedy_choices_equal_one_run_and_prefill_the_prompt_once(live_server, client, model, tiny, stream,
                                                                     monkeypatch):
    """n = 3 prefills a new prompt once; the same prompt again then finds it in the prefix cache
    (all but its last token), and both equal the prompt run alone."""
    client.completions.create(model=model, prompt="warm", max_tokens=1)  # start-up's step timing is done
    rows = record_rows(live_server.app.state.service.loaded.engine.engine.runner, monkeypatch)
    ids = tiny.tokenizer(f"{'Streamed' if stream else 'Plain'} choices: " + PROMPTS["code"])["input_ids"]
    ref = run_alone(tiny, ids, torch.ones(8, dtype=torch.bool), max_tokens=10, temperature=0)
    before = live_server.metrics()
    r = client.completions.create(model=model, prompt=ids, n=3, max_tokens=10, temperature=0, stream=stream,
                                  extra_body=mask_body("dense"))
    if stream:
        texts = ["", "", ""]
        for chunk in r:
            texts[chunk.choices[0].index] += chunk.choices[0].text
    else:
        texts = [c.text for c in r.choices]
        assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == 3 * len(ref.output_ids)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert texts == [ref.text] * 3
    assert prompt_positions(rows, len(ids)) == len(ids)  # one prefill: the other choices copied its cache
    after = live_server.metrics()
    assert metric_value(after, "igserve_prompt_tokens_total") - metric_value(before, "igserve_prompt_tokens_total") \
        == len(ids)
    rows.clear()
    again = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0,
                                      extra_body=mask_body("dense"))
    assert again.choices[0].text == ref.text
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    assert prompt_positions(rows, len(ids)) == 1
    hits = metric_value(live_server.metrics(), "igserve_prefix_cache_hit_tokens_total") - \
        metric_value(after, "igserve_prefix_cache_hit_tokens_total")
    assert hits == len(ids) - 1


def test_n_seeded_choices_draw_with_seed_plus_j(client, model, tiny, tiny_bank):
    """Choice j of a seeded request equals a run alone with seed + j, for each prompt of a list
    and with a routed mask (the choices run under the first one's route)."""
    expected = Router(tiny_bank).route([PROMPTS["math"]])[0].mask_id
    r = client.completions.create(model=model, prompt=[PROMPTS["math"], PROMPTS["chat"]], n=3, max_tokens=8,
                                  temperature=0.9, top_p=0.95, seed=41)
    assert r.igserve["mask"] == expected
    assert [c.index for c in r.choices] == list(range(6))
    for i, prompt in enumerate([PROMPTS["math"], PROMPTS["chat"]]):
        ids = tiny.tokenizer(prompt)["input_ids"]
        mask = tiny_bank.mask(Router(tiny_bank).route([prompt])[0].mask_id)
        for j in range(3):
            ref = run_alone(tiny, ids, mask, max_tokens=8, temperature=0.9, top_p=0.95, seed=41 + j)
            assert r.choices[3 * i + j].text == ref.text, (i, j)
    assert len({c.text for c in r.choices[:3]}) > 1


def test_n_choices_share_the_echoed_prompt_logprobs(client, model, tiny):
    ids = tiny.tokenizer(PROMPTS["chat"])["input_ids"]
    one = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=2,
                                    extra_body=mask_body("dense"))
    for max_tokens in (0, 3):
        r = client.completions.create(model=model, prompt=ids, n=2, max_tokens=max_tokens, echo=True, logprobs=2,
                                      temperature=0, extra_body=mask_body("dense"))
        for c in r.choices:
            lp = c.logprobs
            assert lp.token_logprobs[:len(ids)] == one.choices[0].logprobs.token_logprobs
            assert lp.top_logprobs[:len(ids)] == one.choices[0].logprobs.top_logprobs
            assert len(lp.tokens) == len(ids) + max_tokens
        assert r.choices[0].text == r.choices[1].text
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 2 * max_tokens


def test_choices_without_a_free_slot_prefill_on_their_own(tiny, monkeypatch):
    """Two slots, four choices of one prompt: the second gets a copy of the first's cache, the
    others wait and prefill alone when slots free; every output equals the prompt run alone."""
    runner = BlockRunner(tiny.model, max_batch=2, max_len=256, kv_dtype="auto")  # the cache run_alone uses
    rows = record_rows(runner, monkeypatch)
    engine = LLMEngine(runner, tiny.tokenizer)
    ids = tiny.tokenizer(PROMPTS["math"])["input_ids"]
    dense = torch.ones(8, dtype=torch.bool)
    first = Request(list(ids), dense, SamplingParams(max_tokens=6, temperature=0, logprobs=1))
    reqs = [first] + [Request(list(ids), dense, SamplingParams(max_tokens=6, temperature=0, logprobs=1),
                              shares_prefill_of=first) for _ in range(3)]
    engine.generate(reqs)
    ref = run_alone(tiny, ids, dense, max_tokens=6, temperature=0, logprobs=1)
    for req in reqs:
        assert req.output_ids == ref.output_ids and req.text == ref.text
        assert req.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert [r.num_shared for r in reqs] == [0, len(ids), 0, 0]
    assert prompt_positions(rows, len(ids)) == 3 * len(ids)
    with pytest.raises(ValueError, match="same prompt"):
        engine.add(Request(list(ids[:-1]), dense, SamplingParams(), shares_prefill_of=first))


# ---------------------------------------------------------------------------- structured outputs
STRICT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "active": {"type": "boolean"},
    },
    "required": ["name", "role", "age", "active"],
    "additionalProperties": False,
}


def test_json_schema_output_validates_and_equals_the_engine(live_server, client, model, tiny):
    """Every choice parses and validates against a strict schema (required fields, enum,
    integer bounds); greedy output equals the engine alone with the same grammar, and the same
    request without the format does not parse (the grammar is what makes it JSON)."""
    import jsonschema

    messages = [{"role": "user", "content": "Give me a user record as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": STRICT_SCHEMA, "strict": True}}
    kwargs = dict(model=model, messages=messages, max_tokens=80, extra_body=mask_body("dense"))
    greedy = client.chat.completions.create(**kwargs, temperature=0, response_format=fmt)
    sampled = client.chat.completions.create(**kwargs, temperature=1.0, seed=9, n=3, response_format=fmt)
    for choice in greedy.choices + sampled.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), STRICT_SCHEMA)
    assert len({c.message.content for c in sampled.choices}) > 1
    structured = live_server.app.state.service.loaded.structured
    runner = BlockRunner(tiny.model, max_batch=1, max_len=256)
    ref = LLMEngine(runner, tiny.tokenizer).generate([Request(
        chat_ids(tiny, messages), torch.ones(8, dtype=torch.bool), SamplingParams(max_tokens=80, temperature=0),
        grammar=structured.matcher(fmt))])[0]
    assert greedy.choices[0].message.content == ref.text
    plain = client.chat.completions.create(**kwargs, temperature=0)
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].message.content)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
    {"type": "json_schema"},
    {"type": "json_object", "json_schema": {"name": "x", "schema": {}}},
    {"type": "yaml"},
], ids=["unknown-type", "missing-ref", "not-an-object", "no-json-schema", "schema-with-json-object", "yaml"])
def test_a_bad_response_format_is_a_400_error_object(live_server, model, fmt):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": fmt}
    r = httpx.post(live_server.base_url + "/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {TEST_API_KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"].startswith("response_format"), err


def test_routing_options_budget_and_max_loss(client, model, tiny_bank):
    """igserve.budget picks among the bank's budgets; a budget it lacks, max_loss on a centroid
    bank, or either with a forced mask is a 400 naming the field; responses say budget and fallback."""
    r = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=2,
                                  extra_body={"igserve": {"budget": 0.25}})
    info = r.model_extra["igserve"]
    assert info["budget"] == 0.25 and info["fallback"] is False and info["mask"] in tiny_bank.mask_ids
    for igserve, param in (({"budget": 0.5}, "igserve.budget"), ({"max_loss": 0.1}, "igserve.max_loss"),
                           ({"mask": "dense", "budget": 0.25}, "igserve.budget")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"igserve": igserve})
        assert exc.value.body["param"] == param, exc.value.body
