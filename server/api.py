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

import swagger_ui_bundle
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server import config, protocol
from server.config import ServeConfig
from server.errors import install
from server.metrics import REGISTRY
from server.serving import BodyLimit, OpenAIServing

__all__ = ["ServeConfig", "create_app", "add_arguments", "run"]

log = logging.getLogger("igserve.api")

# Request bodies are parsed by the handlers (strict, OpenAI error objects), so their schemas are
# declared here for /openapi.json rather than inferred from the signatures.
BODIES = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
          "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest}


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
    service = OpenAIServing(cfg, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(service.load())
        yield
        loading.cancel()
        await service.close()

    app = FastAPI(title="igserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi(app)
    app.state.service = service
    install(app, service.count_error)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes, count=service.count_error)
    app.include_router(_openai_routes(service))
    _add_tokenizer_routes(app, service)
    _add_operations_routes(app, service)
    return app


def _openai_routes(service: OpenAIServing) -> APIRouter:
    """/v1: the OpenAI routes, behind the API key."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(service.authorize)])

    @v1.get("/models")
    async def list_models():
        loaded = service.ready()
        return protocol.ModelList(data=[protocol.ModelCard(id=loaded.name, max_model_len=loaded.context,
                                                           masks=list(loaded.masks))])

    @v1.post("/completions")
    async def completions(http: Request):
        return await service.completion(http)

    @v1.post("/chat/completions")
    async def chat_completions(http: Request):
        return await service.chat(http)

    return v1


def _add_tokenizer_routes(app: FastAPI, service: OpenAIServing) -> None:
    """vLLM's /tokenize and /detokenize, behind the API key."""

    @app.post("/tokenize", dependencies=[Depends(service.authorize)])
    async def tokenize(http: Request):
        return await service.tokenize_request(http)

    @app.post("/detokenize", dependencies=[Depends(service.authorize)])
    async def detokenize(http: Request):
        return await service.detokenize_request(http)


def _add_operations_routes(app: FastAPI, service: OpenAIServing) -> None:
    """/health, /docs and /metrics: open, for load balancers, people and Prometheus."""

    @app.get("/health")
    async def health():
        loaded = service.loaded
        body = {"status": service.status if service.status != "ok" or service.healthy else "failed"}
        if loaded is not None:
            body.update(model=loaded.name, dtype=loaded.dtype, weights=loaded.weights, kernels=loaded.kernels,
                        kv_cache_dtype=loaded.kv_cache_dtype,
                        routing="ig" if loaded.routing else "dense",
                        router=loaded.router.method if loaded.router else None, **_depth_state(loaded),
                        masks=list(loaded.masks), engine_alive=loaded.engine.alive,
                        running=loaded.engine.num_running, waiting=loaded.engine.num_waiting)
        return JSONResponse(body, status_code=200 if service.healthy else 503)

    # Swagger UI from the swagger-ui-bundle package: /docs works without internet access.
    app.mount("/docs/static", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="igserve API",
                                   swagger_js_url="/docs/static/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/static/swagger-ui.css",
                                   swagger_favicon_url="/docs/static/favicon-32x32.png")

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def _depth_state(loaded) -> dict:
    """/health's view of the routing budget: the default, and with --adaptive-depth whether it is engaged."""
    if loaded.router is None:
        return {}
    depth = loaded.engine.engine.depth
    state = {"default_budget": loaded.router.default_budget}
    if depth is not None:
        state["adaptive_depth"] = {"active": depth.active, "budget": depth.sparse, "engage_at": depth.engage,
                                   "release_below": depth.release, "adapted": depth.adapted,
                                   "mask": depth.shared_mask[0] if depth.shared_mask else "routed"}
    return state


# ---------------------------------------------------------------------------- the process
def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the engine on SIGTERM: admission stops at once, requests in flight
    get ``drain_timeout`` seconds to finish (then end with an error), then the connections close."""

    def __init__(self, app: FastAPI, cfg: ServeConfig):
        super().__init__(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                        access_log=False, timeout_graceful_shutdown=cfg.drain_timeout + 5))
        self.service: OpenAIServing = app.state.service

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
