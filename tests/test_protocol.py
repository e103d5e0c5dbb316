"""Request validation (good and bad values, the param each error names) and the helpers that turn
a request into engine parameters and sampler outputs into OpenAI logprobs objects."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from server import protocol
from server.errors import APIError, from_validation
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.sampling import MAX_LOGPROBS

COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(kind, body: dict):
    return kind.model_validate_json(json.dumps(body))


def error_param(kind, body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        parse(kind, body)
    err = from_validation(info.value)
    assert err.status == 400
    return err.param


GOOD_COMPLETIONS = [
    {"prompt": ["a", "b"]}, {"prompt": [1, 2, 3]}, {"prompt": [[1, 2], [3]]},
    {"prompt": ["x"] * protocol.MAX_PROMPTS},
    {"presence_penalty": -2.0, "frequency_penalty": 2}, {"repetition_penalty": 1.3}, {"top_k": -1}, {"top_k": 40},
    {"min_p": 0.1}, {"logit_bias": {"50256": -100, "7": 3.5}}, {"logprobs": 0}, {"logprobs": MAX_LOGPROBS},
    {"echo": True, "max_tokens": 0}, {"n": protocol.MAX_N}, {"n": 3, "best_of": 3},
    {"stop": ["\n"] * protocol.MAX_STOP_SEQUENCES}, {"stream": True, "stream_options": {"continuous_usage_stats": True}},
    {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    {"response_format": {"type": "json_object"}}, {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a_b-1", "schema": {"type": "object"},
                                                                 "strict": True, "description": "d"}}},
    {"user": "u", "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "prompt_cache_key": "k",
     "safety_identifier": "s"},
    {"seed": 2**64 - 1}, {"top_p": 1e-300}, {"temperature": 5e-324},
]
BAD_COMPLETIONS = [
    ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": [[1], "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"), ({"prompt": ["x"] * (protocol.MAX_PROMPTS + 1)}, "prompt"),
    ({"prompt": [True]}, "prompt"), ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"), ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"1": "1"}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"echo": 1}, "echo"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"),
    ({"echo": True, "max_tokens": 0, "stream": True}, "max_tokens"),
    ({"n": 0}, "n"), ({"n": protocol.MAX_N + 1}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
    ({"stop": ["\n"] * (protocol.MAX_STOP_SEQUENCES + 1)}, "stop"), ({"stop": [1]}, "stop"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "a"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ({"metadata": {"k": 1}}, "metadata.k"), ({"store": "yes"}, "store"), ({"suffix": "x"}, "suffix"),
    ({"temperature": float("inf")}, "temperature"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),  # a chat field
    ({"unknown_field": 1}, "unknown_field"),
]


@pytest.mark.parametrize("change", GOOD_COMPLETIONS, ids=lambda c: ",".join(c))
def test_good_completion_fields(change):
    parse(CompletionRequest, {**COMPLETION, **change})


@pytest.mark.parametrize("change,param", BAD_COMPLETIONS, ids=[",".join(c) + "=" + p for c, p in BAD_COMPLETIONS])
def test_bad_completion_fields_name_their_param(change, param):
    body = json.dumps({**COMPLETION, **change}).replace("Infinity", "1e999")
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(body)
    assert from_validation(info.value).param == param


GOOD_CHAT = [
    {"logprobs": True}, {"logprobs": True, "top_logprobs": MAX_LOGPROBS}, {"logprobs": False},
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "42", "tool_call_id": "c1"}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": "none", "parallel_tool_calls": False},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "f"}}},
    {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "q", "name": "u"}]},
    {"max_completion_tokens": 5, "n": 2, "response_format": {"type": "json_object"}},
]
BAD_CHAT = [
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"), ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 1}]},
                                    "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "messages[0].tool_calls[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"), ({"tool_choice": "always"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"), ({"echo": True}, "echo"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"functions": []}, "functions"),
]


@pytest.mark.parametrize("change", GOOD_CHAT, ids=lambda c: ",".join(c))
def test_good_chat_fields(change):
    parse(ChatCompletionRequest, {**CHAT, **change})


@pytest.mark.parametrize("change,param", BAD_CHAT, ids=[",".join(c) + "=" + p for c, p in BAD_CHAT])
def test_bad_chat_fields_name_their_param(change, param):
    assert error_param(ChatCompletionRequest, {**CHAT, **change}) == param


def test_sampling_params_carry_every_field():
    body = parse(CompletionRequest, {**COMPLETION, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
                                     "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
                                     "logit_bias": {"3": 2, "9": -1.5}, "seed": 11, "stop": ["a", ""],
                                     "ignore_eos": True, "logprobs": 4})
    p = body.sampling_params(12, vocab_size=16)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (12, 0.5, 0.9, 7, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == {3: 2.0, 9: -1.5} and p.seed == 11 and p.stop == ["a"] and p.ignore_eos
    assert p.logprobs == 4 and p.logprobs_mode == "raw"
    p.verify(16)
    with pytest.raises(APIError) as info:
        body.sampling_params(12, vocab_size=9)
    assert info.value.param == "logit_bias" and "9" in info.value.message
    assert parse(CompletionRequest, {**COMPLETION, "top_k": -1}).sampling_params(1, 16).top_k == 0
    assert parse(CompletionRequest, COMPLETION).sampling_params(1, 16).logprobs is None


@pytest.mark.parametrize("change,count", [({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0),
                                          ({"logprobs": True, "top_logprobs": 5}, 5)])
def test_chat_logprobs_count(change, count):
    assert parse(ChatCompletionRequest, {**CHAT, **change}).sampling_params(1, 16).logprobs == count


def test_request_helpers():
    assert parse(CompletionRequest, COMPLETION).prompts() == ["hi"]
    assert parse(CompletionRequest, {**COMPLETION, "prompt": [4, 5]}).prompts() == [[4, 5]]
    assert parse(CompletionRequest, {**COMPLETION, "prompt": [[4], [5, 6]]}).prompts() == [[4], [5, 6]]
    assert parse(CompletionRequest, {**COMPLETION, "prompt": ["a", "b"]}).prompts() == ["a", "b"]
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    assert parse(CompletionRequest, {**COMPLETION, "response_format": fmt}).response_format_dict() == fmt
    assert parse(CompletionRequest, {**COMPLETION, "response_format": {"type": "text"}}).response_format_dict() is None
    streamed = parse(CompletionRequest, {**COMPLETION, "stream": True,
                                         "stream_options": {"continuous_usage_stats": True}})
    assert streamed.continuous_usage() and not streamed.include_usage()
    chat = parse(ChatCompletionRequest, {**CHAT, **GOOD_CHAT[3]})
    assert [m["role"] for m in chat.template_messages()] == ["user", "assistant", "tool"]
    assert chat.template_messages()[2]["tool_call_id"] == "c1" and not chat.wants_tool_calls()
    assert parse(ChatCompletionRequest, {**CHAT, **GOOD_CHAT[5]}).wants_tool_calls()
    assert not parse(ChatCompletionRequest, {**CHAT, **GOOD_CHAT[4]}).wants_tool_calls()
    assert parse(ChatCompletionRequest, {**CHAT, **GOOD_CHAT[6]}).template_messages()[0]["role"] == "system"


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


def test_logprob_objects_spell_tokens_and_bytes(tokenizer):
    text = "héllo 世界"
    ids = tokenizer(text)["input_ids"]
    assert b"".join(protocol.token_bytes(tokenizer, t) for t in ids).decode() == text
    texts = [protocol.token_text(tokenizer, t) for t in ids]
    assert any(t.startswith("bytes:\\x") for t in texts)  # 世 is split across tokens
    assert "".join(t for t in texts if not t.startswith("bytes:")) == "héllo "
    chat = protocol.chat_logprobs(tokenizer, ids[:2], [-0.5, -1.0], [[(ids[0], -0.5), (7, -2.0)], []])
    first = chat.content[0]
    assert (first.token, first.logprob, bytes(first.bytes)) == ("h", -0.5, b"h")
    assert [x.logprob for x in first.top_logprobs] == [-0.5, -2.0] and chat.content[1].top_logprobs == []
    comp = protocol.completion_logprobs(tokenizer, ids[:3], [None, -1.0, -2.0], [None, [(7, -1.0)], [(8, -2.0)]])
    assert comp.tokens == texts[:3] and comp.token_logprobs == [None, -1.0, -2.0]
    assert comp.top_logprobs[0] is None and len(comp.top_logprobs[1]) == 1
    assert comp.text_offset == [0, 1, 2]  # "h", "é", "llo"
    dumped = protocol.CompletionChoice(text=text, logprobs=comp).model_dump()
    assert set(dumped["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}


# ---------------------------------------------------------------------------- the README's field tables
def _readme_tables() -> tuple[set[str], list[tuple[str, str]]]:
    """Field names of the README's OpenAI field table, and (field, endpoints) of its table of
    refused vLLM fields."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("### OpenAI fields"):text.index("### Metrics")]
    supported, refused = section.split("vLLM extensions that are refused")
    names = set(re.findall(r"`([a-z_.]+)`", supported))
    rows = [line.split("|")[1:3] for line in refused.splitlines() if line.startswith("| `")]
    return names, [(name, ends.strip()) for cell, ends in rows for name in re.findall(r"`([a-z_]+)`", cell)]


def test_every_request_field_is_in_the_readme_table():
    names, _ = _readme_tables()
    nested = {"stream_options": protocol.StreamOptions, "igserve": protocol.IgserveOptions}
    for kind in (CompletionRequest, ChatCompletionRequest):
        for field in kind.model_fields:
            if field in nested:
                assert all(f"{field}.{sub}" in names for sub in nested[field].model_fields), field
            else:
                assert field in names, field


@pytest.mark.parametrize("field,endpoints", _readme_tables()[1])
def test_vllm_fields_the_readme_lists_as_refused_are_400s_naming_them(field, endpoints):
    kinds = {"C": (CompletionRequest, COMPLETION), "H": (ChatCompletionRequest, CHAT)}
    for letter in endpoints.split():
        kind, body = kinds[letter]
        assert error_param(kind, {**body, field: True}) == field
