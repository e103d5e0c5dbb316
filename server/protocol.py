"""OpenAI wire format: request and response models for completions and chat completions.

Requests are validated strictly (no string-to-number coercion, unknown fields refused) so a
client learns which field is wrong instead of getting silently different behaviour. Fields that
clients send but that change nothing here (IGNORED_FIELDS) are accepted. The ``igserve``
extension field picks the block mask; responses carry an ``igserve`` object.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, StringConstraints, model_validator
from pydantic_core import PydanticCustomError

from server.errors import APIError
from server.sampling import (LOGIT_BIAS_LIMIT, MAX_LOGPROBS, REPETITION_PENALTY_RANGE, SEED_RANGE,
                             SamplingParams)

MAX_STOP_SEQUENCES = 64  # OpenAI allows 4, vLLM has no cap; lm-eval sends a task's whole "until" list
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 128  # prompts in one completions request (lm-eval sends batches of token-id lists)
MAX_COMPLETION_LOGPROBS = MAX_LOGPROBS  # OpenAI allows 5 for completions; vLLM the server's max (20)
# Fields clients send that change nothing here; accepted so that those clients work, and ignored.
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                  "safety_identifier")


def _one_of(check, description: str, shape):
    """A field that accepts the JSON shapes ``check`` allows, with one clear error otherwise;
    ``shape`` (a type) is what /openapi.json says it takes."""

    def validate(value):
        if not check(value):
            raise PydanticCustomError("invalid_type", f"must be {description}")
        return value

    return PlainValidator(validate, json_schema_input_type=shape)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def _is_ids(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(_is_int(t) and t >= 0 for t in v)


def _is_prompt(v) -> bool:
    if isinstance(v, str) or _is_ids(v):
        return True
    batch = isinstance(v, list) and 0 < len(v) <= MAX_PROMPTS
    return batch and (_is_str_list(v) or all(_is_ids(p) for p in v))


def _is_stop(v) -> bool:
    return v is None or isinstance(v, str) or (_is_str_list(v) and len(v) <= MAX_STOP_SEQUENCES)


def _is_content(v) -> bool:
    parts = isinstance(v, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and len(p) == 2 for p in v
    )
    return v is None or isinstance(v, str) or parts


def _is_logit_bias(v) -> bool:
    return v is None or (isinstance(v, dict) and all(
        k.isdigit() and isinstance(b, (int, float)) and not isinstance(b, bool) and abs(b) <= LOGIT_BIAS_LIMIT
        for k, b in v.items()))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# The shapes /openapi.json gives for the fields checked by hand (_one_of)
_TokenKey = Annotated[str, StringConstraints(pattern=r"^[0-9]+$")]
_Bias = Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]
_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
_PromptShape = (str | _Ids | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
                | Annotated[list[_Ids], Field(min_length=1, max_length=MAX_PROMPTS)])
_StopShape = str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolName


# ---------------------------------------------------------------------------- requests
class IgserveOptions(_Strict):
    mask: str = "auto"  # "auto" (route on the input), "dense", or a mask id of the bank
    budget: float | None = None  # routed requests: a sparsity the bank holds (default: the bank's)
    max_loss: float | None = Field(None, ge=0)  # routed: the sparsest mask predicted to add at most this loss


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks: accepted, none is added


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("invalid_value", "json_schema is required with type 'json_schema' and "
                                                       "only allowed with it", {"param": "response_format"})
        return self


class GenerationRequest(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    logit_bias: Annotated[dict[str, float] | None, _one_of(
        _is_logit_bias, f"an object mapping token ids to biases in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
        dict[_TokenKey, _Bias] | None)] = None
    stop: Annotated[str | list[str] | None, _one_of(_is_stop, f"a string or an array of at most "
                                                                f"{MAX_STOP_SEQUENCES} strings", _StopShape)] = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past an end-of-sequence token
    igserve: IgserveOptions = IgserveOptions()
    # accepted and ignored (IGNORED_FIELDS)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

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

    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def response_format_dict(self) -> dict | None:
        """The response format as server.structured takes it; None when decoding is unconstrained."""
        if self.response_format is None or self.response_format.type == "text":
            return None
        return self.response_format.model_dump(by_alias=True, exclude_none=True)

    def logprobs_count(self) -> int | None:
        """Top logprobs per token, 0 for the chosen token's only, None for none."""
        raise NotImplementedError

    def sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        """The engine's parameters for one choice. Raises APIError 400 for a logit_bias token
        outside the vocabulary (the only range that depends on the model)."""
        bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()}
        if any(t >= vocab_size for t in bias):
            raise APIError(400, f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias")
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k or 0, 0),
            min_p=self.min_p, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=bias, seed=self.seed, stop=self.stop_list(),
            ignore_eos=self.ignore_eos, logprobs=self.logprobs_count())


