"""`igserve serve`: the OpenAI-compatible HTTP API (FastAPI under uvicorn) over the async engine.

The port opens at once; the model, the mask bank and the routing encoder load in the background
and ``/health`` answers 503 until they are in. Without a bank file the server runs dense (mask
"dense" for every request, no router). Per request: validate, authorise, tokenise, take a forced
mask (``igserve.mask``) or hand the routing text to the engine, which routes at admission; queue,
and answer or stream SSE chunks.
"""

from __future__ import annotations

import os

# After each parallel region libgomp spins its worker threads (300k spins by default, ~15 ms on
# this kind of CPU) before they sleep: a core stays busy after every engine step while the event
# loop needs it to stream. 10k spins still bridge the gaps between ops inside a step (measured:
# same step times; OMP_WAIT_POLICY=PASSIVE instead made steps 1.5-1.8x slower). Set before torch
# loads OpenMP.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import argparse
import asyncio
import hmac
import logging
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from masks.bank import DENSE, BankError, MaskBank
from router.encoder import EncoderError, load_encoder
from router.router import Router, chat_routing_text
from server import models, protocol
from server.async_engine import AsyncEngine, EngineClosed, QueueFull
from server.engine import LLMEngine
from server.engine import Request as EngineRequest
from server.errors import APIError, from_validation, install
from server.metrics import REGISTRY, ServingMetrics, count_error
from server.runner import BlockRunner
from server.sampling import SamplingParams

DEFAULT_PORT = 8000
DEFAULT_BANK = "masks/banks/smollm2-135m-instruct-s0.25.json"
REPO_ROOT = Path(__file__).resolve().parents[1]
COMPLETION_DEFAULT_MAX_TOKENS = 16  # as OpenAI; chat defaults to what the limit and the context allow
RETRY_AFTER_FULL_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5

log = logging.getLogger("igserve.api")


@dataclass
class ServeConfig:
    model: str = models.DEFAULT_MODEL
    bank: str | None = DEFAULT_BANK
    api_key: str | None = None
    device: str = "cpu"
    max_batch: int = 16
    max_queue: int = 64
    max_tokens_limit: int = 1024
    max_model_len: int = 2048
    dtype: str = "auto"
    weights: str = "auto"  # linear weight format: auto | fp32 | bf16 | int8 | int4 (server/weights.py)


@dataclass(frozen=True)
class MaskChoice:
    mask: torch.Tensor
    skip_ratio: float
    compute_saved: float


@dataclass
class Served:
    """Everything a request needs once loading is done."""

    name: str
    tokenizer: object
    context: int
    vocab_size: int
    masks: dict[str, MaskChoice]  # every id a client may force, "dense" included
    routing: bool  # False: dense mode (no bank)
    engine: AsyncEngine
    metrics: ServingMetrics
    dtype: str
    weights: str = "fp32"


# ---------------------------------------------------------------------------- loading
def _bank_path(bank: str | None) -> Path | None:
    if not bank:
        return None
    path = Path(bank).expanduser()
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path  # the default bank ships inside the package tree
    return path if path.is_file() else None


