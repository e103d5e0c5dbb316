"""The scheduler and the engine's failure isolation, without a model: a fake runner whose "model"
is a pure function of the tokens written into each cache slot and of the masks they were written
under, so a chunk run at the wrong position, in the wrong slot, twice, or after a prefix cached
under another mask changes the output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from server import engine as engine_module
from server.engine import LLMEngine, RequestFailed
from server.request import Request
from server.sampling import SamplingParams
from server.scheduler import IDLE_CHUNK, MIN_CHUNK, SHORT_PROMPT, STALL, Scheduler, StepCost

VOCAB = 49152  # the real tokenizer's, so the engine can detokenise
BLOCKS = 8


class FakeRunner:
    def __init__(self, max_batch: int = 4, max_len: int = 512, packs_rows: bool = False):
        self.cache = SimpleNamespace(max_batch=max_batch)
        self.packs_rows = packs_rows  # decode rows and prefill chunks in one call
        self.max_len, self.num_blocks, self.device = max_len, BLOCKS, "cpu"
        self.config = SimpleNamespace(eos_token_id=2)
        self.kv: dict[int, list[int]] = {}
        self.calls: list[dict] = []
        self.poison: set[int] = set()  # a chunk holding one of these tokens raises
        self.nan: set[int] = set()  # ... gives non-finite logits for its row
        self.loads: list[int] = []  # slots a saved prefix was written into

    def extend(self, chunks, starts, masks, slots):
        self.calls.append({"lengths": [len(c) for c in chunks], "starts": list(starts), "slots": list(slots)})
        if any(t in self.poison for c in chunks for t in c):
            raise RuntimeError("poisoned token")
        logits = torch.zeros(len(chunks), VOCAB)
        for i, (chunk, start, slot) in enumerate(zip(chunks, starts, slots)):
            cached = self.kv.setdefault(slot, [])
            assert start <= len(cached), "a chunk must continue what its slot holds"
            key = int("".join("1" if b else "0" for b in masks[i].tolist()), 2)  # the mask it is computed under
            self.kv[slot] = cached[:start] + [(t, key) for t in chunk]
            seq = self.kv[slot]
            # depends on every token, its position and its mask
            nxt = 100 + (sum((j + 1) * t + 7 * k for j, (t, k) in enumerate(seq)) % 1000)
            logits[i, nxt] = 10.0
            if any(t in self.nan for t in chunk):
                logits[i, 0] = float("nan")
        return logits

    def prefill(self, prompts, masks, slots):
        return self.extend(prompts, [0] * len(prompts), masks, slots)

    def copy_slot(self, src, dsts, length):
        for dst in dsts:
            self.kv[dst] = list(self.kv[src][:length])

    def save_prefix(self, slot, length):
        return list(self.kv[slot][:length])

    def load_prefix(self, saved, slot):
        self.loads.append(slot)
        self.kv[slot] = saved + self.kv.get(slot, [])[len(saved):]


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny.tokenizer


def make(n_prompt: int, max_tokens: int = 6, first: int = 1000, ids: list[int] | None = None,
         mask: torch.Tensor | None = None, **params) -> Request:
    ids = ids if ids is not None else [first + i for i in range(n_prompt)]
    mask = mask if mask is not None else torch.ones(BLOCKS, dtype=torch.bool)
    return Request(ids, mask, SamplingParams(max_tokens=max_tokens, temperature=0, **params))


def alone(tokenizer, req: Request) -> list[int]:
    eng = LLMEngine(FakeRunner(), tokenizer)
    return eng.generate([make(0, req.params.max_tokens, ids=list(req.prompt_ids), mask=req.mask)])[0].output_ids


def test_budget_is_kept_and_long_prompts_are_chunked(tokenizer):
    runner = FakeRunner(max_batch=4)
    eng = LLMEngine(runner, tokenizer, max_num_batched_tokens=16)
    eng.scheduler.idle_budget = 16  # the budget holds even when nothing decodes
    reqs = [make(5, first=1000), make(40, first=2000), make(3, first=3000), make(33, first=4000)]
    eng.generate(reqs)
    # per step: the decode call and the prefill call together stay within 16 (prefill padded)
    steps, i = [], 0
    while i < len(runner.calls):
        call = runner.calls[i]
        if set(call["lengths"]) == {1} and i + 1 < len(runner.calls) and max(runner.calls[i + 1]["lengths"]) > 1:
            steps.append(len(call["lengths"]) + len(runner.calls[i + 1]["lengths"]) * max(runner.calls[i + 1]["lengths"]))
            i += 2
        else:
            steps.append(len(call["lengths"]) * max(call["lengths"]))
            i += 1
    assert max(steps) <= 16
    assert max(max(c["lengths"]) for c in runner.calls) < 40  # the 40-token prompt went in chunks
    for req in reqs:
        assert req.output_ids == alone(tokenizer, req) and req.finish_reason == "length"


def test_running_streams_decode_in_every_step_while_a_long_prompt_prefills(tokenizer):
    runner = FakeRunner(max_batch=4)
    eng = LLMEngine(runner, tokenizer, max_num_batched_tokens=8)
    streams = [make(3, max_tokens=60, first=1000), make(3, max_tokens=60, first=1100)]
    for r in streams:
        eng.add(r)
    eng.step()  # both prefilled
    long = make(100, first=5000)
    eng.add(long)
    before = [len(r.output_ids) for r in streams]
    steps = 0
    while long.prefilling or not long.output_ids:
        eng.step()
        steps += 1
        assert [len(r.output_ids) for r in streams] == [b + steps for b in before]  # one token per step each
    assert steps >= 100 // 6  # 8 tokens a step minus the 2 decode rows
    eng.generate([])
    assert long.output_ids == alone(tokenizer, long)


def test_a_runner_that_packs_rows_gets_decode_rows_and_prefill_chunks_in_one_call(tokenizer):
    runner = FakeRunner(max_batch=4, packs_rows=True)
    eng = LLMEngine(runner, tokenizer, max_num_batched_tokens=8)
    streams = [make(3, max_tokens=40, first=1000), make(3, max_tokens=40, first=1100)]
    for r in streams:
        eng.add(r)
    eng.step()
    long = make(30, first=5000)
    eng.add(long)
    while long.prefilling or not long.output_ids:
        before = len(runner.calls)
        eng.step()
        assert len(runner.calls) == before + 1  # one forward per step
        assert runner.calls[-1]["lengths"][:2] == [1, 1] and len(runner.calls[-1]["lengths"]) == 3  # streams + chunk
    eng.generate([])
    for req in streams + [long]:
        assert req.output_ids == alone(tokenizer, req)


def test_with_nothing_decoding_a_long_prompt_goes_in_one_step(tokenizer):
    runner = FakeRunner(max_batch=2)
    eng = LLMEngine(runner, tokenizer, max_num_batched_tokens=8)
    eng.add(make(100))
    eng.step()
    assert runner.calls[0]["lengths"] == [100]


def test_the_measured_cost_sizes_chunks_by_the_decode_time(tiny):
    from server.runner import BlockRunner

    eng = LLMEngine(BlockRunner(tiny.model, max_batch=4, max_len=256), tiny.tokenizer)
    assert eng.scheduler.cost is None and eng.scheduler.prefill_budget(2) == 254  # offline: no budget unless asked
    cost = eng.measure_cost()
    assert cost.per_token_s > 0 and cost.decode_s + cost.per_row_s > 0
    eng.scheduler.cost = cost
    assert MIN_CHUNK <= eng.scheduler.prefill_budget(1) <= eng.scheduler.prefill_budget(4)
    assert eng.scheduler.prefill_budget(0) == IDLE_CHUNK
    assert eng.generate([make(30, max_tokens=3)])[0].finish_reason == "length"


def test_a_step_that_prefills_stays_within_its_share_of_the_decode_time():
    """The chunk beside r decoding rows costs at most STALL x their decode time (beyond the
    minimum chunk), so an inter-token gap with a prefill in it is bounded by (1 + STALL) x one
    without, at every batch size."""
    cost = StepCost(decode_s=0.020, per_row_s=0.006, chunk_s=0.015, per_token_s=0.0035)
    for rows in range(1, 17):
        tokens = cost.prefill_tokens(rows)
        decode = cost.decode_s + cost.per_row_s * rows
        chunk = cost.chunk_s + cost.per_token_s * tokens
        assert tokens == MIN_CHUNK or chunk <= STALL * decode + 1e-9
        assert cost.chunk_s + cost.per_token_s * (tokens + 1) > STALL * decode  # and no smaller than it needs
    sched = Scheduler(max_batch=4, max_num_batched_tokens=512)
    sched.cost = cost
    streams = [make(2) for _ in range(2)]
    for r in streams:
        sched.add(r)
    for c in sched.schedule().prefill:
        c.request.num_computed = c.start + c.length
    sched.add(make(300))
    step = sched.schedule()
    assert step.decode == streams and sum(c.length for c in step.prefill) == cost.prefill_tokens(2)


def test_choices_of_one_prompt_wait_for_its_chunked_prefill_then_copy_it(tokenizer):
    """n = 3 over a prompt prefilled in chunks: the other choices stay queued (a request behind
    them is admitted meanwhile), then take a copy of the prompt's cache and decode from it (the
    fake runner's logits depend on every cached token, so a wrong copy changes the output)."""
    runner = FakeRunner(max_batch=4)
    eng = LLMEngine(runner, tokenizer, max_num_batched_tokens=16)
    eng.scheduler.idle_budget = 16
    lead = make(40, first=2000)
    choices = [lead] + [make(40, first=2000) for _ in range(2)]
    for choice in choices[1:]:
        choice.shares_prefill_of = lead
    other = make(3, first=1000)
    for req in choices + [other]:
        eng.add(req)
    eng.step()
    assert lead.prefilling and all(c.slot is None and c.held for c in choices[1:])
    while lead.prefilling:
        assert all(c.slot is None for c in choices[1:])
        eng.step()
    assert other.slot is not None  # admitted past the held choices
    assert all(c.slot is not None and not c.prefilling and len(c.output_ids) == 1 for c in choices[1:])
    eng.generate([])
    assert [c.num_shared for c in choices] == [0, 40, 40]
    prefill_rows = sum(1 for call in runner.calls for n in call["lengths"] if n > 1)
    assert prefill_rows == 3 + 1  # 40 tokens in 16-token chunks, and the other prompt
    for req in choices + [other]:
        assert req.output_ids == alone(tokenizer, req) and req.finish_reason == "length"


