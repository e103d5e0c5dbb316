"""Continuous-batching engine over the block-masked runner (synchronous core).

Each ``step()`` either prefills newly admitted requests (when a cache slot is free) or decodes
one token for every running request. Requests with different masks share a step: the runner
skips a block for the rows whose mask skips it (server.runner). Requests join and leave between
steps.
A request without a mask is routed (``router``) right before it is admitted, in one encoder
batch with the others admitted in that step.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from router.router import Route, Router
from server.runner import BlockRunner
from server.sampling import SamplingParams, find_stop, holdback, sample


@dataclass
class Request:
    prompt_ids: list[int]
    mask: torch.Tensor | None  # bool [B]; None: routed on ``routing_text`` at admission
    params: SamplingParams
    mask_id: str | None = "dense"
    routing_text: str | None = None
    route: Route | None = None  # set when the engine routed the request
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    # state
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # detokenised output, cut at a stop string
    emitted: int = 0  # characters of text already handed out
    slot: int | None = None
    finish_reason: str | None = None
    first_token_time: float | None = None
    scheduled_time: float | None = None
    generator: torch.Generator | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_ids = itertools.count()


class RoutingFailed(Exception):
    """The router raised while routing ``requests`` (they are out of the queue; nothing else is)."""

    def __init__(self, requests: list[Request], cause: Exception):
        super().__init__(f"routing failed: {cause}")
        self.requests = requests


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list[int]
    delta: str  # new text safe to hand out
    finished: bool


class LLMEngine:
    """Schedules requests onto the runner's cache slots; one step = one batched forward."""

    def __init__(self, runner: BlockRunner, tokenizer, max_batch: int | None = None, router: Router | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.router = router
        self.max_batch = min(max_batch or runner.cache.slots, runner.cache.slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(self.max_batch))
        eos = runner.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self.blocks_executed = torch.zeros(2, dtype=torch.long)  # attn, ffn (token-blocks)

    def warm_up(self) -> None:
        """Pay first-call costs (TorchScript's profiling runs of the encoder, kernel set-up) before
        the first request does; on the thread that will serve."""
        if self.router is not None:
            self.router.warm_up()
        dense = torch.ones(1, self.runner.num_blocks, dtype=torch.bool)
        self.runner.prefill([[0] * 8], dense, [self.free_slots[0]])  # a free slot: nothing to overwrite

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        if len(request.prompt_ids) == 0:
            raise ValueError("prompt is empty")
        if len(request.prompt_ids) + 1 > self.runner.max_len:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in a context of "
                             f"{self.runner.max_len}")
        if request.mask is None and (self.router is None or request.routing_text is None):
            raise ValueError("a request without a mask needs a routing text and an engine with a router")
        request.generator = request.params.generator(self.runner.device)
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """Drop a request now (client gone); its slot is free for the next step."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self._release(request)
        request.finish_reason = request.finish_reason or "abort"

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[StepOutput]:
        admitted = list(itertools.islice(self.waiting, len(self.free_slots)))
        if admitted:
            self._route([r for r in admitted if r.mask is None])  # before taking slots
            for req in admitted:
                self.waiting.popleft()
                req.slot = self.free_slots.pop(0)
                req.scheduled_time = time.monotonic()
            self.running.extend(admitted)
            masks = torch.stack([r.mask for r in admitted])
            logits = self.runner.prefill([r.prompt_ids for r in admitted], masks, [r.slot for r in admitted])
            self._count_blocks(masks, [len(r.prompt_ids) for r in admitted])
            return self._advance(admitted, logits)
        if not self.running:
            return []
        batch = list(self.running)
        masks = torch.stack([r.mask for r in batch])
        logits = self.runner.decode([r.output_ids[-1] for r in batch],
                                    [len(r.prompt_ids) + len(r.output_ids) - 1 for r in batch],
                                    masks, [r.slot for r in batch])
        self._count_blocks(masks, [1] * len(batch))
        return self._advance(batch, logits)

    def _route(self, requests: list[Request]) -> None:
        if not requests:
            return
        try:
            routes = self.router.route([r.routing_text for r in requests])
        except Exception as exc:  # only these requests fail; the running batch goes on
            for req in requests:
                self.abort(req)
            raise RoutingFailed(requests, exc) from exc
        for req, route in zip(requests, routes):
            req.mask, req.mask_id, req.route = self.router.masks[route.mask_id], route.mask_id, route

    def _count_blocks(self, masks: torch.Tensor, tokens: list[int]) -> None:
        per_row = masks.view(len(tokens), -1, 2).sum(1).cpu()  # [n, (attn, ffn)]
        self.blocks_executed += (per_row * torch.tensor(tokens)[:, None]).sum(0)

    def _advance(self, batch: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        now = time.monotonic()
        tokens = sample(logits, [r.params for r in batch], [r.generator for r in batch])
        outputs = []
        for req, tok in zip(batch, tokens):
            req.first_token_time = req.first_token_time or now
            req.output_ids.append(tok)
            self._update_text(req, tok)
            delta = self._take_delta(req)
            if req.finished:
                self._release(req)
            outputs.append(StepOutput(req, [tok], delta, req.finished))
        return outputs

    def _update_text(self, req: Request, tok: int) -> None:
        p = req.params
        if tok in self.eos_ids and not p.ignore_eos:
            req.finish_reason = "stop"
            return
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if p.stop:
            cut = find_stop(text, p.stop, len(req.text))
            if cut >= 0:
                req.text = text[:cut]
                req.finish_reason = "stop"
                return
        req.text = text
        if len(req.output_ids) >= p.max_tokens:
            req.finish_reason = "length"
        elif len(req.prompt_ids) + len(req.output_ids) >= self.runner.max_len:
            req.finish_reason = "length"

    def _take_delta(self, req: Request) -> str:
        end = len(req.text)
        if not req.finished:
            end -= holdback(req.params.stop)
            while end > req.emitted and req.text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                end -= 1
        if end <= req.emitted:
            return ""
        delta = req.text[req.emitted:end]
        req.emitted = end
        return delta

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.free_slots.append(req.slot)
        self.free_slots.sort()

    # ------------------------------------------------------------------ offline convenience
    def generate(self, requests: list[Request]) -> list[Request]:
        """Run requests to completion (tests, benchmarks, evaluation)."""
        for r in requests:
            self.add(r)
        while self.has_work():
            self.step()
        return requests