def load_served(cfg: ServeConfig) -> Served:
    """Load model, bank and encoder, and build the engine (blocking; raises ModelLoadError,
    BankError or EncoderError with a message for the operator)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = models.resolve_dtype(cfg.dtype, cfg.device)  # the encoder's
    weights, lm_dtype = models.resolve_weights(cfg.weights, cfg.dtype, cfg.device)
    dtype_name = str(lm_dtype).removeprefix("torch.")
    lm = models.load(cfg.model, device=cfg.device, dtype=lm_dtype, weights=weights)
    log.info("model %s: %s weights, %s activations on %s", lm.name, weights, dtype_name, cfg.device)
    runner = BlockRunner(lm.model, max_slots=cfg.max_batch, max_len=cfg.max_model_len)
    path = _bank_path(cfg.bank)
    bank, router = None, None
    if path is None:
        log.warning("no mask bank at %s: serving dense (mask 'dense' for every request, router not loaded)",
                    cfg.bank)
    else:
        bank = MaskBank.load(path)
        bank.check_model(lm.fingerprint, runner.num_blocks)
        router = Router(bank, load_encoder(cfg.device, dtype))
        log.info("mask bank %s: %d clusters, sparsity %.2f, baselines %s", path, len(bank.mask_ids),
                 bank.sparsity, sorted(bank.baselines))
    masks = {}
    for mask_id in bank.all_mask_ids() if bank else [DENSE]:
        mask = bank.mask(mask_id) if bank else torch.ones(runner.num_blocks, dtype=torch.bool)
        masks[mask_id] = MaskChoice(mask, 1.0 - float(mask.float().mean()),
                                    runner.cost.compute_saved(mask))
    metrics = ServingMetrics(lm.name, {i: (m.skip_ratio, m.compute_saved) for i, m in masks.items()})
    engine = AsyncEngine(LLMEngine(runner, lm.tokenizer, cfg.max_batch, router), cfg.max_queue, metrics)
    return Served(lm.name, lm.tokenizer, runner.max_len, lm.model.config.vocab_size, masks, router is not None,
                  engine, metrics, dtype_name, weights=weights)


async def _in_own_thread(fn, *args):
    """``fn(*args)`` on a new thread that ends with it, so that the OpenMP workers torch starts
    there end too and the engine thread stays the only one with a team (see server.async_engine)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def target():
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(done.set_exception, exc)
        else:
            loop.call_soon_threadsafe(done.set_result, result)

    threading.Thread(target=target, name="igserve-load", daemon=True).start()
    return await done


