"""The batched sampler against per-row reference implementations in float64."""

from __future__ import annotations

import math

import pytest
import torch

from server.sampling import (MAX_LOGPROBS, RowState, SamplingParams, find_stop, holdback, sample,
                             unpack_bitmask)

V = 64


def reference_logprobs(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                       allowed: set[int] | None = None) -> torch.Tensor:
    """One row, float64, token by token: the log-probabilities the token is drawn from."""
    x = logits.double().tolist()
    if allowed is not None:
        x = [v if t in allowed else -math.inf for t, v in enumerate(x)]
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in range(len(x)):
        count = output.count(t)
        if t in prompt or count:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if not p.greedy:
        x = [v / p.temperature for v in x]
        if p.min_p > 0:
            top = max(x)
            x = [v if v >= top + math.log(p.min_p) else -math.inf for v in x]
        order = sorted(range(len(x)), key=lambda t: -x[t])
        if 0 < p.top_k < len(x):
            for t in order[p.top_k:]:
                x[t] = -math.inf
        if p.top_p < 1:
            z = max(x)
            probs = [math.exp(v - z) for v in x]
            total = sum(probs)
            mass = 0.0
            for t in order:
                if mass >= p.top_p * total and t != order[0]:
                    x[t] = -math.inf
                mass += probs[t]
    return torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1)


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(temperature=1.0, repetition_penalty=1.7),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=-0.7, logit_bias={3: 5.0, 9: -100.0}),
    SamplingParams(temperature=0.5, logit_bias={1: 2.5}, presence_penalty=-1.0, top_k=3),
]


def _rows(params, prompts, outputs):
    rows = []
    for p, prompt, out in zip(params, prompts, outputs):
        row = RowState(p, prompt)
        for t in out:
            row.append(t)
        rows.append(row)
    return rows


def test_processed_logprobs_equal_the_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAMS), V, generator=g) * 3
    prompts = [torch.randint(V, (6,), generator=g).tolist() for _ in PARAMS]
    outputs = [torch.randint(8, (6,), generator=g).tolist() for _ in PARAMS]  # with repeats
    params = [SamplingParams(**{**vars(p), "logprobs": MAX_LOGPROBS, "logprobs_mode": "processed"}) for p in PARAMS]
    rows = _rows(params, prompts, outputs)
    out = sample(logits, rows)
    assert out.errors == [None] * len(PARAMS)
    for i, p in enumerate(params):
        ref = reference_logprobs(logits[i], p, prompts[i], outputs[i])
        tok = out.tokens[i]
        assert math.isfinite(ref[tok]), (i, tok)  # drawn from the row's support
        assert out.logprobs[i] == pytest.approx(float(ref[tok]), abs=1e-4)
        kept = int(torch.isfinite(ref).sum())
        top = out.top_logprobs[i]
        assert len(top) == MAX_LOGPROBS
        ref_top = ref.topk(min(kept, MAX_LOGPROBS))
        assert [t for t, _ in top[:len(ref_top.indices)]] == ref_top.indices.tolist()
        assert [v for _, v in top[:kept]] == pytest.approx(ref_top.values.tolist(), abs=1e-4)
        if p.greedy:
            assert tok == int(ref.argmax())
    # the filters bite: each non-greedy filtered row keeps fewer tokens than the vocabulary
    assert all(int(torch.isfinite(reference_logprobs(logits[i], p, prompts[i], outputs[i])).sum()) < V
               for i, p in enumerate(params) if p.top_k or p.top_p < 1 or p.min_p)


def test_raw_logprobs_are_the_model_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.5, top_k=2, logprobs=4, repetition_penalty=2.0),
              SamplingParams(temperature=0, logprobs=0, logit_bias={7: 50.0}),
              SamplingParams(temperature=1.0)]
    out = sample(logits, [RowState(p, [1, 2, 3]) for p in params])
    ref = torch.log_softmax(logits.float(), -1)
    assert out.logprobs[0] == pytest.approx(float(ref[0, out.tokens[0]]), abs=1e-5)
    top = ref[0].topk(4)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.tokens[1] == 7 and out.top_logprobs[1] == []
    assert out.logprobs[1] == pytest.approx(float(ref[1, 7]), abs=1e-5)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None


