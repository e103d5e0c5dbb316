"""Which requests run in the next engine step, and how much of each: a per-step token budget.

Every running request that is decoding gets its one token first; the rest of the step's budget
goes to prefill chunks: first the prompts already being prefilled, then new admissions while
cache slots are free. A long prompt is prefilled in chunks over several steps, so it never stalls
the streams already running for longer than one chunk. The budget is either fixed
(``max_num_batched_tokens``, decode rows included, as vLLM's) or follows a measured ``StepCost``:
prefill tokens whose chunk takes at most ``STALL`` times the step's own decode time, so a step that
prefills is never much longer than one that does not, however many rows decode; one short prompt
(``SHORT_PROMPT`` tokens, a chat turn) per step is the exception and goes in whole, ahead of long
ones, so chat TTFT does not pay for protecting streams from long prompts. While nothing is
decoding there is no stream to stall, and a step may prefill up to ``idle_budget`` (``IDLE_CHUNK``
with a ``StepCost``: long enough to run at full speed, short enough that a new arrival waits little).
Prefill rows of one step are right-padded to the longest chunk, so the budget counts padded
tokens. A freed slot keeps its tokens' K/V (prefix cache, as llama-server's slots): once the engine
knows a new request's mask, ``bind_prefix`` moves it to the free slot holding the longest prefix of
its prompt computed under the same mask (a skipped attention block has no K/V, and a block's K/V
depend on every block before it), and that prefix is not prefilled again. Choices of one prompt
(n > 1) are held back while their first choice prefills; the engine then admits them with a copy of its cache (``admit``). The scheduler knows nothing of
models: it returns a plain ``Schedule`` that maps onto the runner's calls, and is tested with a
fake runner.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from os.path import commonprefix

import torch

from server.request import Request


@dataclass
class Chunk:
    request: Request
    start: int  # position of the first token (= tokens already cached)
    length: int

    @property
    def last(self) -> bool:
        """This chunk ends the prompt: its logits give the first output token."""
        return self.start + self.length == len(self.request.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_ids[self.start:self.start + self.length]


STALL = 0.75  # a prefill chunk may add this share of the step's decode time
MIN_CHUNK = 4  # prefill tokens a step always has room for, so prompts progress under any load
SHORT_PROMPT = 64  # with a StepCost, one prompt this short per step goes in whole, ahead of long ones
IDLE_CHUNK = 512  # prefill tokens of a step with nothing decoding: new arrivals wait one such step at most


@dataclass(frozen=True)
class StepCost:
    """Measured step time (at start-up): decoding r rows takes ``decode_s + per_row_s * r``, a
    prefill chunk of t tokens adds ``chunk_s + per_token_s * t`` (in the decoding rows' forward
    where the runner packs rows, else a second forward with a fixed cost of its own)."""

    decode_s: float
    per_row_s: float
    chunk_s: float
    per_token_s: float

    def prefill_tokens(self, rows: int) -> int:
        """Prefill tokens for a step with ``rows`` decoding rows."""
        room = STALL * (self.decode_s + self.per_row_s * rows) - self.chunk_s
        return max(MIN_CHUNK, int(room / self.per_token_s))


@dataclass
class SlotPrefix:
    """What a free slot still holds: the K/V of ``tokens`` computed under ``mask``."""

    tokens: list[int]
    mask: torch.Tensor
    freed: int  # order of release: the least recently freed slot is overwritten first


@dataclass
class Schedule:
    decode: list[Request] = field(default_factory=list)  # one token each, in slot order
    prefill: list[Chunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # given a slot in this step

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, max_batch: int, max_num_batched_tokens: int, idle_budget: int | None = None,
                 prefix_cache: bool = True):
        self.max_batch = max_batch
        self.prefix_cache = prefix_cache
        self.prefixes: dict[int, SlotPrefix] = {}  # free slot -> what its K/V still hold
        self._freed = 0
        self.set_budget(max_num_batched_tokens)
        self.cost: StepCost | None = None  # set: the budget follows it instead
        self.idle_budget = max(idle_budget or 0, max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in slot order
        self.free_slots = list(range(max_batch))

    def set_budget(self, max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < self.max_batch:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_batch "
                             f"({self.max_batch}), so that every running request can decode in each step")
        self.budget = max_num_batched_tokens

    def prefill_budget(self, decoding: int) -> int:
        """Padded prefill tokens the next step may run beside ``decoding`` decode rows."""
        if self.cost is not None:
            return self.cost.prefill_tokens(decoding) if decoding else IDLE_CHUNK
        if not decoding:
            return max(self.budget, self.idle_budget)
        return self.budget - decoding

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out (finished, aborted or failed); its slot is free for the next step."""
        if request.slot is None:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
            return
        if request in self.running:
            self.running.remove(request)
            self.free_slots.append(request.slot)
            self.free_slots.sort()
            # a failed request's K/V may be what failed; an unrouted one has none
            if self.prefix_cache and request.error is None and request.mask is not None and request.num_computed:
                self.hold_prefix(request.slot, (request.prompt_ids + request.output_ids)[:request.num_computed],
                                 request.mask)

    def hold_prefix(self, slot: int, tokens: list[int], mask: torch.Tensor) -> None:
        """Keep ``tokens``' K/V, computed under ``mask`` into free ``slot``, as a freed slot's prefix."""
        self._freed += 1
        self.prefixes[slot] = SlotPrefix(tokens, mask, self._freed)

    def schedule(self) -> Schedule:
        out = Schedule(decode=[r for r in self.running if not r.prefilling])
        budget = self.prefill_budget(len(out.decode))
        short = self._short_prompt() if out.decode and self.cost is not None else None
        if short is not None:  # a chat turn: chunking it would multiply its TTFT for little ITL
            self._add_chunk(out, short, len(short.prompt_ids))
            self._admit(out, short)
            budget -= len(short.prompt_ids)
        for req in self.running:  # prompts part-way through their prefill
            if req.prefilling and req is not short and not self._add_chunk(out, req, budget):
                return out
        for req in list(self.waiting):
            if not self.free_slots:
                break
            if req.held:  # admitted by the engine when the prefill it shares is done (``admit``)
                continue
            if not self._add_chunk(out, req, budget):
                break
            self._admit(out, req)
        self.running.sort(key=lambda r: r.slot)
        return out

    def _short_prompt(self) -> Request | None:
        """The first waiting request whose whole prompt is at most SHORT_PROMPT tokens."""
        if not self.free_slots:
            return None
        return next((r for r in self.waiting if not r.held and r.num_computed == 0
                     and len(r.prompt_ids) <= SHORT_PROMPT), None)

    def _admit(self, out: Schedule, req: Request) -> None:
        self._take_slot(req)
        out.admitted.append(req)

    def _take_slot(self, req: Request) -> None:
        """Move a waiting request into the lowest free slot (the caller keeps slot order)."""
        self.waiting.remove(req)
        req.slot = self.free_slots.pop(0)
        self.running.append(req)
        req.slot_prefix = self.prefixes.pop(req.slot, None)  # to be overwritten, unless ``bind_prefix`` moves it

    def reuses_prefixes(self, req: Request) -> bool:
        """Whether req may start from K/V computed before: prefix caching on, nothing computed yet,
        no prompt scoring (it needs every position's logits), no prefill shared with another choice."""
        return self.prefix_cache and not req.num_computed and req.prompt_logprobs is None \
            and req.shares_prefill_of is None

    def bind_prefix(self, req: Request) -> int:
        """Move a request just admitted (mask known) to the free slot, its own included, holding the
        longest prefix of its prompt computed under the same mask; with none, to a free slot holding
        nothing or else the least recently freed one, so the prefixes of other masks survive longer.
        Returns the prompt tokens it can skip (never the last one: its logits give the first token);
        0 for a request that scores its prompt or shares a prefill."""
        if req.slot_prefix is not None:  # what its slot held: a candidate like the free slots
            self.prefixes[req.slot], req.slot_prefix = req.slot_prefix, None
        candidates = [req.slot] + self.free_slots
        best, hit = None, 0
        if self.reuses_prefixes(req):
            for slot in candidates:
                held = self.prefixes.get(slot)
                if held is not None and torch.equal(held.mask, req.mask):
                    n = min(len(commonprefix([held.tokens, req.prompt_ids])), len(req.prompt_ids) - 1)
                    if n > hit:
                        best, hit = slot, n
        if best is None:  # freed counts from 1, so a slot holding nothing (0) comes first
            best = min(candidates, key=lambda s: (self.prefixes[s].freed if s in self.prefixes else 0, s))
        if best != req.slot:
            self.free_slots.remove(best)
            self.free_slots.append(req.slot)
            self.free_slots.sort()
            req.slot = best
            self.running.sort(key=lambda r: r.slot)
        self.prefixes.pop(best, None)
        return hit

    def admit(self, request: Request) -> bool:
        """Give a waiting request a free slot outside ``schedule`` (its prompt's K/V are copied in,
        not prefilled); False when every slot is taken."""
        if not self.free_slots:
            return False
        self._take_slot(request)
        self.running.sort(key=lambda r: r.slot)
        return True

    @staticmethod
    def _add_chunk(out: Schedule, req: Request, budget: int) -> bool:
        """Add as much of req's prompt as the padded budget allows; False when none fits."""
        rows = len(out.prefill) + 1
        longest = max((c.length for c in out.prefill), default=0)
        if rows * max(longest, 1) > budget:
            return False
        length = min(len(req.prompt_ids) - req.num_computed, max(longest, budget // rows))
        out.prefill.append(Chunk(req, req.num_computed, length))
        return True