# ---------------------------------------------------------------------------- the service
class Service:
    """Request handling shared by both endpoints; ``served`` is None until loading is done."""

    def __init__(self, cfg: ServeConfig, on_fatal: Callable[[str], None]):
        self.cfg = cfg
        self.on_fatal = on_fatal
        self.served: Served | None = None
        self.status = "loading"

    async def load(self) -> None:
        try:
            served = await _in_own_thread(load_served, self.cfg)
        except (models.ModelLoadError, BankError, EncoderError) as exc:
            message = str(exc)
        except Exception as exc:  # anything else: reported the same way, with a traceback
            log.exception("loading failed")
            message = f"{type(exc).__name__}: {exc}"
        else:
            served.engine.start()
            self.served, self.status = served, "ok"
            log.info("serving %s (context %d, %d masks, %s)", served.name, served.context, len(served.masks),
                     "input-guided routing" if served.routing else "dense")
            return
        self.status = "failed"
        log.error("%s", message)
        self.on_fatal(message)

    async def close(self) -> None:
        if self.served is not None:
            self.status = "draining"
            await self.served.engine.shutdown()

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

    def ready(self) -> Served:
        if self.served is None or self.status != "ok":
            raise APIError(503, f"server is {self.status}", code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})
        return self.served

    @staticmethod
    async def parse(http: Request, model: type[BaseModel]):
        try:
            return model.model_validate_json(await http.body())
        except ValidationError as exc:
            raise from_validation(exc) from None

    async def accept(self, http: Request, kind: type[BaseModel]) -> tuple[float, Served, BaseModel]:
        """Arrival time, the loaded model and the validated body of a generation request."""
        arrival = time.monotonic()
        served = self.ready()
        body = await self.parse(http, kind)
        if body.model != served.name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{served.name}'",
                           param="model", code="model_not_found")
        return arrival, served, body

    def max_tokens(self, served: Served, body: protocol.GenerationRequest, n_prompt: int, prompt_param: str,
                   default: int) -> int:
        ctx, limit = served.context, self.cfg.max_tokens_limit
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
    def choose_mask(served: Served, choice: str) -> str | None:
        """The mask id a request asks for; None: the engine routes it on its input."""
        if choice == "auto":
            return None if served.routing else DENSE
        if choice not in served.masks:
            valid = ", ".join(["auto", *served.masks])
            raise APIError(400, f"unknown mask '{choice}'; valid: {valid}", param="igserve.mask", code="unknown_mask")
        return choice

    async def generate(self, http: Request, served: Served, body: protocol.GenerationRequest,
                       prompt_ids: list[int], routing_text: str, max_tokens: int, arrival: float, chat: bool):
        mask_id = self.choose_mask(served, body.igserve.mask)
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos)
        mask = None if mask_id is None else served.masks[mask_id].mask
        req = EngineRequest(prompt_ids, mask, params, mask_id=mask_id, routing_text=routing_text, arrival=arrival)
        try:
            stream = served.engine.submit(req)
        except QueueFull:
            raise _queue_full(served.engine) from None
        except EngineClosed as exc:
            raise APIError(503, str(exc), code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)}) from None
        reply = _Reply(served, req, chat)
        if body.stream:
            return StreamingResponse(reply.sse(stream, body.include_usage()), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(_drain(stream))
        gone = asyncio.ensure_future(_until_disconnect(http))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            served.engine.abort(req)  # no-op when finished; frees the slot when the client left
        if not collect.done():
            collect.cancel()
            return Response(status_code=499)  # client closed the connection; nobody reads this
        collect.result()
        return JSONResponse(reply.response().model_dump())


def _queue_full(engine: AsyncEngine) -> APIError:
    return APIError(429, f"server is at capacity ({engine.in_flight} requests in flight); retry later",
                    code="queue_full", headers={"Retry-After": str(RETRY_AFTER_FULL_S)})


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def _until_disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


class _Reply:
    """OpenAI response objects for one request, completion or chat flavour."""

    def __init__(self, served: Served, req: EngineRequest, chat: bool):
        self.served, self.req, self.chat = served, req, chat
        self.id = protocol.new_id("chatcmpl" if chat else "cmpl")

    def info(self) -> protocol.IgserveInfo:
        """The mask the request runs under; known once the engine has scheduled it."""
        req, choice = self.req, self.served.masks[self.req.mask_id]
        return protocol.IgserveInfo(mask=req.mask_id, skip_ratio=choice.skip_ratio, compute_saved=choice.compute_saved,
                                    router_ms=req.route.router_ms if req.route else 0.0,
                                    distance=req.route.distance if req.route else None)

    def usage(self) -> protocol.Usage:
        n_prompt, n_out = len(self.req.prompt_ids), len(self.req.output_ids)
        return protocol.Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)

    def _common(self) -> dict:
        return {"id": self.id, "model": self.served.name, "igserve": self.info()}

    def response(self) -> BaseModel:
        req = self.req
        if self.chat:
            return protocol.ChatCompletionResponse(
                **self._common(), usage=self.usage(),
                choices=[protocol.ChatChoice(message=protocol.ChatMessageOut(content=req.text),
                                             finish_reason=req.finish_reason)])
        return protocol.CompletionResponse(
            **self._common(), usage=self.usage(),
            choices=[protocol.CompletionChoice(text=req.text, finish_reason=req.finish_reason)])

    def chunk(self, text: str, finish_reason: str | None = None, role: bool = False) -> BaseModel:
        if self.chat:
            delta = protocol.ChatDelta(role="assistant" if role else None, content=text)
            return protocol.ChatCompletionChunk(
                **self._common(), choices=[protocol.ChatChunkChoice(delta=delta, finish_reason=finish_reason)])
        return protocol.CompletionResponse(
            **self._common(), choices=[protocol.CompletionChoice(text=text, finish_reason=finish_reason)])

    def usage_chunk(self) -> BaseModel:
        kind = protocol.ChatCompletionChunk if self.chat else protocol.CompletionResponse
        return kind(**self._common(), choices=[], usage=self.usage())

    async def sse(self, stream, include_usage: bool):
        """``data:`` events: (chat) a role chunk, text deltas, the finish reason, usage, ``[DONE]``.
        Every chunk names the mask, so the first waits for the engine to schedule (and route) the
        request. Leaving early (client gone, server stopping) aborts the request."""
        try:
            first = True
            async for out in stream:
                if self.chat and first:
                    yield _event(self.chunk("", role=True))
                first = False
                if out.delta or out.finished:
                    yield _event(self.chunk(out.delta, self.req.finish_reason if out.finished else None))
            if include_usage:
                yield _event(self.usage_chunk())
        except Exception as exc:  # a server fault mid-stream: tell the client, then end
            log.exception("stream failed")
            yield _event(APIError(500, f"internal server error: {exc}").response().body)
        finally:
            self.served.engine.abort(self.req)
        yield "data: [DONE]\n\n"


