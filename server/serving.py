"""Request handling shared by both endpoints: HTTP request -> engine request -> response or SSE.

Per request: authorise, validate, render and tokenise the prompt off the event loop (a huge prompt
must not stall the streams the loop is serving), take a forced mask (``igserve.mask``) or leave the
request to be routed by the engine at admission; queue, then answer or stream chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from masks.bank import BankError, DENSE
from router.encoder import EncoderError
from router.router import chat_routing_text
from server import models, protocol
from server.async_engine import AsyncEngine, EngineClosed, QueueFull
from server.config import ServeConfig
from server.errors import APIError, from_validation
from server.loading import Loaded, in_own_thread, load_served
from server.metrics import count_error
from server.engine import StepOutput
from server.request import Request as EngineRequest
from server.sampling import SEED_RANGE

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as OpenAI; chat defaults to what the limit and the context allow
RETRY_AFTER_FULL_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5

log = logging.getLogger("igserve.serving")


class OpenAIServing:
    """The serving state of one process; ``loaded`` is None until loading is done."""

    def __init__(self, cfg: ServeConfig, on_fatal: Callable[[str], None]):
        self.cfg = cfg
        self.on_fatal = on_fatal
        self.loaded: Loaded | None = None
        self.status = "loading"
        self._closing: asyncio.Future | None = None
        # Tokenising and chat templates: CPU work kept off the event loop (no torch, so no OpenMP team).
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="igserve-tokenize")

    async def load(self) -> None:
        try:
            loaded = await in_own_thread(load_served, self.cfg, self._engine_died)
        except (models.ModelLoadError, BankError, EncoderError) as exc:
            message = str(exc)
        except Exception as exc:  # anything else: reported the same way, with a traceback
            log.exception("loading failed")
            message = f"{type(exc).__name__}: {exc}"
        else:
            loaded.engine.start()
            self.loaded, self.status = loaded, "ok"
            log.info("serving %s (context %d, %d masks, %s)", loaded.name, loaded.context, len(loaded.masks),
                     "input-guided routing" if loaded.routing else "dense")
            return
        self.status = "failed"
        log.error("%s", message)
        self.on_fatal(message)

    def _engine_died(self, message: str) -> None:
        self.status = "failed"
        log.critical("%s; exiting", message)
        self.on_fatal(message)

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests; the ones in flight go on."""
        if self.loaded is not None and self.status == "ok":
            self.status = "draining"
            self.loaded.engine.close()

    def close(self) -> asyncio.Future:
        """Drain and stop the engine (once; later calls await the same drain)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        return self._closing

    async def _close(self) -> None:
        if self.loaded is not None:
            if self.status == "ok":
                self.status = "draining"
            cut = await self.loaded.engine.shutdown(self.cfg.drain_timeout)
            self.loaded.metrics.drain_cut(cut)
        self._prep.shutdown(wait=False)

    @property
    def healthy(self) -> bool:
        return self.status == "ok" and self.loaded is not None and self.loaded.engine.alive

    def count_error(self, error_type: str) -> None:
        count_error(models.served_name(self.cfg.model), error_type)

    # ------------------------------------------------------------------ per-request steps
    def authorize(self, http: Request) -> None:
        key = self.cfg.api_key
        if not key:
            return
        scheme, _, given = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    def ready(self) -> Loaded:
        if self.loaded is None or not self.healthy:
            status = self.status if self.status != "ok" else "failed"
            raise APIError(503, f"server is {status}", code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})
        return self.loaded

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    async def accept(self, http: Request, kind: type[BaseModel]) -> tuple[float, Loaded, BaseModel]:
        """Arrival time, the loaded model and the validated body of a generation request."""
        arrival = time.monotonic()
        loaded = self.ready()
        raw = await http.body()
        try:
            body = await self.off_loop(kind.model_validate_json, raw)
        except ValidationError as exc:
            raise from_validation(exc) from None
        if body.model != loaded.name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{loaded.name}'",
                           param="model", code="model_not_found")
        return arrival, loaded, body

    async def tokenize(self, loaded: Loaded, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt text; one too long to fit is refused before it is tokenised."""
        if len(text) > loaded.context * loaded.max_token_chars:
            raise APIError(400, f"this model's maximum context length is {loaded.context} tokens, but the prompt "
                                f"has {len(text)} characters, more than that many tokens can hold", param=param,
                           code="context_length_exceeded")
        encode = loaded.tokenizer
        return (await self.off_loop(lambda: encode(text, add_special_tokens=add_special_tokens)))["input_ids"]

    async def prompt_of(self, loaded: Loaded, prompt: str | list[int]) -> tuple[list[int], str]:
        """Token ids and text (routing, echo) of one completion prompt (text or token ids)."""
        if isinstance(prompt, list):  # token ids
            self.check_token_ids(loaded, prompt, "prompt")
            return list(prompt), loaded.tokenizer.decode(prompt)
        return await self.tokenize(loaded, prompt, "prompt"), prompt

    async def chat_prompt(self, loaded: Loaded, messages: list[protocol.ChatMessage],
                          add_generation_prompt: bool = True) -> tuple[list[int], list[dict]]:
        """Token ids of chat messages rendered with the model's template, and the messages as dicts."""
        turns = [m.template_dict() for m in messages]
        try:
            text = await self.off_loop(lambda: loaded.tokenizer.apply_chat_template(
                turns, add_generation_prompt=add_generation_prompt, tokenize=False))
        except Exception as exc:  # template errors (e.g. role order) are the client's to fix
            raise APIError(400, f"messages do not fit the model's chat template: {exc}", param="messages") from None
        return await self.tokenize(loaded, text, "messages", add_special_tokens=False), turns

    @staticmethod
    def check_token_ids(loaded: Loaded, ids: list[int], param: str) -> None:
        if any(not 0 <= t < loaded.vocab_size for t in ids):
            raise APIError(400, f"{param} token ids must be in [0, {loaded.vocab_size})", param=param)

    # ------------------------------------------------------------------ endpoints
    async def completion(self, http: Request):
        arrival, loaded, body = await self.accept(http, protocol.CompletionRequest)
        prompts = []
        for prompt in body.prompts():
            ids, text = await self.prompt_of(loaded, prompt)
            max_tokens = self.max_tokens(loaded, body, len(ids), "prompt", COMPLETION_DEFAULT_MAX_TOKENS)
            prompts.append(Prompt(ids, text, max_tokens))
        return await self.generate(http, loaded, body, prompts, arrival, chat=False)

    async def chat(self, http: Request):
        arrival, loaded, body = await self.accept(http, protocol.ChatCompletionRequest)
        ids, turns = await self.chat_prompt(loaded, body.messages)
        max_tokens = self.max_tokens(loaded, body, len(ids), "messages", self.cfg.max_tokens_limit)
        return await self.generate(http, loaded, body, [Prompt(ids, chat_routing_text(turns), max_tokens)], arrival,
                                   chat=True)

    async def tokenize_request(self, http: Request) -> protocol.TokenizeResponse:
        """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""
        _, loaded, body = await self.accept(http, protocol.TokenizeRequest)
        if body.messages is not None:
            ids, _ = await self.chat_prompt(loaded, body.messages, body.add_generation_prompt)
        else:
            ids = await self.tokenize(loaded, body.prompt, "prompt", body.add_special_tokens)
        return protocol.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=loaded.context)

    async def detokenize_request(self, http: Request) -> protocol.DetokenizeResponse:
        _, loaded, body = await self.accept(http, protocol.DetokenizeRequest)
        self.check_token_ids(loaded, body.tokens, "tokens")
        return protocol.DetokenizeResponse(prompt=loaded.tokenizer.decode(body.tokens))

    def max_tokens(self, loaded: Loaded, body: protocol.GenerationRequest, n_prompt: int, prompt_param: str,
                   default: int) -> int:
        ctx, limit = loaded.context, self.cfg.max_tokens_limit
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if n_prompt >= ctx:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens, but the prompt has "
                                f"{n_prompt} tokens", param=prompt_param, code="context_length_exceeded")
        requested = body.requested_max_tokens()
        if requested is None:
            return min(default, limit, ctx - n_prompt)
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        if requested > limit:
            raise APIError(400, f"{param} is {requested}, this server allows at most {limit}", param=param)
        if n_prompt + requested > ctx:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens, but {n_prompt + requested} "
                                f"were requested ({n_prompt} in the prompt, {requested} in the completion)",
                           param=param, code="context_length_exceeded")
        return requested

    @staticmethod
    def choose_mask(loaded: Loaded, choice: str) -> str | None:
        """The mask id a request asks for; None: the engine routes it on its input."""
        if choice == "auto":
            return None if loaded.routing else DENSE
        if choice not in loaded.masks:
            valid = ", ".join(["auto", *loaded.masks])
            raise APIError(400, f"unknown mask '{choice}'; valid: {valid}", param="igserve.mask", code="unknown_mask")
        return choice

    @staticmethod
    def routing_options(loaded: Loaded, opts: protocol.IgserveOptions, mask_id: str | None):
        """(budget, max_loss) of a routed request, checked against the bank; 400 when it cannot serve them."""
        if opts.budget is None and opts.max_loss is None:
            return None, None
        param = "igserve.budget" if opts.budget is not None else "igserve.max_loss"
        if mask_id is not None:
            raise APIError(400, "budget and max_loss choose among routed masks: send them with mask 'auto' and a "
                                "mask bank", param=param)
        try:
            loaded.router.check(opts.budget, opts.max_loss)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None
        return opts.budget, opts.max_loss

    async def engine_requests(self, loaded: Loaded, body: protocol.GenerationRequest, prompts: list[Prompt],
                              arrival: float, response_id: str) -> list[EngineRequest]:
        """One engine request per choice: prompt i, choice j at index i * n + j; choices j > 0
        share the prefill of choice 0 (the engine copies its cached prompt)."""
        mask_id = self.choose_mask(loaded, body.igserve.mask)
        mask = None if mask_id is None else loaded.masks[mask_id].mask
        budget, max_loss = self.routing_options(loaded, body.igserve, mask_id)
        grammar = await self.grammar(loaded, body)
        total = len(prompts) * body.n
        if total > loaded.engine.capacity:
            raise APIError(400, f"{total} choices ({len(prompts)} prompts x n {body.n}) are more than this server "
                                f"holds at once ({loaded.engine.capacity})", param="n" if body.n > 1 else "prompt")
        scored = getattr(body, "echo", False) and body.logprobs_count() is not None
        reqs = []
        for prompt in prompts:
            params = body.sampling_params(prompt.max_tokens, loaded.vocab_size)
            first = None
            for j in range(body.n):
                choice = dataclasses.replace(params, seed=choice_seed(params.seed, j))
                reqs.append(EngineRequest(
                    list(prompt.ids), mask, choice, mask_id=mask_id, routing_text=prompt.text, arrival=arrival,
                    budget=budget, max_loss=max_loss, shares_prefill_of=first,
                    request_id=response_id if total == 1 else f"{response_id}-{len(reqs)}",
                    prompt_logprobs=body.logprobs_count() if scored else None,
                    grammar=None if grammar is None else loaded.structured.new_matcher(grammar)))
                if j == 0:
                    first = reqs[-1]
        return reqs

    async def grammar(self, loaded: Loaded, body: protocol.GenerationRequest):
        """The compiled grammar of the response format (None: unconstrained); 400 when it cannot be built."""
        fmt = body.response_format_dict()
        if fmt is None:
            return None
        try:
            return await self.off_loop(loaded.structured.compile, fmt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="response_format") from None

    async def generate(self, http: Request, loaded: Loaded, body: protocol.GenerationRequest, prompts: list[Prompt],
                       arrival: float, chat: bool):
        _refuse_unserved(body)
        response_id = protocol.new_id("chatcmpl" if chat else "cmpl")
        reqs = await self.engine_requests(loaded, body, prompts, arrival, response_id)
        try:
            streams = loaded.engine.submit_all(reqs)
        except (QueueFull, EngineClosed) as exc:
            raise (_queue_full(loaded.engine) if isinstance(exc, QueueFull) else _unavailable(exc)) from None
        reply = Reply(self, loaded, reqs, chat, body, response_id, [p.text for p in prompts])
        if body.stream:
            return StreamingResponse(reply.sse(streams), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(asyncio.gather(*(_drain(s) for s in streams)))
        gone = asyncio.ensure_future(_until_disconnect(http))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            for req in reqs:
                loaded.engine.abort(req)  # no-op when finished; frees the slot when the client left
        if not collect.done():
            collect.cancel()
            return Response(status_code=499)  # client closed the connection; nobody reads this
        try:
            collect.result()
        except Exception as exc:
            raise engine_error(exc) from None
        return JSONResponse(reply.response().model_dump())


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    text: str  # routing text; with echo, the text put before the completion
    max_tokens: int


def choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j of a seeded request draws with seed + j (wrapped into the seed range), so the
    choices differ and each is reproducible on its own."""
    if seed is None or j == 0:
        return seed
    low, high = SEED_RANGE
    return (seed + j - low) % (high - low) + low


