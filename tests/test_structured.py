"""Structured outputs with the real tokenizer: whatever the logits, the text parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from server.sampling import RowState, SamplingParams, sample
from server.structured import StructuredOutputs, format_key

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def outputs(tokenizer):
    return StructuredOutputs(tokenizer, VOCAB)


def _closing_bias(tokenizer) -> torch.Tensor:
    """After a while, prefer tokens that close a JSON value (random logits alone rarely would:
    the test is about validity, and the grammar decides which of these are allowed)."""
    bias = torch.zeros(VOCAB)
    for text, value in [('"', 50), ("}", 45), ("]", 45), (":", 30), (",", 25), ("0", 20)]:
        bias[tokenizer.convert_tokens_to_ids(text)] = value
    bias[tokenizer.eos_token_id] = 60
    return bias


def _decode(outputs, tokenizer, response_format, seeds, steps=300, close_after=20, bias=None) -> list[str]:
    """Constrained decoding of random logits for a batch of rows (one seed each); ``bias`` is
    added to every step's logits."""
    rows = [RowState(SamplingParams(temperature=1.0, seed=s), grammar=outputs.matcher(response_format))
            for s in seeds]
    gen = torch.Generator().manual_seed(seeds[0])
    closing = _closing_bias(tokenizer)
    eos = set(outputs.stop_token_ids)
    done = [False] * len(rows)
    for step in range(steps):
        live = [i for i, d in enumerate(done) if not d]
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=gen) * 4
        if step >= close_after:
            logits += closing
        if bias is not None:
            logits += bias
        out = sample(logits, [rows[i] for i in live])
        assert out.errors == [None] * len(live)
        for i, tok in zip(live, out.tokens):
            assert rows[i].append(tok) is None
            if tok in eos:
                assert rows[i].grammar.is_terminated()
                done[i] = True
    assert all(done), "decoding did not finish"
    return [tokenizer.decode([t for t in r.output_ids if t not in eos]) for r in rows]


def test_json_object_output_always_parses(outputs, tokenizer):
    texts = _decode(outputs, tokenizer, {"type": "json_object"}, seeds=[1, 2, 3, 4])
    for text in texts:
        json.loads(text)
    assert len(set(texts)) == 4


def test_json_schema_output_validates(outputs, tokenizer):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    texts = _decode(outputs, tokenizer, fmt, seeds=[5, 6, 7, 8])
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) == 4


def test_control_characters_never_enter_the_output(outputs, tokenizer):
    """Tokens holding a raw control character (JSON allows them only escaped) are banned, even
    inside strings where xgrammar's own rule allows most of them: with those tokens favoured, the
    output still parses and holds none; the banned set is exactly the tokens with such bytes."""
    assert 100 < len(outputs.control_tokens) < 1000
    for t in outputs.control_tokens:
        assert any(b < 0x20 for b in tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(t)]).encode())
    bias = torch.zeros(VOCAB)
    bias[outputs.control_tokens] = 12.0
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 8, "maxLength": 16}},
              "required": ["text"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    for text in _decode(outputs, tokenizer, fmt, seeds=[11, 12, 13, 14], bias=bias):
        jsonschema.validate(json.loads(text), schema)
        assert not any(ord(c) < 0x20 for c in text), repr(text)
    loose = StructuredOutputs(tokenizer, VOCAB)
    loose.allowed = None  # xgrammar alone: the same decoding draws raw control characters
    texts = _decode(loose, tokenizer, fmt, seeds=[11, 12, 13, 14], bias=bias)
    assert any(ord(c) < 0x20 for text in texts for c in text)


def test_the_output_keeps_the_schema_property_order(outputs, tokenizer):
    reordered = {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    for schema in (SCHEMA, reordered):
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
        for text in _decode(outputs, tokenizer, fmt, seeds=[21, 22]):
            assert list(json.loads(text)) == list(schema["properties"])
    assert format_key({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}) != \
        format_key({"type": "json_schema", "json_schema": {"name": "p", "schema": reordered}})


def test_unconstrained_random_decoding_does_not_parse(tokenizer):
    """The check above has teeth: without the grammar the same loop yields no JSON."""
    gen = torch.Generator().manual_seed(5)
    rows = [RowState(SamplingParams(temperature=1.0, seed=5))]
    for _ in range(30):
        tok = sample(torch.randn(1, VOCAB, generator=gen) * 4, rows).tokens[0]
        rows[0].append(tok)
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(rows[0].output_ids))


def test_compiled_grammars_are_cached_by_schema(tokenizer):
    so = StructuredOutputs(tokenizer, VOCAB, cache_size=2)
    a = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties":
                                                                        {"x": {"type": "integer"}}}}}
    reordered = {"type": "json_schema", "json_schema": {"schema": {"properties": {"x": {"type": "integer"}},
                                                                   "type": "object"}, "name": "b"}}
    assert so.compile(a) is so.compile(reordered)  # same schema, other key order and name
    assert so.compile({"type": "json_object"}) is so.compile({"type": "json_object"})
    assert so.cached() == 2
    so.compile({"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "string"}}})
    assert so.cached() == 2
    assert so.compile({"type": "text"}) is None and so.matcher(None) is None


@pytest.mark.parametrize("fmt,match", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, "JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema"),
    ({"type": "json_schema", "json_schema": "x"}, "json_schema"),
    ({"type": "yaml"}, "type"),
])
def test_a_bad_schema_is_a_value_error(outputs, fmt, match):
    with pytest.raises(ValueError, match=match) as info:
        outputs.compile(fmt)
    assert "/project/" not in str(info.value) and ".cc:" not in str(info.value)


def test_format_key():
    assert format_key(None) is None and format_key({"type": "text"}) is None
    assert format_key({"type": "json_schema", "json_schema": {"name": "n"}}) == format_key({"type": "json_object"})