def test_a_short_prompt_goes_in_whole_ahead_of_a_long_one():
    """With a step cost, a chat-sized prompt is not chunked behind a long prompt: it is admitted
    whole in the next step while the long one keeps its small chunks."""
    sched = Scheduler(max_batch=4, max_num_batched_tokens=512)
    sched.cost = StepCost(decode_s=0.020, per_row_s=0.006, chunk_s=0.0, per_token_s=0.0035)
    stream = make(2)
    sched.add(stream)
    for c in sched.schedule().prefill:
        c.request.num_computed = c.start + c.length
    long, short = make(400), make(SHORT_PROMPT)
    sched.add(long)
    sched.add(short)
    step = sched.schedule()
    assert step.decode == [stream] and step.admitted == [short]
    assert [(c.request, c.length) for c in step.prefill] == [(short, SHORT_PROMPT)]
    for c in step.prefill:
        c.request.num_computed = c.start + c.length
    step = sched.schedule()
    assert step.admitted == [long] and step.prefill[0].length == sched.cost.prefill_tokens(2)
    too_long = make(SHORT_PROMPT + 1)
    sched.add(too_long)
    step = sched.schedule()  # the long prompt's chunk first; the other is not short and waits
    assert [c.request for c in step.prefill] == [long] and too_long in sched.waiting


