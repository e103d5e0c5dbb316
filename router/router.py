"""Input-guided routing: embed a request's routing text, pick the mask of the nearest centroid (cosine).

``Router`` is synchronous and batched; ``BatchingRouter`` is its asyncio front: calls that arrive
while an encoder batch is running are coalesced into the next batch, which runs off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from masks.bank import BankError, MaskBank
from router.encoder import ENCODER_DIM, EncoderError, check_name, embed, load_encoder


@dataclass(frozen=True)
class Route:
    mask_id: str
    distance: float  # cosine distance (1 - cos) to the chosen centroid
    router_ms: float  # time spent routing (for a batch: the whole batch)


def chat_routing_text(messages: list[dict]) -> str:
    """What a chat request is routed on: the last user turn, then the system prompt.

    The last user turn says what the model is about to answer, so it carries the domain; the
    system prompt adds standing context ("you are a SQL assistant"). Earlier turns and assistant
    replies are left out: they describe what was already answered and would blur the signal. The
    user turn comes first because the encoder keeps only the beginning of a long text.
    """
    users = [m["content"] for m in messages if m["role"] == "user"]
    systems = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    return "\n\n".join(users[-1:] + systems)


class Router:
    """Nearest-centroid lookup over a mask bank's centroids."""

    def __init__(self, bank: MaskBank, encoder=None):
        try:
            check_name(bank.encoder["name"])
        except EncoderError as exc:
            raise BankError(f"mask bank needs encoder {bank.encoder['name']!r}: {exc}") from exc
        if bank.encoder["dim"] != ENCODER_DIM:
            raise BankError(f"mask bank centroids have {bank.encoder['dim']} dimensions, the encoder {ENCODER_DIM}")
        self.encoder = encoder or load_encoder()
        self.centroids = F.normalize(bank.centroid_tensor(), dim=1)
        self.mask_ids = list(bank.mask_ids)

    def route(self, texts: list[str], batch_size: int = 32) -> list[Route]:
        start = time.perf_counter()
        with torch.inference_mode():
            sims = embed(texts, batch_size, self.encoder) @ self.centroids.T
        best, idx = sims.max(1)
        ms = (time.perf_counter() - start) * 1000
        return [Route(self.mask_ids[i], 1.0 - s, ms) for s, i in zip(best.tolist(), idx.tolist())]


class BatchingRouter:
    """Async routing with batched encoding; ``router_ms`` is each caller's wall time in the router.
    Each encoder batch runs inside ``hold()`` (the server passes one that pauses engine steps)."""

    def __init__(self, router: Router, max_batch: int = 64,
                 hold: Callable[[], AbstractContextManager] = nullcontext):
        self.router = router
        self.max_batch = max_batch
        self.hold = hold
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="igserve-router")

    async def route(self, text: str) -> Route:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        future = loop.create_future()
        self._pending.append((text, future))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        route = await future
        return replace(route, router_ms=(time.perf_counter() - start) * 1000)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            try:
                routes = await loop.run_in_executor(self._pool, self._route, [t for t, _ in batch])
            except Exception as exc:  # the encoder failed: every caller in the batch gets the error
                routes = [exc] * len(batch)
            for (_, future), route in zip(batch, routes):
                if future.done():  # the caller went away
                    continue
                if isinstance(route, Exception):
                    future.set_exception(route)
                else:
                    future.set_result(route)

    def _route(self, texts: list[str]) -> list[Route]:
        with self.hold():
            return self.router.route(texts)

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