def _event(payload: BaseModel | bytes) -> str:
    data = payload.decode() if isinstance(payload, bytes) else payload.model_dump_json()
    return f"data: {data}\n\n"


# ---------------------------------------------------------------------------- the app
def create_app(cfg: ServeConfig, on_fatal: Callable[[str], None] = lambda message: None) -> FastAPI:
    """The ASGI app; ``on_fatal(message)`` is called when loading fails (``run`` stops uvicorn)."""
    service = Service(cfg, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(service.load())
        yield
        loading.cancel()
        await service.close()

    app = FastAPI(title="igserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    install(app, service.count_error)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(service.authorize)])

    @v1.get("/models")
    async def list_models():
        served = service.ready()
        return protocol.ModelList(data=[protocol.ModelCard(id=served.name, max_model_len=served.context)])

    @v1.post("/completions")
    async def completions(http: Request):
        arrival, served, body = await service.accept(http, protocol.CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):  # token ids
            if any(not 0 <= t < served.vocab_size for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {served.vocab_size})", param="prompt")
            ids, text = list(prompt), served.tokenizer.decode(prompt)
        else:
            text = prompt[0] if isinstance(prompt, list) else prompt
            ids = served.tokenizer(text)["input_ids"]
        max_tokens = service.max_tokens(served, body, len(ids), "prompt", COMPLETION_DEFAULT_MAX_TOKENS)
        return await service.generate(http, served, body, ids, text, max_tokens, arrival, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(http: Request):
        arrival, served, body = await service.accept(http, protocol.ChatCompletionRequest)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            text = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # template errors (e.g. role order) are the client's to fix
            raise APIError(400, f"messages do not fit the model's chat template: {exc}", param="messages") from None
        ids = served.tokenizer(text, add_special_tokens=False)["input_ids"]
        max_tokens = service.max_tokens(served, body, len(ids), "messages", cfg.max_tokens_limit)
        return await service.generate(http, served, body, ids, chat_routing_text(messages), max_tokens, arrival,
                                      chat=True)

    app.include_router(v1)

    @app.get("/health")
    async def health():
        served = service.served
        body = {"status": service.status}
        if served is not None:
            body.update(model=served.name, dtype=served.dtype, weights=served.weights, routing="ig" if served.routing else "dense",
                        masks=list(served.masks),
                        running=served.engine.num_running, waiting=served.engine.num_waiting)
        return JSONResponse(body, status_code=200 if service.status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    parser.add_argument("--model", default=d.model, help="packaged model name or HF directory")
    parser.add_argument("--bank", default=d.bank, help="mask bank JSON; missing file: serve dense")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--api-key", default=os.environ.get("IGSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $IGSERVE_API_KEY)")
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--max-batch", type=int, default=d.max_batch, help="sequences per step (cache slots)")
    parser.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests before 429")
    parser.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit,
                        help="largest max_tokens a request may ask for")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                        help="context length (prompt + output) the KV cache is sized for")
    parser.add_argument("--dtype", default=d.dtype, choices=models.DTYPES,
                        help="weights and KV cache; auto: bfloat16 on CUDA and on CPUs with AMX, else float32")
    parser.add_argument("--weights", default=d.weights, choices=("auto", "fp32", "bf16", "int8", "int4"),
                        help="linear weight format; auto: by CPU (README, weight formats)")
    parser.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(model=args.model, bank=args.bank, api_key=args.api_key, device=args.device,
                       max_batch=args.max_batch, max_queue=args.max_queue, max_tokens_limit=args.max_tokens_limit,
                       max_model_len=args.max_model_len, dtype=args.dtype, weights=args.weights)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failures: list[str] = []

    def on_fatal(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    app = create_app(config_from_args(args), on_fatal)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False))
    server.run()
    if failures:
        print(f"error: {failures[0]}", file=sys.stderr)
        return 1
    return 0
