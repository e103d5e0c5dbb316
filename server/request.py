"""One generation request as the engine sees it: prompt, mask, sampling, and its progress.

Requests compare by identity (``eq=False``): two requests with the same prompt are still two
requests, and a mask tensor must never be compared for queue membership.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from router.router import Route
from server.detokenizer import Detokenizer
from server.sampling import Grammar, RowState, SamplingParams

_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    mask: torch.Tensor | None  # bool [B]; None: routed on ``routing_text`` when admitted
    params: SamplingParams
    mask_id: str | None = "dense"
    routing_text: str | None = None
    grammar: Grammar | None = None  # the response format's matcher (structured outputs)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (echo); None: the prompt is not scored
    route: Route | None = None  # set when the engine routed the request
    budget: float | None = None  # routing options (None: the bank's default)
    max_loss: float | None = None
    adapted: bool = False  # admitted at a sparser budget by load-adaptive depth (server.depth)
    # another choice of the same prompt (n > 1): this request waits until that one's prefill is done,
    # then copies its cached prompt and samples its first token from the same logits
    shares_prefill_of: Request | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    # progress, owned by the engine thread
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the slot
    num_shared: int = 0  # prompt tokens copied from shares_prefill_of's slot instead of prefilled
    num_cached: int = 0  # prompt tokens whose K/V its slot still held (prefix cache) instead of prefilled
    slot: int | None = None
    slot_prefix: object | None = None  # scheduler.SlotPrefix its slot held when admitted, until bound
    finish_reason: str | None = None  # stop | length | abort | error
    error: BaseException | None = None  # why the request failed (finish_reason "error")
    first_token_time: float | None = None
    scheduled_time: float | None = None
    sampling: RowState | None = None  # penalties' token counts, seeded generator, grammar
    detokenizer: Detokenizer | None = None
    kept_blocks: tuple | None = None  # (mask, [attention, FFN] blocks it keeps): the engine's block count
    # per output token when params.logprobs is set; per prompt token (the first None) when scored
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_lps: list[float | None] = field(default_factory=list)
    prompt_tops: list[list[tuple[int, float]] | None] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def held(self) -> bool:
        """Waiting for the choice whose prefill it shares: that one is queued or still prefilling.
        Once it is done (or gone) a held request is admitted with it or, failing that, on its own."""
        lead = self.shares_prefill_of
        return lead is not None and not lead.finished and (lead.slot is None or lead.prefilling)

    @property
    def prefilling(self) -> bool:
        """The prompt is not yet all in the cache (chunked prefill)."""
        return self.num_computed < len(self.prompt_ids)

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""
