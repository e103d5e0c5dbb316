"""OpenAI wire format: request and response models for completions and chat completions.

Requests are validated strictly (no string-to-number coercion, unknown fields refused) so a
client learns which field is wrong instead of getting silently different behaviour. The
``igserve`` extension field picks the block mask; responses carry an ``igserve`` object.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_STOP_SEQUENCES = 4  # as OpenAI


def _one_of(check, description: str):
    """A field that accepts the JSON shapes ``check`` allows, with one clear error otherwise."""

    def validate(value):
        if not check(value):
            raise PydanticCustomError("invalid_type", f"must be {description}")
        return value

    return PlainValidator(validate)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def _is_prompt(v) -> bool:
    tokens = isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
    return isinstance(v, str) or tokens or (_is_str_list(v) and len(v) == 1)


def _is_stop(v) -> bool:
    return v is None or isinstance(v, str) or (_is_str_list(v) and len(v) <= MAX_STOP_SEQUENCES)


def _is_content(v) -> bool:
    parts = isinstance(v, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and len(p) == 2 for p in v
    )
    return v is None or isinstance(v, str) or parts


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------------- requests
class IgserveOptions(_Strict):
    mask: str = "auto"  # "auto" (route on the input), "dense", or a mask id of the bank


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: Annotated[str | list[str] | None, _one_of(_is_stop, f"a string or an array of at most "
                                                                f"{MAX_STOP_SEQUENCES} strings")] = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past an end-of-sequence token
    igserve: IgserveOptions = IgserveOptions()

    @field_validator("n")
    @classmethod
    def _only_one(cls, n: int) -> int:
        if n != 1:
            raise PydanticCustomError("unsupported", "only n=1 is supported")
        return n

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("unsupported", "only allowed when stream is true", {"param": "stream_options"})
        return self

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    prompt: Annotated[str | list[str] | list[int], _one_of(_is_prompt, "a string, an array with one string, "
                                                                       "or an array of token ids")]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[dict] | None, _one_of(_is_content, "a string or an array of text parts "
                                                                     '({"type": "text", "text": ...})')] = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------------------- responses
class IgserveInfo(BaseModel):
    mask: str
    skip_ratio: float  # fraction of blocks the mask skips
    compute_saved: float  # fraction of parameters per token the mask does not touch
    router_ms: float  # time spent routing (0 when the mask was forced)
    distance: float | None = None  # cosine distance to the chosen centroid (routed requests)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    igserve: IgserveInfo


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "igserve"
    max_model_len: int
    masks: list[str] = []  # mask ids a request may force with igserve.mask (besides "auto")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------- /tokenize, /detokenize (vLLM's)
class TokenizeRequest(_Strict):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompts only; chat templates place their own
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_request", "give exactly one of prompt and messages",
                                      {"param": "prompt"})
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