class CompletionRequest(GenerationRequest):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], _one_of(
        _is_prompt, f"a string, an array of token ids, or an array of at most {MAX_PROMPTS} of either",
        _PromptShape)]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: None = None  # OpenAI's insert mode; no model served here is trained for it

    @model_validator(mode="after")
    def _completion_rules(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("invalid_value", "max_tokens 0 is only allowed with echo (scoring the prompt)",
                                      {"param": "max_tokens"})
        if self.best_of is not None and self.best_of != self.n:
            raise PydanticCustomError("unsupported", "best_of must equal n (no choices are generated to be dropped)",
                                      {"param": "best_of"})
        if self.stream and self.max_tokens == 0:
            raise PydanticCustomError("unsupported", "max_tokens 0 cannot be streamed", {"param": "max_tokens"})
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt, each a string or a list of token ids; choices follow this order
        (prompt i, choice j has index i * n + j, as OpenAI and vLLM)."""
        p = self.prompt
        if isinstance(p, str) or (p and _is_int(p[0])):
            return [p]
        return list(p)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[dict] | None, _one_of(_is_content, "a string or an array of text parts "
                                                                     '({"type": "text", "text": ...})',
                                                        str | list[TextPart] | None)] = None
    name: str | None = None
    tool_call_id: str | None = None  # tool messages: the call they answer (rendered for those only)
    tool_calls: list[ToolCall] | None = None  # assistant messages

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """The message as chat templates take it (developer is the system role to them)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.role == "tool" and self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


def _is_tool_choice(v) -> bool:
    named = (isinstance(v, dict) and v.get("type") == "function" and len(v) == 2
             and isinstance(v.get("function"), dict) and list(v["function"]) == ["name"]
             and isinstance(v["function"]["name"], str))
    return v is None or v in ("none", "auto", "required") or named


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Annotated[str | dict | None, _one_of(
        _is_tool_choice, '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        Literal["none", "auto", "required"] | NamedToolChoice | None)] = None
    parallel_tool_calls: bool | None = None  # ignored: no tool calls are generated

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs true", {"param": "top_logprobs"})
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wants_tool_calls(self) -> bool:
        """True when the model may be asked to call a tool (tools given, tool_choice not "none");
        the serving layer needs a chat template with a tool format for that."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_messages(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]


# ---------------------------------------------------------------------------- responses
class IgserveInfo(BaseModel):
    mask: str
    skip_ratio: float  # fraction of blocks the mask skips
    compute_saved: float  # fraction of parameters per token the mask does not touch
    router_ms: float  # time spent routing (0 when the mask was forced)
    distance: float | None = None  # cosine distance to the chosen centroid (routed requests)
    budget: float | None = None  # sparsity of the chosen mask's budget (routed requests)
    fallback: bool = False  # out of distribution: the budget's global mask was used
    predicted_loss: float | None = None  # learned router: predicted excess loss per token (nats)
    router: str | None = None  # routed requests: "learned" or "centroid"
    adaptive: bool = False  # load-adaptive depth admitted it at a sparser budget than the default


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache held, not prefilled (OpenAI's field)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class CompletionLogprobs(BaseModel):
    """Per token of the choice's text (the prompt's too with echo; its first token has no logprob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


LogprobsT = TypeVar("LogprobsT")


class _Choice(BaseModel, Generic[LogprobsT]):
    index: int = 0
    logprobs: LogprobsT | None = None
    finish_reason: str | None = None


class CompletionChoice(_Choice[CompletionLogprobs]):
    text: str


class ChatChoice(_Choice[ChatLogprobs]):
    message: ChatMessageOut


class ChatChunkChoice(_Choice[ChatLogprobs]):
    delta: ChatDelta


ChoiceT = TypeVar("ChoiceT")


class _Response(BaseModel, Generic[ChoiceT]):
    """The fields every response and chunk has; a subclass pins ``object`` (and may require usage)."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    igserve: IgserveInfo
    object: str
    choices: list[ChoiceT]
    usage: Usage | None = None


class CompletionResponse(_Response[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ChatCompletionResponse(_Response[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: Usage


class ChatCompletionChunk(_Response[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


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


# ---------------------------------------------------------------------------- logprob helpers
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character each byte is spelt with, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_decoder()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for (a token can hold part of a UTF-8 character)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is not None and all(c in _BYTES for c in piece):
        return bytes(_BYTES[c] for c in piece)
    return tokenizer.decode([token_id]).encode()


def token_text(tokenizer, token_id: int) -> str:
    """A token as a string; bytes that are not whole UTF-8 characters are written ``bytes:\\xNN``,
    as vLLM and OpenAI do."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> ChatLogprobs:
    """``logprobs.content`` of a chat choice from the sampler's outputs (server.sampling.SampleOutput)."""
    def entry(t: int, lp: float) -> TopLogprob:
        return TopLogprob(token=token_text(tokenizer, t), logprob=lp, bytes=list(token_bytes(tokenizer, t)))

    return ChatLogprobs(content=[TokenLogprob(**entry(t, lp).model_dump(), top_logprobs=[entry(*x) for x in tops])
                                 for t, lp, tops in zip(token_ids, logprobs, top)])


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[float | None],
                        top: list[list[tuple[int, float]] | None], offset: int = 0) -> CompletionLogprobs:
    """``logprobs`` of a completion choice; ``offset`` is where the first token's text starts in
    the choice's text. A None logprob (the first prompt token with echo) has top None too."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets, pos = [], offset
    for t in token_ids:
        offsets.append(pos)
        pos += len(token_bytes(tokenizer, t).decode(errors="ignore"))
    tops = [None if x is None else {token_text(tokenizer, t): lp for t, lp in x} for x in top]
    return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), top_logprobs=tops, text_offset=offsets)


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