def test_decode_rows_run_in_slot_order(tokenizer):
    runner = FakeRunner(max_batch=4)
    eng = LLMEngine(runner, tokenizer)
    reqs = [make(3, max_tokens=m, first=1000 + 10 * m) for m in (2, 9, 9, 9)]
    eng.generate(reqs[:3])
    eng.add(reqs[3])  # takes the lowest free slot
    eng.generate([])
    decode_slots = [c["slots"] for c in runner.calls if set(c["lengths"]) == {1}]
    assert all(s == sorted(s) for s in decode_slots)


def test_scheduler_admits_only_into_free_slots():
    sched = Scheduler(max_batch=2, max_num_batched_tokens=64)
    reqs = [make(4), make(4), make(4)]
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    assert first.admitted == reqs[:2] and [r.slot for r in reqs[:2]] == [0, 1] and list(sched.waiting) == reqs[2:]
    sched.remove(reqs[0])
    for c in first.prefill:
        c.request.num_computed = c.start + c.length
    second = sched.schedule()
    assert second.admitted == [reqs[2]] and reqs[2].slot == 0 and second.decode == [reqs[1]]
    with pytest.raises(ValueError, match="at least max_batch"):
        Scheduler(max_batch=4, max_num_batched_tokens=3)


def test_requests_compare_by_identity(tokenizer):
    """Two requests with the same prompt are two requests: aborting one never touches the other
    (a default dataclass __eq__ compared their mask tensors and raised)."""
    eng = LLMEngine(FakeRunner(), tokenizer)
    a = make(4, max_tokens=8)
    b = make(4, max_tokens=8)
    b.mask = torch.tensor([True, False] * (BLOCKS // 2))
    eng.add(a)
    eng.add(b)
    eng.step()
    eng.abort(b)
    assert eng.running == [a]
    eng.generate([])
    assert a.finish_reason == "length" and b.finish_reason == "abort"


def test_a_forward_that_fails_fails_only_its_request(tokenizer):
    runner = FakeRunner()
    runner.poison = {7777}
    eng = LLMEngine(runner, tokenizer)
    good = [make(4, first=1000), make(4, first=2000)]
    bad = Request([7777, 1, 2], torch.ones(BLOCKS, dtype=torch.bool), SamplingParams(max_tokens=4, temperature=0))
    eng.generate([good[0], bad, good[1]])
    assert bad.finish_reason == "error" and isinstance(bad.error, RequestFailed) and "forward" in str(bad.error)
    for r in good:
        assert r.finish_reason == "length" and r.output_ids == alone(tokenizer, r)
    assert not eng.running and len(eng.scheduler.free_slots) == 4


def test_non_finite_logits_fail_only_their_row(tokenizer):
    runner = FakeRunner()
    runner.nan = {8888}
    eng = LLMEngine(runner, tokenizer)
    good = make(4, first=1000)
    bad = Request([8888, 1], torch.ones(BLOCKS, dtype=torch.bool), SamplingParams(max_tokens=4, temperature=0))
    eng.generate([bad, good])
    assert bad.finish_reason == "error" and "non-finite" in str(bad.error)
    assert good.output_ids == alone(tokenizer, good)


def test_sampling_and_detokenising_failures_fail_only_their_row(tokenizer, monkeypatch):
    real_sample = engine_module.sample

    def sample(logits, rows):
        if any(r.params.seed == 666 for r in rows):
            raise RuntimeError("sampler bug")
        return real_sample(logits, rows)

    monkeypatch.setattr(engine_module, "sample", sample)
    eng = LLMEngine(FakeRunner(), tokenizer)
    good = make(4, first=1000)
    bad_sample = make(4, first=2000, seed=666)
    bad_text = make(4, first=3000)
    eng.add(bad_text)
    bad_text.detokenizer.add = lambda tok: 1 / 0
    eng.generate([good, bad_sample])
    assert bad_sample.finish_reason == "error" and "sampling" in str(bad_sample.error)
    assert bad_text.finish_reason == "error" and "detokenising" in str(bad_text.error)
    assert good.output_ids == alone(tokenizer, good)


class _Allow:
    """A grammar stand-in that allows a fixed set of tokens (ids below 31: one int32 bit each)."""

    def __init__(self, allowed: set[int]):
        self.allowed = allowed

    def fill_bitmask(self, bitmask, index):
        for t in self.allowed:
            bitmask[index, t // 32] |= 1 << (t % 32)

    def accept_token(self, token):
        return token in self.allowed

    def is_terminated(self):
        return False


def test_grammars_constrain_their_rows_and_a_row_with_no_allowed_token_fails_alone(tokenizer):
    eng = LLMEngine(FakeRunner(), tokenizer)
    good, boxed, empty = make(4, first=1000), make(4, first=2000), make(4, first=3000)
    for req in (good, boxed, empty):
        eng.add(req)
    boxed.sampling.grammar = _Allow({7, 20})
    empty.sampling.grammar = _Allow(set())
    while eng.has_work():
        eng.step()
    assert empty.finish_reason == "error" and "no token is allowed" in str(empty.error)
    assert boxed.finish_reason == "length" and set(boxed.output_ids) <= {7, 20}
    assert good.output_ids == alone(tokenizer, good)


def test_a_routing_failure_fails_only_the_requests_being_routed(tokenizer):
    class BrokenRouter:
        masks = {}

        def route(self, texts):
            raise RuntimeError("encoder exploded")

    eng = LLMEngine(FakeRunner(), tokenizer, router=BrokenRouter())
    forced = make(4, max_tokens=5)
    eng.add(forced)
    eng.step()
    routed = Request([5, 6], None, SamplingParams(max_tokens=3), mask_id=None, routing_text="hello")
    eng.add(routed)
    eng.generate([])
    assert routed.finish_reason == "error" and "routing" in str(routed.error)
    assert forced.finish_reason == "length" and len(forced.output_ids) == 5


def test_chunked_prefill_on_a_real_runner_equals_one_shot(tiny):
    """The tiny Llama: prompts prefilled in 5-token chunks beside decoding rows, under different
    masks, give the same greedy tokens as each prefilled at once."""
    from server.runner import BlockRunner

    masks = [torch.ones(BLOCKS, dtype=torch.bool), torch.tensor([True, False] * 4), torch.tensor([False, True] * 4)]

    def run(budget: int) -> list[list[int]]:
        runner = BlockRunner(tiny.model, max_batch=3, max_len=256)
        eng = LLMEngine(runner, tiny.tokenizer, max_num_batched_tokens=budget)
        reqs = [Request([1000 + 7 * i + j for j in range(n)], mask, SamplingParams(max_tokens=8, temperature=0,
                                                                                   ignore_eos=True))
                for i, (n, mask) in enumerate(zip((23, 4, 31), masks))]
        eng.generate(reqs)
        return [r.output_ids for r in reqs]

    assert run(budget=5) == run(budget=256)


SKIP_TWO = torch.tensor([True, False, True, True, False, True, True, True])


def test_a_prompt_that_continues_a_finished_one_skips_the_prefix_its_slot_holds(tokenizer):
    """A chat's next turn (the previous prompt, its answer, new tokens) and a repeated prompt
    prefill only what their slot does not hold under the same mask; the outputs equal runs in a
    fresh engine (the fake runner's logits depend on every cached token, position and mask)."""
    runner = FakeRunner(max_batch=4)
    eng = LLMEngine(runner, tokenizer)
    first = eng.generate([make(20, first=1000)])[0]
    held = first.prompt_ids + first.output_ids[:-1]  # the last sampled token was never fed
    turn = make(0, ids=first.prompt_ids + first.output_ids + [5000 + i for i in range(7)])
    runner.calls.clear()
    eng.generate([turn])
    assert turn.num_cached == len(held) and turn.slot == first.slot
    assert runner.calls[0]["starts"] == [len(held)] and runner.calls[0]["lengths"] == [len(turn.prompt_ids) - len(held)]
    assert turn.output_ids == alone(tokenizer, turn)
    again = make(0, ids=list(turn.prompt_ids))
    eng.generate([again])
    assert again.num_cached == len(turn.prompt_ids) - 1  # the last prompt token runs again for its logits
    assert again.output_ids == turn.output_ids


def test_a_prefix_cached_under_another_mask_is_not_reused_and_survives(tokenizer):
    """Same prompt, another mask: no reuse (its K/V differ), and the new request takes another free
    slot, so the dense prefix is still there for the next dense request."""
    runner = FakeRunner(max_batch=4)
    eng = LLMEngine(runner, tokenizer)
    dense = eng.generate([make(20, first=1000)])[0]
    masked = eng.generate([make(20, first=1000, mask=SKIP_TWO)])[0]
    assert masked.num_cached == 0 and masked.slot != dense.slot
    assert masked.output_ids == alone(tokenizer, masked) != dense.output_ids
    dense2 = eng.generate([make(20, first=1000)])[0]
    assert dense2.num_cached == 19 and dense2.slot == dense.slot and dense2.output_ids == dense.output_ids
    off = LLMEngine(FakeRunner(max_batch=4), tokenizer, prefix_cache=False)
    reqs = off.generate([make(20, first=1000), make(20, first=1000)])
    assert [r.num_cached for r in reqs] == [0, 0] and reqs[0].output_ids == reqs[1].output_ids


def test_a_failed_request_leaves_no_prefix_and_scored_prompts_prefill_whole(tokenizer):
    """A request that failed may have failed in its K/V: its slot holds nothing reusable. A request
    that scores its prompt (echo/logprobs) needs every position's logits, so it reuses nothing."""
    runner = FakeRunner(max_batch=2)
    eng = LLMEngine(runner, tokenizer)
    runner.nan.add(1019)
    bad = eng.generate([make(20, first=1000)])[0]
    assert bad.finish_reason == "error"
    runner.nan.clear()
    ok = eng.generate([make(20, first=1000)])[0]
    assert ok.num_cached == 0 and ok.output_ids == alone(tokenizer, ok)
    scored, plain = make(20, first=1000), make(20, first=1000)
    scored.prompt_logprobs = 0
    for req in (scored, plain):
        eng.scheduler.add(req)
        assert eng.scheduler.schedule().admitted == [req]
        hit = eng.scheduler.bind_prefix(req)
        assert hit == (0 if req is scored else 19)  # scored: moved to the empty slot, the prefix kept
        assert req.slot == (1 if req is scored else ok.slot)
        req.finish_reason = "abort"
        eng.scheduler.remove(req)  # nothing computed: the slot keeps what it held


def test_warmed_prefixes_serve_the_first_request_of_each_mask(tokenizer):
    """The shared start of chat prompts, warmed at start-up under dense and every mask the router
    may pick (one free slot per distinct mask), is reused by the first request of each mask; the outputs equal
    those of an engine that prefilled them whole. A mask the router cannot pick is not warmed."""
    prefix = [900 + i for i in range(12)]
    router = SimpleNamespace(masks={"skip": SKIP_TWO, "same": SKIP_TWO.clone(), "never": ~SKIP_TWO},
                             mask_ids_at=lambda: ["skip", "same"])
    eng = LLMEngine(FakeRunner(max_batch=4), tokenizer, router=router, shared_prefix=prefix)
    assert eng.warm_prefixes(prefix) == 2  # dense and SKIP_TWO once: equal bits share a slot
    assert sorted(len(p.tokens) for p in eng.scheduler.prefixes.values()) == [12, 12]
    reqs = [make(0, ids=prefix + [1000 + i], mask=mask) for i, mask in enumerate((None, SKIP_TWO, ~SKIP_TWO))]
    for req in reqs:
        eng.generate([req])
        assert req.output_ids == alone(tokenizer, req)
    assert [r.num_cached for r in reqs] == [12, 12, 0]
    assert LLMEngine(FakeRunner(), tokenizer, prefix_cache=False, shared_prefix=prefix).shared_prefix is None
    full = LLMEngine(FakeRunner(max_batch=1), tokenizer, router=router)
    assert full.warm_prefixes(prefix) == 1 and full.warm_prefixes(prefix) == 0  # no free slot left holds nothing


def test_the_shared_prefix_is_copied_in_when_no_free_slot_holds_it_under_the_mask(tokenizer):
    """With every slot busy or holding other masks' K/V, a request still skips the shared prefix:
    its K/V under the request's mask, kept once that mask first computed it, are copied into the
    request's slot. Outputs equal a fresh engine's; a prompt that does not start with the prefix
    and a mask never computed copy nothing."""
    prefix = [900 + i for i in range(12)]
    runner = FakeRunner(max_batch=2)
    eng = LLMEngine(runner, tokenizer, shared_prefix=prefix)
    first = make(0, ids=prefix + [1000], mask=SKIP_TWO, max_tokens=3)
    eng.generate([first])  # computes the prefix under SKIP_TWO; its slot then holds it
    assert first.num_cached == 0 and runner.loads == []
    # both slots taken by dense streams: the next SKIP_TWO request finds no free slot holding its prefix
    streams = [make(0, ids=prefix + [2000 + i], max_tokens=30) for i in range(2)]
    for r in streams:
        eng.add(r)
    eng.step()
    late = [make(0, ids=prefix + [3000, 3001], mask=SKIP_TWO), make(0, ids=[5] + prefix, mask=SKIP_TWO),
            make(0, ids=prefix + [3100], mask=~SKIP_TWO)]
    eng.generate(late)
    assert [r.num_cached for r in late] == [12, 0, 0]
    assert len(runner.loads) == 1
    for req in streams + late:
        assert req.output_ids == alone(tokenizer, req)


def test_shared_chat_prefix_starts_every_rendered_chat(tiny):
    from server.loading import shared_chat_prefix

    prefix = shared_chat_prefix(tiny.tokenizer)
    assert prefix and len(prefix) > 3
    for text in ("Hello", "What is 2 + 2?", "def f(x): return x", "Écris un poème."):
        rendered = tiny.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        ids = tiny.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert ids[: len(prefix)] == prefix and len(ids) > len(prefix)


def test_prefix_reuse_on_a_real_runner_equals_prefilling_again(tiny):
    """The tiny Llama, dense and masked: the next turn of a chat (prompt, answer, new tokens),
    prefilled after the K/V its slot kept, gives the greedy tokens of an engine without the cache."""
    from server.runner import BlockRunner

    def run(prefix_cache: bool) -> tuple[list[list[int]], list[int]]:
        eng = LLMEngine(BlockRunner(tiny.model, max_batch=2, max_len=256), tiny.tokenizer,
                        prefix_cache=prefix_cache)
        outs, cached = [], []
        for mask in (torch.ones(BLOCKS, dtype=torch.bool), SKIP_TWO):
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            first = eng.generate([Request([1000 + 3 * j for j in range(19)], mask, params)])[0]
            turn = Request(first.prompt_ids + first.output_ids + [2000 + j for j in range(5)], mask, params)
            eng.generate([turn])
            outs += [first.output_ids, turn.output_ids]
            cached.append(turn.num_cached)
        return outs, cached

    (with_cache, cached), (without, none) = run(True), run(False)
    assert cached == [19 + 7, 19 + 7] and none == [0, 0]
    assert with_cache == without
