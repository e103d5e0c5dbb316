"""Continuous-batching engine core (synchronous): schedule -> route -> execute -> postprocess.

``step()`` asks the scheduler (server.scheduler) for one step's work: a decode token for every
running request and prefill chunks within the token budget. The requests the step admits are
routed first, in one encoder batch. Decode rows and prefill chunks run as one batched forward
where the runner packs rows (its cost follows real tokens, not padding), else as two; rows with
different masks share each (the runner skips a block for the rows whose mask skips it). Postprocessing samples, detokenises incrementally and applies stop conditions.
Choices of one prompt (n > 1) prefill it once: when the first one's prefill is done, the others
get a copy of its cached prompt and sample their first tokens from the same logits. A request
whose prompt starts with tokens a free slot still holds under the same mask (a shared system
prompt, the previous turn of a chat) skips their prefill (``_reuse_prefixes``); so does one whose
prompt starts with the chat template's shared prefix when only its K/V under the request's mask,
kept per mask once computed, are at hand: they are copied into its slot.

A failure fails only the requests it belongs to: a routing error the requests being routed, a
forward that raises is retried row by row, and a row with non-finite logits or whose sampling or
detokenising raises fails alone. The others in the step go on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from router.router import Router
from server.depth import AdaptiveDepth
from server.detokenizer import Detokenizer, backend
from server.request import Request
from server.runner import BlockRunner
from server.sampling import RowState, sample
from server.scheduler import Chunk, Scheduler, StepCost

__all__ = ["LLMEngine", "Request", "StepOutput"]

log = logging.getLogger("igserve.engine")


class RequestFailed(RuntimeError):
    """A request failed on the engine side; the message says where."""


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list[int]
    delta: str  # new text safe to hand out
    finished: bool
    logprobs: list[float] = field(default_factory=list)  # of new_token_ids, when the request asked for them
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def error(self) -> BaseException | None:
        return self.request.error


class LLMEngine:
    def __init__(self, runner: BlockRunner, tokenizer, max_batch: int | None = None, router: Router | None = None,
                 max_num_batched_tokens: int | None = None, depth: AdaptiveDepth | None = None,
                 prefix_cache: bool = True, shared_prefix: list[int] | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self._backend = backend(tokenizer)
        self.router = router
        self.depth = depth  # load-adaptive depth: may set the budget of the requests a step admits
        self.max_batch = min(max_batch or runner.cache.max_batch, runner.cache.max_batch)
        self._measure_budget = max_num_batched_tokens is None  # at warm-up, on the serving thread
        self.scheduler = Scheduler(self.max_batch, max_num_batched_tokens or runner.max_len, runner.max_len,
                                   prefix_cache=prefix_cache)
        eos = runner.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self.blocks_executed = [0, 0]  # attn, ffn (token-blocks)
        # the tokens every chat prompt starts with (the template's system turn): warmed per mask
        self.shared_prefix = shared_prefix if prefix_cache else None
        # their K/V per mask (bits) once computed, copied into the slot of a request whose own slot
        # and the free ones hold none under its mask (all slots busy, or held by other masks)
        self._shared_kv: dict[bytes, object] = {}

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    def warm_up(self) -> None:
        """Pay first-call costs (TorchScript's profiling runs of the encoder, kernel set-up) before
        the first request does; on the thread that will serve."""
        if self.router is not None:
            self.router.warm_up()
        dense = torch.ones(1, self.runner.num_blocks, dtype=torch.bool)
        self.runner.prefill([[0] * 8], dense, [self.scheduler.free_slots[0]])  # a free slot: nothing to overwrite
        if self._measure_budget:
            self.scheduler.cost = self.measure_cost()
        if self.shared_prefix:  # last: the warm-up above writes into free slots
            self.warm_prefixes(self.shared_prefix)

    def warm_prefixes(self, tokens: list[int]) -> int:
        """Prefill ``tokens`` under dense and each mask the router picks from at its default budget,
        each into a free slot of its own, kept as a freed slot's prefix: the first request routed
        to a mask then finds the shared start of its prompt cached, as later ones do. At most one
        mask per free slot; returns how many were warmed."""
        masks = [torch.ones(self.runner.num_blocks, dtype=torch.bool)]
        if self.router is not None:
            masks += [self.router.masks[m] for m in self.router.mask_ids_at()]
        masks = list({tuple(m.tolist()): m for m in masks}.values())  # ids with equal bits share a prefix
        sched = self.scheduler
        slots = [s for s in sched.free_slots if s not in sched.prefixes][: len(masks)]
        if len(tokens) < 2 or not slots:
            return 0
        chosen = masks[: len(slots)]
        self.runner.prefill([tokens] * len(slots), torch.stack(chosen), slots)
        for slot, mask in zip(slots, chosen):
            sched.hold_prefix(slot, tokens, mask)
            saved = self.runner.save_prefix(slot, len(tokens)) if tokens == self.shared_prefix else None
            if saved is not None:
                self._shared_kv[_bits(mask)] = saved
        log.info("prefix cache: the %d shared prompt tokens warmed under %d of %d masks", len(tokens), len(slots),
                 len(masks))
        return len(slots)

    def measure_cost(self, repeats: int = 3) -> StepCost:
        """Time decode steps (1 and a full batch of rows) and prefill chunks (8 and 64 tokens; beside a
        decoding row where they share its forward) on the serving thread, so the scheduler can size
        each step's prefill chunk by its decode time."""
        n = self.max_batch
        dense = torch.ones(n, self.runner.num_blocks, dtype=torch.bool)
        slots = list(range(n))  # all free at warm-up

        def timed(fn) -> float:
            fn()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2]

        self.runner.prefill([[0] * 64], dense[:1], slots[:1])
        decode = {r: timed(lambda r=r: self.runner.decode([0] * r, [64] * r, dense[:r], slots[:r])) for r in (1, n)}
        if self.runner.packs_rows and n > 1:  # the chunk joins the decoding rows' forward: what it adds to one
            chunk = {t: timed(lambda t=t: self.runner.extend([[0], [0] * t], [64, 0], dense[:2], slots[:2]))
                     - decode[1] for t in (8, 64)}
        else:
            chunk = {t: timed(lambda t=t: self.runner.extend([[0] * t], [0], dense[:1], slots[:1])) for t in (8, 64)}
        per_row = max(0.0, (decode[n] - decode[1]) / max(n - 1, 1))
        per_token = max((chunk[64] - chunk[8]) / 56, 1e-6)
        cost = StepCost(decode[1] - per_row, per_row, max(0.0, chunk[8] - 8 * per_token), per_token)
        log.info("step cost: decode %.1f ms + %.2f ms/row, prefill chunk %.1f ms + %.2f ms/token: chunks of "
                 "%d tokens beside 1 decoding row, %d beside %d", cost.decode_s * 1e3, per_row * 1e3,
                 cost.chunk_s * 1e3, per_token * 1e3, cost.prefill_tokens(1), cost.prefill_tokens(n), n)
        return cost

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        lead = request.shares_prefill_of
        if lead is not None and (lead.prompt_ids != request.prompt_ids
                                 or lead.prompt_logprobs != request.prompt_logprobs):
            raise ValueError("a request can only share the prefill of one with the same prompt and prompt scoring")
        if len(request.prompt_ids) == 0:
            raise ValueError("prompt is empty")
        if len(request.prompt_ids) + 1 > self.runner.max_len:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in a context of "
                             f"{self.runner.max_len}")
        if request.mask is None and (self.router is None or request.routing_text is None):
            raise ValueError("a request without a mask needs a routing text and an engine with a router")
        request.sampling = RowState(request.params, request.prompt_ids, request.grammar)
        request.detokenizer = Detokenizer(self._backend, request.params.stop)
        self.scheduler.add(request)

    def abort(self, request: Request) -> None:
        """Drop a request now (client gone); its slot is free for the next step."""
        self.scheduler.remove(request)
        request.finish_reason = request.finish_reason or "abort"

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[StepOutput]:
        sched = self.scheduler.schedule()
        if self.depth is not None:  # at admission, before routing binds the mask; never for running requests
            self.depth.admit(sched.admitted, len(self.scheduler.waiting))
        outputs = [self._fail(req, exc) for req, exc in self._route(sched.admitted)]
        self._reuse_prefixes(sched)
        now = time.monotonic()
        for req in sched.admitted:
            req.scheduled_time = now
        decode = [(Chunk(r, r.num_tokens - 1, 1), [r.output_ids[-1]]) for r in sched.decode if not r.finished]
        prefill = [(c, c.token_ids) for c in sched.prefill if not c.request.finished]
        # one forward for both where padding costs nothing: the weights stream once per step
        for group in filter(None, [decode + prefill] if self.runner.packs_rows else [decode, prefill]):
            rows, tokens = zip(*group)
            outputs += self._execute(list(rows), list(tokens))
        return outputs

    def _route(self, requests: list[Request]) -> list[tuple[Request, Exception]]:
        """Give each unrouted request its mask; the ones the router fails on are returned."""
        todo = [r for r in requests if r.mask is None]
        if not todo:
            return []
        try:
            routes = self.router.route([r.routing_text for r in todo], [r.budget for r in todo],
                                       [r.max_loss for r in todo])
        except Exception as exc:  # only these requests fail; the running batch goes on
            log.exception("routing failed")
            return [(r, RequestFailed(f"routing failed: {exc}")) for r in todo]
        for req, route in zip(todo, routes):
            req.mask, req.mask_id, req.route = self.router.masks[route.mask_id], route.mask_id, route
        return []

    def _reuse_prefixes(self, sched) -> None:
        """Now that the admitted requests have masks: move each to the free slot holding the longest
        prefix of its prompt under its mask and start its prefill chunk after that prefix."""
        chunks = {id(c.request): c for c in sched.prefill}
        for req in sched.admitted:
            chunk = chunks.get(id(req))
            if chunk is None or req.finished:  # failed routing
                continue
            hit = self._shared_prefix_hit(req, self.scheduler.bind_prefix(req))
            if hit:
                end = max(chunk.start + chunk.length, hit + 1)
                chunk.start, chunk.length = hit, end - hit
                req.num_computed = req.num_cached = hit

    def _shared_prefix_hit(self, req: Request, hit: int) -> int:
        """The prompt tokens req skips: ``hit`` (its slot's cached prefix), or the shared prefix
        where that is longer and its K/V under req's mask are kept (copied into req's slot)."""
        n = len(self.shared_prefix or ())
        if hit >= n or len(req.prompt_ids) <= n or not self.scheduler.reuses_prefixes(req) \
                or req.prompt_ids[:n] != self.shared_prefix:
            return hit
        saved = self._shared_kv.get(_bits(req.mask))
        if saved is None:
            return hit
        self.runner.load_prefix(saved, req.slot)
        return n

    def _keep_shared_prefix(self, rows: list[Chunk]) -> None:
        """Keep the shared prefix's K/V under the mask of each chunk that just computed it, once per mask."""
        n = len(self.shared_prefix or ())
        for c in rows:
            req = c.request
            if c.start < n <= c.start + c.length and req.prompt_ids[:n] == self.shared_prefix \
                    and _bits(req.mask) not in self._shared_kv:
                saved = self.runner.save_prefix(req.slot, n)
                if saved is not None:
                    self._shared_kv[_bits(req.mask)] = saved

    def _execute(self, rows: list[Chunk], tokens: list[list[int]]) -> list[StepOutput]:
        """One forward over rows; a row that makes it fail is found by running the rows one by one."""
        reqs = [c.request for c in rows]
        masks = torch.stack([r.mask for r in reqs])
        scored = [i for i, c in enumerate(rows) if c.request.prompt_logprobs is not None and c.start < c.request.num_prompt]
        try:
            args = (tokens, [c.start for c in rows], masks, [r.slot for r in reqs])
            if scored:
                logits, every = self.runner.extend_scoring(*args, scored)
            else:
                logits = self.runner.extend(*args)
        except Exception as exc:
            if len(rows) == 1:
                log.exception("forward failed for %s", reqs[0].request_id)
                return [self._fail(reqs[0], RequestFailed(f"forward failed: {exc}"))]
            log.warning("batched forward of %d rows failed (%s); retrying row by row", len(rows), exc)
            return [out for i in range(len(rows)) for out in self._execute(rows[i:i + 1], tokens[i:i + 1])]
        self._count_blocks(reqs, [c.length for c in rows])
        outputs = []
        for i, position_logits in zip(scored, every if scored else []):
            try:
                self._score(rows[i], position_logits)
            except Exception as exc:
                log.exception("scoring the prompt failed for %s", reqs[i].request_id)
                outputs.append(self._fail(reqs[i], RequestFailed(f"scoring the prompt failed: {exc}")))
        for c in rows:
            c.request.num_computed = c.start + c.length
        self._keep_shared_prefix(rows)
        done = [i for i, c in enumerate(rows) if not c.request.prefilling and not c.request.finished]
        # (request, row of logits it samples from): the rows that are done, and the choices that
        # share the prefill of a prompt finished in this step (they sample from its logits)
        batch = [(reqs[i], i) for i in done]
        for i in done:
            if rows[i].last:
                batch += [(r, i) for r in self._share_prefill(reqs[i], outputs)]
        for req, _ in batch:
            if req.params.max_tokens == 0:  # score only: no token is sampled
                req.finish_reason = "length"
                self.scheduler.remove(req)
                outputs.append(StepOutput(req, [], "", True))
        batch = [(r, i) for r, i in batch if not r.finished]
        if not batch:
            return outputs
        index = [i for _, i in batch]
        rows = logits if index == list(range(len(logits))) else logits[index]
        return outputs + self._postprocess([r for r, _ in batch], rows)

    def _share_prefill(self, leader: Request, outputs: list[StepOutput]) -> list[Request]:
        """The other choices of leader's prompt (n > 1), now that its prefill is done: as many as
        there are free slots get a copy of its cached prompt, its mask and its prompt logprobs, and
        are returned, to sample their first token from its logits. Those left without a slot are no
        longer held and prefill on their own; a copy that fails fails its choices."""
        waiting = [r for r in self.scheduler.waiting if r.shares_prefill_of is leader]
        taken = [r for r in waiting if self.scheduler.admit(r)]
        if not taken:
            return []
        try:
            self.runner.copy_slot(leader.slot, [r.slot for r in taken], leader.num_prompt)
        except Exception as exc:
            log.exception("copying the prompt of %s failed", leader.request_id)
            outputs += [self._fail(r, RequestFailed(f"copying the shared prompt failed: {exc}")) for r in taken]
            return []
        now = time.monotonic()
        for req in taken:
            req.mask, req.mask_id, req.route = leader.mask, leader.mask_id, leader.route
            req.num_computed = req.num_shared = leader.num_prompt
            req.scheduled_time = now
            if req.prompt_logprobs is not None:
                req.prompt_lps, req.prompt_tops = list(leader.prompt_lps), list(leader.prompt_tops)
        return taken

    @staticmethod
    def _score(chunk: Chunk, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens that this chunk's positions predict (chunked prefill
        scores a prompt piece by piece; the first token has none, as OpenAI's echo)."""
        req = chunk.request
        if chunk.start == 0:
            req.prompt_lps, req.prompt_tops = [None], [None]
        targets = req.prompt_ids[chunk.start + 1:chunk.start + chunk.length + 1]
        if not targets:
            return
        lp = torch.log_softmax(logits[:len(targets)].float(), -1)
        req.prompt_lps += lp.gather(1, torch.tensor(targets, device=lp.device)[:, None]).squeeze(1).tolist()
        k = req.prompt_logprobs
        if k:
            values, ids = lp.topk(k, -1)
            req.prompt_tops += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            req.prompt_tops += [[] for _ in targets]

    def _postprocess(self, batch: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        # one reduction; the elementwise pass only when the sum is not finite (a bad row, or overflow)
        finite = ([True] * len(batch) if bool(torch.isfinite(logits.sum()))
                  else torch.isfinite(logits).all(-1).tolist())
        outputs = [self._fail(r, RequestFailed("the model produced non-finite logits"))
                   for r, ok in zip(batch, finite) if not ok]
        keep = [i for i, ok in enumerate(finite) if ok]
        batch, logits = [batch[i] for i in keep], logits[keep]
        try:
            sampled = sample(logits, [r.sampling for r in batch])
            tokens = list(zip(sampled.tokens, sampled.logprobs, sampled.top_logprobs))
            for i, err in enumerate(sampled.errors):  # a row the sampler failed (no token allowed)
                if err is not None:
                    tokens[i] = None
                    outputs.append(self._fail(batch[i], RequestFailed(err)))
        except Exception:  # find the row(s) at fault; the others still get their token
            tokens = []
            for i, req in enumerate(batch):
                try:
                    alone = sample(logits[i:i + 1], [req.sampling])
                    if alone.errors[0] is not None:
                        raise RuntimeError(alone.errors[0])
                    tokens.append((alone.tokens[0], alone.logprobs[0], alone.top_logprobs[0]))
                except Exception as exc:
                    log.exception("sampling failed for %s", req.request_id)
                    tokens.append(None)
                    outputs.append(self._fail(req, RequestFailed(f"sampling failed: {exc}")))
        now = time.monotonic()
        for req, tok in zip(batch, tokens):
            if tok is None:
                continue
            try:
                outputs.append(self._append(req, *tok, now))
            except Exception as exc:
                log.exception("postprocessing failed for %s", req.request_id)
                outputs.append(self._fail(req, RequestFailed(f"detokenising failed: {exc}")))
        return outputs

    def _append(self, req: Request, tok: int, lp: float | None, top: list | None, now: float) -> StepOutput:
        req.first_token_time = req.first_token_time or now
        req.output_ids.append(tok)
        new_lp, new_top = ([lp], [top]) if lp is not None else ([], [])
        req.logprobs += new_lp
        req.top_logprobs += new_top
        rejected = req.sampling.append(tok)  # penalty counts; the grammar, where there is one
        if rejected is not None:
            return self._fail(req, RequestFailed(rejected))
        p, grammar = req.params, req.sampling.grammar
        if grammar is not None and grammar.is_terminated():  # the value is complete (its end token taken)
            req.finish_reason = "stop"
        elif tok in self.eos_ids and not p.ignore_eos:
            req.finish_reason = "stop"
        elif req.detokenizer.add(tok):
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.runner.max_len:
            req.finish_reason = "length"
        if req.finished:
            self.scheduler.remove(req)
        return StepOutput(req, [tok], req.detokenizer.delta(req.finished), req.finished, new_lp, new_top)

    def _fail(self, req: Request, exc: BaseException) -> StepOutput:
        req.finish_reason, req.error = "error", exc  # first: the scheduler keeps no K/V of a failed request
        self.scheduler.remove(req)
        return StepOutput(req, [], "", True)

    def _count_blocks(self, reqs: list[Request], tokens: list[int]) -> None:
        for req, n in zip(reqs, tokens):
            mask, kept = req.kept_blocks or (None, None)
            if mask is not req.mask:  # once per mask a request runs under: no tensor ops per step
                kept = req.mask.view(-1, 2).sum(0).tolist()
                req.kept_blocks = (req.mask, kept)
            self.blocks_executed[0] += kept[0] * n
            self.blocks_executed[1] += kept[1] * n

    # ------------------------------------------------------------------ offline convenience
    def generate(self, requests: list[Request]) -> list[Request]:
        """Run requests to completion (tests, benchmarks, evaluation)."""
        for r in requests:
            self.add(r)
        while self.has_work():
            self.step()
        return requests


def _bits(mask: torch.Tensor) -> bytes:
    """A mask as a dict key: masks with equal bits compute equal K/V."""
    return bytes(mask.tolist())