def _refuse_unserved(body: protocol.GenerationRequest) -> None:
    """A 400 naming a field the protocol accepts but this serving path does not carry out."""
    chat = isinstance(body, protocol.ChatCompletionRequest)
    if chat and body.wants_tool_calls():
        raise APIError(400, "tool calling is not supported: tools are not rendered into the prompt nor parsed "
                            "from the output (send no tools, or tool_choice 'none')", param="tools")
    if chat and any(m.tool_calls for m in body.messages):
        raise APIError(400, "'messages' with tool_calls are not supported: the chat template cannot render calls",
                       param="messages")


def _queue_full(engine: AsyncEngine) -> APIError:
    return APIError(429, f"server is at capacity ({engine.in_flight} requests in flight); retry later",
                    code="queue_full", headers={"Retry-After": str(RETRY_AFTER_FULL_S)})


def _unavailable(exc: Exception) -> APIError:
    return APIError(503, str(exc), code="unavailable", headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})


def engine_error(exc: Exception) -> APIError:
    """The error object for a request the engine could not finish."""
    if isinstance(exc, EngineClosed):
        return _unavailable(exc)
    return APIError(500, f"internal server error: {exc}")


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def _merge(streams):
    """(choice index, StepOutput) from every choice's stream as they come; a failed choice's
    exception is raised (the response then ends with an error)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k, stream):
        try:
            async for out in stream:
                queue.put_nowait((k, out))
        except Exception as exc:
            queue.put_nowait((k, exc))
        queue.put_nowait((k, None))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            k, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()


async def _until_disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


class Reply:
    """OpenAI response objects for one request (all its choices), completion or chat flavour."""

    def __init__(self, service: OpenAIServing, loaded: Loaded, reqs: list[EngineRequest], chat: bool,
                 body: protocol.GenerationRequest, response_id: str, prompt_texts: list[str]):
        self.service, self.loaded, self.reqs, self.chat = service, loaded, reqs, chat
        self.id, self.n = response_id, body.n
        self.top = body.logprobs_count()  # None: no logprobs
        self.echo = not chat and body.echo
        self.include_usage, self.continuous = body.include_usage(), body.continuous_usage()
        self.prompt_texts = prompt_texts
        self._offset = [0] * len(reqs)  # streamed completions: text_offset of each choice's next token

    def info(self) -> protocol.IgserveInfo:
        """The mask the (first) request runs under; known once the engine has scheduled it."""
        req = self.reqs[0]
        choice = self.loaded.masks[req.mask_id]
        route = req.route
        return protocol.IgserveInfo(mask=req.mask_id, skip_ratio=choice.skip_ratio, compute_saved=choice.compute_saved,
                                    router_ms=route.router_ms if route else 0.0,
                                    distance=route.distance if route else None,
                                    budget=route.budget if route else None, fallback=bool(route and route.fallback),
                                    predicted_loss=route.predicted_loss if route else None,
                                    router=self.loaded.router.method if route and route.by_router else None,
                                    adaptive=req.adapted)

    def usage(self, reqs: list[EngineRequest] | None = None) -> protocol.Usage:
        """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice."""
        reqs = self.reqs if reqs is None else reqs
        prompts = [r for k, r in enumerate(reqs) if reqs is not self.reqs or k % self.n == 0]
        n_prompt = sum(len(r.prompt_ids) for r in prompts)
        n_out = sum(len(r.output_ids) for r in reqs)
        details = protocol.PromptTokensDetails(cached_tokens=sum(r.num_cached for r in prompts))
        return protocol.Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                              prompt_tokens_details=details)

    def _common(self) -> dict:
        return {"id": self.id, "model": self.loaded.name, "igserve": self.info()}

    def _chat_lp(self, ids: list[int], lps: list[float], tops: list) -> protocol.ChatLogprobs | None:
        if self.top is None:
            return None
        return protocol.chat_logprobs(self.loaded.tokenizer, ids[:len(lps)], lps, tops)

    def _completion_lp(self, k: int, ids: list[int], lps: list, tops: list) -> protocol.CompletionLogprobs | None:
        if self.top is None:
            return None
        out = protocol.completion_logprobs(self.loaded.tokenizer, ids[:len(lps)], lps, tops, self._offset[k])
        if out.tokens:
            last = protocol.token_bytes(self.loaded.tokenizer, ids[len(lps) - 1]).decode(errors="ignore")
            self._offset[k] = out.text_offset[-1] + len(last)
        return out

    def _prompt_part(self, k: int) -> tuple[str, list[int], list, list]:
        """With echo: the prompt's text, ids and logprobs that come before choice k's completion."""
        if not self.echo:
            return "", [], [], []
        req = self.reqs[k]
        return self.prompt_texts[k // self.n], req.prompt_ids, req.prompt_lps, req.prompt_tops

    def response(self) -> BaseModel:
        if self.chat:
            return protocol.ChatCompletionResponse(**self._common(), usage=self.usage(), choices=[
                protocol.ChatChoice(index=k, message=protocol.ChatMessageOut(content=r.text),
                                    logprobs=self._chat_lp(r.output_ids, r.logprobs, r.top_logprobs),
                                    finish_reason=r.finish_reason) for k, r in enumerate(self.reqs)])
        choices = []
        for k, r in enumerate(self.reqs):
            text, ids, lps, tops = self._prompt_part(k)
            logprobs = self._completion_lp(k, ids + r.output_ids, lps + r.logprobs, tops + r.top_logprobs)
            choices.append(protocol.CompletionChoice(index=k, text=text + r.text, logprobs=logprobs,
                                                     finish_reason=r.finish_reason))
        return protocol.CompletionResponse(**self._common(), usage=self.usage(), choices=choices)

    def chunk(self, k: int, out: StepOutput | None, text: str, prompt: tuple = ((), (), ())) -> BaseModel:
        """Choice k's chunk for one step's output (None: the role chunk)."""
        finish = self.reqs[k].finish_reason if out is not None and out.finished else None
        ids, lps, tops = (list(p) for p in prompt)
        if out is not None:
            ids, lps, tops = ids + out.new_token_ids, lps + out.logprobs, tops + out.top_logprobs
        usage = self.usage([self.reqs[k]]) if self.continuous else None
        if self.chat:
            delta = protocol.ChatDelta(role="assistant" if out is None else None, content=text)
            return protocol.ChatCompletionChunk(**self._common(), usage=usage, choices=[protocol.ChatChunkChoice(
                index=k, delta=delta, logprobs=self._chat_lp(ids, lps, tops) if lps else None,
                finish_reason=finish)])
        return protocol.CompletionResponse(**self._common(), usage=usage, choices=[protocol.CompletionChoice(
            index=k, text=text, logprobs=self._completion_lp(k, ids, lps, tops) if lps else None,
            finish_reason=finish)])

    def usage_chunk(self) -> BaseModel:
        kind = protocol.ChatCompletionChunk if self.chat else protocol.CompletionResponse
        return kind(**self._common(), choices=[], usage=self.usage())

    async def sse(self, streams):
        """``data:`` events: per choice (chat) a role chunk, then text deltas, the last with the
        finish reason; usage; ``[DONE]``. Every chunk names the mask, so the first waits for the
        engine to schedule (and route) the request. A request the engine could not finish ends
        with an error event. Leaving early (client gone) aborts every choice."""
        try:
            started = set()
            async for k, out in _merge(streams):
                prompt = ((), (), ())
                text = out.delta
                if k not in started:
                    started.add(k)
                    if self.chat:
                        yield _event(self.chunk(k, None, ""))
                    echo, *prompt = self._prompt_part(k)
                    text = echo + text
                if text or out.finished or out.logprobs:
                    yield _event(self.chunk(k, out, text, prompt))
            if self.include_usage:
                yield _event(self.usage_chunk())
        except Exception as exc:  # the engine failed this request, or the server is stopping
            err = engine_error(exc)
            log.warning("stream %s ended with an error: %s", self.id, exc)
            self.service.count_error(err.type)
            yield _event(err.response().body)
        finally:
            for req in self.reqs:
                self.loaded.engine.abort(req)
        yield "data: [DONE]\n\n"


def _event(payload: BaseModel | bytes) -> str:
    data = payload.decode() if isinstance(payload, bytes) else payload.model_dump_json()
    return f"data: {data}\n\n"


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` gets 413 before it is read (by Content-Length) or
    as soon as the bytes received pass the limit (chunked uploads)."""

    def __init__(self, app, max_bytes: int, count: Callable[[str], None]):
        self.app, self.max_bytes, self.count = app, max_bytes, count

    def _error(self) -> APIError:
        return APIError(413, f"request body is larger than this server's limit of {self.max_bytes} bytes",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            err = self._error()
            self.count(err.type)
            return await err.response()(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()  # rendered by the APIError handler
            return message

        return await self.app(scope, limited, send)
