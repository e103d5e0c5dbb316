"""Batched token sampling with per-row parameters, and stop-sequence handling.

``sample(logits, rows)`` picks one token for every row of ``logits [B, V]`` in one call. Work is
vectorised over the rows that need it (penalties, bias, allowed-token masks, temperature, top-k,
top-p, min-p, logprobs) and per row only where the row owns state: a seeded row draws its noise
from its own ``torch.Generator``, so its tokens do not depend on the other rows of the batch.

Order of processing, as vLLM: allowed-token bitmask, logit bias, repetition/frequency/presence
penalties, then greedy argmax or temperature, min-p, top-k, top-p and a draw. Logprobs are the
raw model's (log-softmax of the logits before any processing) unless ``logprobs_mode`` is
``"processed"`` (log-softmax of what the token was drawn from, filtered tokens at -inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from server import cpu_kernels

MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's chat API
LOGIT_BIAS_LIMIT = 100.0  # |bias| per token, as OpenAI
GREEDY_TEMPERATURE = 1e-5  # below this a temperature is greedy: dividing by it would overflow
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes, end exclusive
# vLLM takes any positive value; beyond these float32 turns a penalised logit of 0 into NaN (0 * inf)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt+output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the top k (k <= MAX_LOGPROBS)
    logprobs_mode: Literal["raw", "processed"] = "raw"

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def verify(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first field out of range (the API validates the same
        ranges on the wire; this guards direct engine users)."""
        checks = [
            ("max_tokens", self.max_tokens >= 0),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0),
            ("top_p", 0 < self.top_p <= 1),
            ("top_k", self.top_k == -1 or self.top_k >= 0),
            ("min_p", 0 <= self.min_p <= 1),
            ("presence_penalty", -2 <= self.presence_penalty <= 2),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2),
            ("repetition_penalty", REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty
             <= REPETITION_PENALTY_RANGE[1]),
            ("logit_bias", all(isinstance(t, int) and 0 <= t < vocab_size and abs(b) <= LOGIT_BIAS_LIMIT
                               for t, b in self.logit_bias.items())),
            ("seed", self.seed is None or SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS),
            ("logprobs_mode", self.logprobs_mode in ("raw", "processed")),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"sampling parameter {name} out of range: {getattr(self, name)!r}")


class Grammar(Protocol):
    """What a row's structured-output constraint provides (server.structured.Matcher)."""

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None: ...
    def accept_token(self, token: int) -> bool: ...
    def is_terminated(self) -> bool: ...


