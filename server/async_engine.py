"""Asyncio front of the synchronous engine: one background thread loops ``LLMEngine.step()``.

New requests and aborts go through an inbox the thread drains between steps, so requests join
and leave the running batch at step boundaries; each step's outputs are handed to the requests'
asyncio queues with ``loop.call_soon_threadsafe``. Requests in the system (running + waiting) are
bounded by max_batch + max_queue: past that ``submit`` raises ``QueueFull``. ``shutdown`` drains.

All torch work of a running server happens on this one thread (steps and routing). libgomp gives
every thread that runs parallel ops its own worker team, and once there are more such threads
than cores it stops spinning between ops: steps measured 1.7x slower with a second team.

Failures: a request that fails in the engine gets its exception in its stream, alone. An
exception that escapes a step (a bug) fails the requests in the engine and serving goes on. If
the thread itself dies, every stream gets the error and ``on_death`` is told (the server then
answers 503 on /health and exits non-zero, for an orchestrator to restart it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from typing import Callable

from server.engine import LLMEngine, Request, StepOutput
from server.metrics import ServingMetrics

log = logging.getLogger("igserve.engine")


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full."""


class EngineClosed(Exception):
    """The engine is draining for shutdown and takes no new requests, or it stopped before a
    request finished (drain timeout, engine thread gone)."""


class RequestStream:
    """Async iterator over one request's StepOutputs, ending after the finished one."""

    def __init__(self, request: Request):
        self.request = request
        self.items: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self.items.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int, metrics: ServingMetrics | None = None,
                 on_death: Callable[[str], None] = lambda message: None):
        self.engine = engine
        self.on_death = on_death  # called on the event loop if the engine thread dies
        self.capacity = engine.max_batch + max_queue
        self.metrics = metrics
        self.num_running = 0  # written by the engine thread after each step
        self.num_waiting = 0
        self._streams: dict[str, RequestStream] = {}  # event-loop side: requests not yet finished
        self._inbox: queue.SimpleQueue[tuple[str, Request | list[Request]]] = queue.SimpleQueue()  # add: a list
        self._wake = threading.Event()
        self._idle = asyncio.Event()
        self._closing = False
        self._stop = False
        self.dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="igserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def submit(self, request: Request) -> RequestStream:
        """Queue a request; raises QueueFull or EngineClosed at once, never later."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[Request]) -> list[RequestStream]:
        """Queue requests together (the choices of one response): all or none, and the engine adds
        them between the same two steps, so choices sharing a prefill find each other queued."""
        if self._closing or self.dead is not None:
            raise EngineClosed("server is shutting down" if self.dead is None else "the engine has stopped")
        if len(self._streams) + len(requests) > self.capacity:
            raise QueueFull(f"{len(self._streams)} requests in flight, the limit is {self.capacity}")
        streams = [RequestStream(r) for r in requests]
        for stream in streams:
            self._streams[stream.request.request_id] = stream
        self._idle.clear()
        self._send("add", requests)
        return streams

    def abort(self, request: Request) -> None:
        """Drop a request (client gone); its slot is free at the next step. No-op once finished."""
        if self._streams.pop(request.request_id, None) is not None:
            self._send("abort", request)
            self._check_idle()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    @property
    def full(self) -> bool:
        return len(self._streams) >= self.capacity

    def close(self) -> None:
        """Refuse new requests from now on; the ones in flight go on."""
        self._closing = True

    async def shutdown(self, timeout: float | None = None) -> int:
        """Refuse new requests, let the ones in flight finish (for at most ``timeout`` seconds; then
        they end with EngineClosed), then stop the thread. Returns how many were cut off."""
        self._closing = True
        cut = 0
        if self._streams:
            log.info("draining %d in-flight requests", len(self._streams))
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                cut = len(self._streams)
                log.warning("drain timeout (%ss): ending %d requests still in flight", timeout, cut)
                self._end_all(EngineClosed(f"the server shut down before the request finished (drain timeout "
                                           f"{timeout:g}s)"))
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _send(self, op: str, request: Request | list[Request]) -> None:
        self._inbox.put((op, request))
        self._wake.set()

    def _deliver(self, items: list[tuple[Request, StepOutput | BaseException]]) -> None:
        for req, item in items:
            stream = self._streams.get(req.request_id)
            if stream is None:  # aborted by its client
                continue
            stream.items.put_nowait(item)
            if isinstance(item, BaseException) or item.finished:
                del self._streams[req.request_id]
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._streams:
            self._idle.set()

    def _end_all(self, exc: BaseException) -> None:
        """Event loop: every stream still open gets ``exc``; the engine drops their requests."""
        for stream in list(self._streams.values()):
            stream.items.put_nowait(exc)
            self._send("abort", stream.request)
        self._streams.clear()
        self._check_idle()

    def _died(self, exc: BaseException) -> None:
        self._end_all(EngineClosed(f"the engine stopped: {type(exc).__name__}: {exc}"))
        self.on_death(f"engine thread died: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._loop_steps()
        except BaseException as exc:  # the thread is going: say so, never die silently
            log.critical("engine thread died", exc_info=exc)
            self.dead = exc
            self._loop.call_soon_threadsafe(self._died, exc)

    def _loop_steps(self) -> None:
        engine = self.engine
        engine.warm_up()
        blocks = list(engine.blocks_executed)
        while True:
            self._drain_inbox()
            self._count()
            if not engine.has_work():
                if self._stop:
                    return
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug, not client input: fail what is in the engine, keep serving
                log.exception("engine step failed")
                self._fail(list(engine.running) + list(engine.waiting), exc)
                continue
            if self.metrics is not None:
                added = [a - b for a, b in zip(engine.blocks_executed, blocks)]
                self.metrics.step(outputs, added, time.monotonic())
            blocks = list(engine.blocks_executed)
            self._count()
            if outputs:
                self._loop.call_soon_threadsafe(
                    self._deliver, [(out.request, out.error or out) for out in outputs])

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, req = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                for one in req:
                    self._add(one)
            elif not req.finished:
                self.engine.abort(req)
                if self.metrics is not None:
                    self.metrics.finished(req, time.monotonic())

    def _add(self, req: Request) -> None:
        try:
            self.engine.add(req)
        except ValueError as exc:
            self._loop.call_soon_threadsafe(self._deliver, [(req, exc)])
            return
        if self.metrics is not None:
            self.metrics.queued(req, time.monotonic())

    def _fail(self, failed: list[Request], exc: Exception) -> None:
        for req in failed:
            self.engine.abort(req)
            if self.metrics is not None:
                self.metrics.finished(req, time.monotonic())
        self._loop.call_soon_threadsafe(self._deliver, [(req, exc) for req in failed])

    def _count(self) -> None:
        running, waiting = len(self.engine.running), len(self.engine.waiting) + self._inbox.qsize()
        if (running, waiting) != (self.num_running, self.num_waiting):
            self.num_running, self.num_waiting = running, waiting
            if self.metrics is not None:
                self.metrics.queue_sizes(running, waiting)