def test_draws_follow_the_processed_distribution():
    """Many rows with the same parameters: token frequencies within 5 sigma of the reference."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(8, generator=g) * 1.5
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, presence_penalty=0.8)
    n = 20000
    torch.manual_seed(3)
    out = sample(base.expand(n, 8).contiguous(), _rows([p] * n, [[0]] * n, [[1, 1]] * n))
    freq = torch.bincount(torch.tensor(out.tokens), minlength=8).double() / n
    ref = reference_logprobs(base, p, [0], [1, 1]).exp()
    sigma = (ref * (1 - ref) / n).sqrt()
    assert ((freq - ref).abs() <= 5 * sigma + 1e-12).all(), (freq, ref)
    assert int((ref > 0).sum()) < 8  # some token is filtered out, and never drawn
    assert (freq[ref == 0] == 0).all()


def _generate(rows_fn, logits_seq, watch: int) -> list[int]:
    rows = rows_fn()
    tokens = []
    for logits in logits_seq:
        out = sample(logits[: len(rows)], rows)
        for row, t in zip(rows, out.tokens):
            row.append(t)
        tokens.append(out.tokens[watch])
    return tokens


def test_seeded_rows_are_reproducible_and_independent_of_their_neighbours():
    g = torch.Generator().manual_seed(4)
    steps = [torch.randn(4, V, generator=g) for _ in range(12)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, presence_penalty=0.5)
    alone = _generate(lambda: [RowState(seeded, [5])], [s[2:3] for s in steps], 0)
    again = _generate(lambda: [RowState(seeded, [5])], [s[2:3] for s in steps], 0)
    others = [SamplingParams(temperature=1.2), SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=0)]
    batched = _generate(lambda: [RowState(others[0]), RowState(others[1]), RowState(seeded, [5]),
                                 RowState(others[2])], steps, 2)
    assert alone == again == batched
    other_seed = _generate(lambda: [RowState(SamplingParams(**{**vars(seeded), "seed": 1235}), [5])],
                           [s[2:3] for s in steps], 0)
    assert other_seed != alone


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6, 0.0])
def test_tiny_temperatures_are_greedy(temperature):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 10
    out = sample(logits, [RowState(SamplingParams(temperature=temperature, logprobs=1)) for _ in range(3)])
    assert out.errors == [None] * 3 and out.tokens == logits.argmax(-1).tolist()
    assert all(math.isfinite(v) for v in out.logprobs)


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-8])
def test_tiny_top_p_keeps_the_top_token(top_p):
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(6))
    out = sample(logits, [RowState(SamplingParams(temperature=1.0, top_p=top_p)) for _ in range(64)])
    assert out.errors == [None] * 64 and out.tokens == logits.argmax(-1).tolist()


def test_a_row_with_non_finite_logits_fails_alone():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, V, generator=g)
    logits[1, 3] = float("nan")
    logits[2, 5] = float("inf")
    params = [SamplingParams(temperature=0, logprobs=2)] * 4
    out = sample(logits, [RowState(p) for p in params])
    assert out.errors[0] is None and out.errors[3] is None
    assert "non-finite" in out.errors[1] and "non-finite" in out.errors[2]
    assert out.tokens[1] == out.tokens[2] == -1 and out.logprobs[1] is None
    clean = sample(logits[[0, 3]], [RowState(p) for p in params[:2]])
    assert [out.tokens[0], out.tokens[3]] == clean.tokens
    assert [out.logprobs[0], out.logprobs[3]] == clean.logprobs


class FixedGrammar:
    def __init__(self, allowed: set[int]):
        self.allowed, self.accepted = allowed, []

    def fill_bitmask(self, bitmask, index):
        for t in self.allowed:
            bitmask[index, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)

    def accept_token(self, token):
        self.accepted.append(token)
        return token in self.allowed


def test_allowed_token_bitmask_applies_per_row():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(8))
    allowed = {0, 31, 33, 63}  # both halves of a word, and the sign bit
    grammar = FixedGrammar(allowed)
    params = SamplingParams(temperature=1.0, logprobs=5, logprobs_mode="processed")
    for _ in range(20):
        rows = [RowState(SamplingParams(temperature=0)), RowState(params, grammar=grammar),
                RowState(SamplingParams(temperature=0))]
        out = sample(logits, rows)
        assert out.tokens[1] in allowed
        assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[2] == int(logits[2].argmax())
        assert {t for t, v in out.top_logprobs[1] if v > -math.inf} == allowed
        ref = reference_logprobs(logits[1], params, [], [], allowed)
        assert out.logprobs[1] == pytest.approx(float(ref[out.tokens[1]]), abs=1e-5)
        assert rows[1].append(out.tokens[1]) is None
    assert "response format" in RowState(params, grammar=FixedGrammar(set())).append(5)
    nothing = sample(logits[:1], [RowState(params, grammar=FixedGrammar(set()))])
    assert nothing.errors == ["no token is allowed"]


def test_unpack_bitmask_matches_bit_by_bit():
    g = torch.Generator().manual_seed(9)
    words = torch.randint(-(2**31), 2**31, (2, 3), generator=g, dtype=torch.int64).to(torch.int32)
    got = unpack_bitmask(words, 70)
    for r in range(2):
        for t in range(70):
            assert bool(got[r, t]) == bool((int(words[r, t // 32]) >> (t % 32)) & 1)


def test_penalty_counts_are_kept_incrementally():
    """A row sampled before and after appends uses the same counts as one built from the history."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(10))
    p = SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=MAX_LOGPROBS, logprobs_mode="processed")
    live = RowState(p, [4, 5])
    history = []
    for _ in range(6):
        out = sample(logits, [live])
        fresh = sample(logits, _rows([p], [[4, 5]], [history]))
        assert out.tokens == fresh.tokens and out.top_logprobs == fresh.top_logprobs
        live.append(out.tokens[0])
        history.append(out.tokens[0])
    assert len(set(history)) > 1  # the penalty moved greedy decoding off its first token


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", math.nan), ("top_p", 0.0),
                                         ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 3.0),
                                         ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
                                         ("logit_bias", {V: 1.0}), ("logit_bias", {1: 101.0}),
                                         ("logprobs", MAX_LOGPROBS + 1), ("seed", 2**64)])
def test_verify_names_the_bad_field(field, value):
    SamplingParams().verify(V)
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).verify(V)


def test_stop_helpers():
    assert find_stop("hello world", ["wor", "lo"], 0) == 3
    assert find_stop("hello world", ["xyz"], 0) == -1
    assert holdback(["abc", "z"]) == 2 and holdback([]) == 0