class RowState:
    """One sequence's sampling state: its parameters, its generator, the token counts that the
    penalties read (kept incrementally, on the logits' device) and an optional grammar."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int] = (), grammar: Grammar | None = None):
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.grammar = grammar
        self.output_ids: list[int] = []
        self.generator: torch.Generator | None = None
        self._seen: torch.Tensor | None = None  # bool [V]: in prompt or output (repetition penalty)
        self._counts: torch.Tensor | None = None  # float [V]: occurrences in the output

    def _gen(self, device: torch.device) -> torch.Generator | None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.params.seed)
        return self.generator

    def _penalty_state(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None:
            self._counts = torch.zeros(vocab, device=device)
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = torch.tensor(self.prompt_ids, dtype=torch.long, device=device)
            self._seen[ids[(ids >= 0) & (ids < vocab)]] = True
            for t in self.output_ids:  # a row whose first sample() comes after some tokens
                self._count(t)
        return self._counts, self._seen

    def _count(self, token: int) -> None:
        if 0 <= token < self._counts.numel():
            self._counts[token] += 1
            self._seen[token] = True

    def append(self, token: int) -> str | None:
        """Record a sampled token; returns an error message when the grammar rejects it."""
        self.output_ids.append(token)
        if self._counts is not None:
            self._count(token)
        if self.grammar is not None and not self.grammar.accept_token(token):
            return f"token {token} does not fit the response format"
        return None


@dataclass
class SampleOutput:
    tokens: list[int]  # -1 where the row failed
    logprobs: list[float | None]  # the chosen token's logprob (rows that asked for logprobs)
    top_logprobs: list[list[tuple[int, float]] | None]  # (token, logprob), best first, k per row
    errors: list[str | None]  # why a row failed (non-finite logits, nothing allowed); None if fine


def _rows(mask: list[bool], device) -> torch.Tensor:
    return torch.tensor([i for i, m in enumerate(mask) if m], dtype=torch.long, device=device)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [N, ceil(V/32)] (bit j of word w allows token 32w+j, xgrammar's layout) -> bool [N, V]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def sample(logits: torch.Tensor, rows: list[RowState]) -> SampleOutput:
    """One token per row of ``logits [B, V]`` (any float dtype; processed in float32, top-p in
    float64). Does not change the rows apart from their generators; call ``RowState.append``."""
    params = [r.params for r in rows]
    raw, errors = _finite(logits.float())
    x = _processed(raw, rows, errors)
    tokens_t = _draw(x, rows)
    tokens = tokens_t.tolist()
    lp_out, top_out = _logprobs(raw, x, tokens_t, params)
    for i, e in enumerate(errors):
        if e is not None:
            tokens[i], lp_out[i], top_out[i] = -1, None, None
    return SampleOutput(tokens, lp_out, top_out, errors)


def _finite(raw: torch.Tensor) -> tuple[torch.Tensor, list[str | None]]:
    """The logits with failed rows zeroed, and each row's error. A row with NaN or +inf (or nothing
    but -inf) fails alone; it is sampled from zeros so no kernel sees the values. A row's sum is
    finite iff its values are (one reduction; the elementwise isfinite is four passes on CPU), so
    only the rare bad step looks closer."""
    errors: list[str | None] = [None] * raw.shape[0]
    if not bool(torch.isfinite(raw.sum(-1)).all()):
        bad = (torch.isnan(raw) | (raw == math.inf)).any(-1) | (raw == -math.inf).all(-1)
        for i in bad.nonzero().flatten().tolist():
            errors[i] = "the model produced non-finite logits"
        raw = torch.where(bad[:, None], torch.zeros((), device=raw.device), raw)
    return raw, errors


def _processed(raw: torch.Tensor, rows: list[RowState], errors: list[str | None]) -> torch.Tensor:
    """What the rows draw from, in vLLM's order: allowed tokens, logit bias, penalties, then
    temperature and the filters. ``raw`` stays as it is (raw logprobs read it); a row the grammar
    leaves no token gets its error in ``errors``, and failed rows are zero."""
    V, dev = raw.shape[1], raw.device
    params = [r.params for r in rows]
    constrained = [r.grammar is not None for r in rows]
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items() if 0 <= t < V]
    pen = [p.penalised for p in params]
    scaled = [not p.greedy and p.temperature != 1 for p in params]
    minp = [p.min_p > 0 and not p.greedy for p in params]
    topkp = [not p.greedy and (0 < p.top_k < V or p.top_p < 1) for p in params]
    edits = any(constrained) or bool(biased) or any(pen) or any(scaled) or any(minp) or any(topkp)
    x = raw.clone() if edits else raw  # the caller's logits are never written
    if any(constrained):
        _allow(x, rows, _rows(constrained, dev), errors)
    if biased:
        i, t, b = zip(*biased)
        x.index_put_((torch.tensor(i, device=dev), torch.tensor(t, device=dev)),
                     torch.tensor(b, dtype=x.dtype, device=dev), accumulate=True)
    if any(pen):
        _penalise(x, rows, _rows(pen, dev))
    failed = [e is not None for e in errors]
    if any(failed):
        x = x.clone() if x is raw else x
        x[_rows(failed, dev)] = 0.0
    # greedy rows keep x from here (argmax is invariant to temperature and the filters)
    if any(scaled):
        idx = _rows(scaled, dev)
        x[idx] = x[idx] / torch.tensor([params[i].temperature for i in idx.tolist()], device=dev)[:, None]
    if any(minp):
        idx = _rows(minp, dev)
        sub = x[idx]
        floor = sub.max(-1, keepdim=True).values + torch.tensor(
            [math.log(params[i].min_p) for i in idx.tolist()], device=dev)[:, None]
        x[idx] = sub.masked_fill(sub < floor, -math.inf)
    if any(topkp):
        idx = _rows(topkp, dev)
        x[idx] = _top_k_top_p(x[idx], [params[i] for i in idx.tolist()])
    return x


def _allow(x: torch.Tensor, rows: list[RowState], idx: torch.Tensor, errors: list[str | None]) -> None:
    """Structured outputs: tokens the grammar of rows ``idx`` does not allow go to -inf in place."""
    V = x.shape[1]
    bitmask = torch.zeros(len(idx), (V + 31) // 32, dtype=torch.int32)
    for j, i in enumerate(idx.tolist()):
        rows[i].grammar.fill_bitmask(bitmask, j)
    allowed = unpack_bitmask(bitmask.to(x.device), V)
    x[idx] = x[idx].masked_fill(~allowed, -math.inf)
    for i in idx[~allowed.any(-1)].tolist():
        errors[i] = errors[i] or "no token is allowed"


def _penalise(x: torch.Tensor, rows: list[RowState], idx: torch.Tensor) -> None:
    """Presence/frequency penalties over the output, repetition over prompt + output, in place."""
    V, dev = x.shape[1], x.device
    params = [rows[i].params for i in idx.tolist()]
    states = [rows[i]._penalty_state(V, dev) for i in idx.tolist()]
    counts = torch.stack([c for c, _ in states])
    seen = torch.stack([s for _, s in states])
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    sub = x[idx]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    x[idx] = sub - freq * counts - pres * (counts > 0)


def _draw(x: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """The tokens [B]: argmax for greedy rows; for the others inverse-CDF sampling, one uniform
    per row (from a seeded row's own generator): the first token whose cumulative probability
    exceeds u. One draw per row, not one per vocabulary entry: an Exp(1) draw over a 49k
    vocabulary cost more than a third of a batch-1 CPU decode step's non-matmul time."""
    B, dev = x.shape[0], x.device
    sampled = [not r.params.greedy for r in rows]
    if all(sampled):
        tokens = torch.empty(B, dtype=torch.long, device=dev)
    else:
        tokens = cpu_kernels.argmax(x)  # the greedy rows' tokens; the others are overwritten
    if any(sampled):
        idx = _rows(sampled, dev)
        probs = torch.softmax(x[idx].float(), -1)
        u = torch.rand(len(idx), device=dev)
        for j, i in enumerate(idx.tolist()):
            gen = rows[i]._gen(dev)
            if gen is not None:
                u[j] = torch.rand(1, generator=gen, device=dev)[0]
        cdf = probs.cumsum(-1)
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
        picked = picked.clamp_(max=probs.shape[1] - 1)
        # u * total rounding up to the total (or past a trailing run of filtered tokens): the
        # last token with mass instead, never one the filters removed
        bad = probs.gather(1, picked[:, None]).squeeze(1) == 0
        if bool(bad.any()):
            last = probs.shape[1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
            picked = torch.where(bad, last, picked)
        tokens[idx] = picked
    return tokens


def _logprobs(raw: torch.Tensor, x: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
              ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Per row that asked: the chosen token's logprob and the top k (of the raw logits, or of ``x``
    with logprobs_mode "processed"); None for the other rows."""
    B, dev = raw.shape[0], raw.device
    want = [p.logprobs is not None for p in params]
    lp_out: list[float | None] = [None] * B
    top_out: list[list[tuple[int, float]] | None] = [None] * B
    if not any(want):
        return lp_out, top_out
    idx = _rows(want, dev)
    processed = torch.tensor([params[i].logprobs_mode == "processed" for i in idx.tolist()], device=dev)
    source = torch.where(processed[:, None], x[idx], raw[idx])
    lp = torch.log_softmax(source, -1)
    chosen = lp.gather(1, tokens[idx][:, None]).squeeze(1).tolist()
    k = max(params[i].logprobs for i in idx.tolist())
    top_v, top_i = lp.topk(k, -1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(idx.tolist()):
        n = params[i].logprobs
        lp_out[i] = chosen[j]
        top_out[i] = list(zip(top_i[j][:n], top_v[j][:n]))
    return lp_out, top_out


def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep each row's top-k tokens and the smallest prefix (by probability) whose mass reaches
    top_p; at least one token always stays. Masses are summed in float64, so a top_p as small
    as 1e-300 keeps exactly the top token instead of rounding to an empty set."""
    V = x.shape[-1]
    srt, order = x.sort(-1, descending=True)
    k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=x.device)
    pos = torch.arange(V, device=x.device)
    drop = pos[None, :] >= k[:, None]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=x.device)
    probs = torch.softmax(srt.masked_fill(drop, -math.inf).double(), -1)
    before = probs.cumsum(-1) - probs  # mass of the better tokens
    drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    return torch.full_like(x, -math.inf).scatter(-1, order, srt.masked_fill(drop, -math.inf))


def find_stop(text: str, stops: list[str], start: int) -> int:
    """Index in text of the earliest stop string that ends after ``start``, or -1."""
    hits = [text.find(s, max(0, start - len(s) + 1)) for s in stops]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else -1


def holdback(stops: list[str]) -> int:
    """Characters to hold back while streaming: a stop string may still be completing."""
    return max((len(s) - 1 for s in stops), default=0)
