"""`igserve serve`: the OpenAI-compatible HTTP routes (FastAPI under uvicorn) and the process around them.

The port opens at once; the model, the mask bank and the routing encoder load in the background
(server.loading) and ``/health`` answers 503 until they are in. Without a bank file the server runs
dense. Request handling is in server.serving; this module only maps routes onto it.
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
import logging
import sys
from contextlib import asynccontextmanager
from typing import Callable

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.router import chat_routing_text
from server import config, protocol
from server.config import ServeConfig
from server.errors import APIError, install
from server.metrics import REGISTRY
from server.serving import COMPLETION_DEFAULT_MAX_TOKENS, BodyLimit, Service

__all__ = ["ServeConfig", "create_app", "add_arguments", "run"]

log = logging.getLogger("igserve.api")

# Request bodies are parsed by the handlers (strict, OpenAI error objects), so their schemas are
# declared here for /openapi.json rather than inferred from the signatures.
BODIES = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title="igserve", version="1", routes=app.routes,
                             description="OpenAI-compatible API with input-guided block pruning")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(cfg: ServeConfig, on_fatal: Callable[[str], None] = lambda message: None) -> FastAPI:
    """The ASGI app; ``on_fatal(message)`` is called when loading fails or the engine dies (``run``
    then stops uvicorn and exits non-zero)."""
    service = Service(cfg, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(service.load())
        yield
        loading.cancel()
        await service.close()

    app = FastAPI(title="igserve", lifespan=lifespan, redoc_url=None)
    app.openapi = lambda: _openapi(app)
    app.state.service = service
    install(app, service.count_error)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes, count=service.count_error)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(service.authorize)])

    @v1.get("/models")
    async def list_models():
        served = service.ready()
        return protocol.ModelList(data=[protocol.ModelCard(id=served.name, max_model_len=served.context)])

    @v1.post("/completions")
    async def completions(http: Request):
        arrival, served, body = await service.accept(http, protocol.CompletionRequest)
        prompt = body.prompts()[0]
        if isinstance(prompt, list):  # token ids
            if any(not 0 <= t < served.vocab_size for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {served.vocab_size})", param="prompt")
            ids, text = list(prompt), served.tokenizer.decode(prompt)
        else:
            text = prompt
            ids = await service.tokenize(served, text, "prompt")
        max_tokens = service.max_tokens(served, body, len(ids), "prompt", COMPLETION_DEFAULT_MAX_TOKENS)
        return await service.generate(http, served, body, ids, text, max_tokens, arrival, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(http: Request):
        arrival, served, body = await service.accept(http, protocol.ChatCompletionRequest)
        messages = body.template_messages()
        try:
            text = await service.off_loop(lambda: served.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False))
        except Exception as exc:  # template errors (e.g. role order) are the client's to fix
            raise APIError(400, f"messages do not fit the model's chat template: {exc}", param="messages") from None
        ids = await service.tokenize(served, text, "messages", add_special_tokens=False)
        max_tokens = service.max_tokens(served, body, len(ids), "messages", cfg.max_tokens_limit)
        return await service.generate(http, served, body, ids, chat_routing_text(messages), max_tokens, arrival,
                                      chat=True)

    app.include_router(v1)

    @app.get("/health")
    async def health():
        served = service.served
        body = {"status": service.status if service.status != "ok" or service.healthy else "failed"}
        if served is not None:
            body.update(model=served.name, dtype=served.dtype, routing="ig" if served.routing else "dense",
                        masks=list(served.masks), engine_alive=served.engine.alive,
                        running=served.engine.num_running, waiting=served.engine.num_waiting)
        return JSONResponse(body, status_code=200 if service.healthy else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app


# ---------------------------------------------------------------------------- the process
def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the engine on SIGTERM: admission stops at once, requests in flight
    get ``drain_timeout`` seconds to finish (then end with an error), then the connections close."""

    def __init__(self, app: FastAPI, cfg: ServeConfig):
        super().__init__(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                        access_log=False, timeout_graceful_shutdown=cfg.drain_timeout + 5))
        self.service: Service = app.state.service

    async def shutdown(self, sockets=None):
        self.service.begin_drain()
        closing = asyncio.ensure_future(self.service.close())
        await super().shutdown(sockets)
        await closing


def run(args: argparse.Namespace) -> int:
    cfg = config.from_args(args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failures: list[str] = []

    def on_fatal(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    server = DrainingServer(create_app(cfg, on_fatal), cfg)
    server.run()
    if failures:
        print(f"error: {failures[0]}", file=sys.stderr)
        return 1
    return 0
