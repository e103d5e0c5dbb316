"""Structured outputs: OpenAI ``response_format`` by grammar-constrained decoding with xgrammar.

``StructuredOutputs`` is built once per served tokenizer (building xgrammar's token table walks
the whole vocabulary) and compiles each response format to a grammar, keeping the most recently
used ones (compiling a schema costs milliseconds, a request's decode step far less). Each request
gets its own ``Matcher``: every step it fills that row's allowed-token bitmask, which
``server.sampling.sample`` applies before drawing, and it accepts the drawn token. Once the JSON
value is complete only an end-of-sequence token is allowed; the matcher is then terminated.

Two things are added to xgrammar's grammars. Tokens holding a control character (U+0000-U+001F)
are never allowed: JSON takes those only escaped inside strings, but xgrammar's string rule lets
them through raw (all but CR and LF; the raw U+0001 a random model drew broke ``json.loads``), and
compact JSON has no whitespace they could be. And the cache key keeps the order of a schema's
``properties`` (the order the output writes them) while sorting every other key.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch
import xgrammar as xgr

GRAMMAR_CACHE_SIZE = 128  # compiled response formats kept
JSON_OBJECT = '{"type": "object"}'  # json_object: any JSON object (OpenAI's promise), not any value


def _clean(message: str) -> str:
    """xgrammar's errors start with a timestamp and a C++ source location; the client needs neither."""
    message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(message).strip())
    return message.replace("Check failed: (error.empty()) is false: ", "")


def _canonical(schema):
    """The schema with every object's keys sorted, except the names in ``properties``."""
    if isinstance(schema, list):
        return [_canonical(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key in sorted(schema):
        value = schema[key]
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: _canonical(v) for name, v in value.items()}
        else:
            out[key] = _canonical(value)
    return out


def format_key(response_format: dict | None) -> tuple[str, str | None, bool] | None:
    """(type, canonical schema JSON, strict) for a response format that constrains decoding, or
    None for plain text. Raises ValueError for a shape OpenAI does not define."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", JSON_OBJECT, False)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with 'name' and 'schema'")
        schema = spec.get("schema")
        if schema is None:  # no schema: any object, as json_object
            return ("json_object", JSON_OBJECT, False)
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
        return ("json_schema", json.dumps(_canonical(schema)), bool(spec.get("strict")))
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}")


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [V] -> int32 [ceil(V/32)] in xgrammar's layout (bit j of word w allows token 32w+j)."""
    words = (allowed.numel() + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.long)
    bits[:allowed.numel()] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class Matcher:
    """One request's grammar state (server.sampling.Grammar); ``allowed`` (a packed bitmask) is
    and-ed into every row xgrammar fills."""

    def __init__(self, grammar: xgr.CompiledGrammar, allowed: torch.Tensor | None = None):
        self._m = xgr.GrammarMatcher(grammar)
        self._allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed tokens into row ``index`` of an int32 [N, ceil(V/32)] CPU tensor."""
        self._m.fill_next_token_bitmask(bitmask, index)
        if self._allowed is not None:
            bitmask[index] &= self._allowed

    def accept_token(self, token: int) -> bool:
        return self._m.accept_token(token)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class StructuredOutputs:
    """Grammar compilation for one tokenizer, with an LRU cache of compiled response formats."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = GRAMMAR_CACHE_SIZE, threads: int = 1,
                 any_whitespace: bool = False):
        """``any_whitespace`` False: compact JSON (one space after ':' and ','). Small models
        given free whitespace can emit it until max_tokens (vLLM's ``disable_any_whitespace``)."""
        self.any_whitespace = any_whitespace
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        # tokens with a control character (see the module docstring); CR and LF are whitespace
        # between values when whitespace is free, and xgrammar keeps them out of strings itself
        free = {0x0A, 0x0D} if any_whitespace else set()
        self.control_tokens = [i for i, raw in enumerate(info.decoded_vocab) if any(b < 0x20 and b not in free
                                                                                   for b in raw)]
        allowed = torch.ones(vocab_size, dtype=torch.bool)
        allowed[[i for i in self.control_tokens if i < vocab_size]] = False
        self.allowed = pack_bitmask(allowed)
        self.stop_token_ids = list(info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()  # requests compile on the event loop's worker threads

    def compile(self, response_format: dict | None) -> xgr.CompiledGrammar | None:
        """The compiled grammar of a response format (None for plain text). Raises ValueError
        with xgrammar's reason for a schema it cannot turn into a grammar."""
        key = format_key(response_format)
        if key is None:
            return None
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        _, schema, strict = key
        try:
            grammar = self._compiler.compile_json_schema(schema, strict_mode=strict,
                                                         any_whitespace=self.any_whitespace)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"response_format.json_schema.schema is not a usable JSON Schema: {_clean(exc)}") from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, response_format: dict | None) -> Matcher | None:
        grammar = self.compile(response_format)
        return None if grammar is None else self.new_matcher(grammar)

    def new_matcher(self, grammar: xgr.CompiledGrammar) -> Matcher:
        """One request's state for a compiled grammar (each choice of a request gets its own)."""
        return Matcher(grammar, self.allowed)

    def cached(self) -> int:
        return len(self._cache)
