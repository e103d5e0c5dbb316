"""Load-adaptive depth: the policy alone, in the engine with the fake runner (no model), and through
the API of a tiny-model server with a two-budget bank."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import TINY_BANK_TEXTS, metric_value
from test_scheduler import BLOCKS, FakeRunner

from masks.bank import MaskBank
from router.router import Route
from server.depth import AdaptiveDepth
from server.engine import LLMEngine
from server.request import Request
from server.sampling import SamplingParams


def test_policy_engages_at_the_threshold_and_releases_below_half_of_it():
    depth = AdaptiveDepth([0.1, 0.125, 0.25], default=0.125, queue=4)
    assert depth.sparse == 0.25 and (depth.engage, depth.release) == (4, 2)  # the next budget up, not the sparsest
    states = [depth.update(w) for w in (0, 3, 4, 9, 3, 2, 1, 3, 2, 4)]
    assert states == [False, False, True, True, True, True, False, False, False, True]
    assert AdaptiveDepth([0.125, 0.25], 0.125, queue=7).release == 4  # fewer than 3.5 waiting
    with pytest.raises(ValueError, match="sparser than the default 0.25"):
        AdaptiveDepth([0.125, 0.25], 0.25, queue=4)
    with pytest.raises(ValueError, match="at least 1"):
        AdaptiveDepth([0.125, 0.25], 0.125, queue=0)


def test_the_budget_under_load_can_be_named():
    assert AdaptiveDepth([0.0667, 0.1, 0.25], 0.0667, queue=4, sparse=0.25).sparse == 0.25  # skips 0.1
    for bad in (0.0667, 0.05, 0.2):  # the default itself, denser than it, not in the bank
        with pytest.raises(ValueError, match=f"--adaptive-depth-budget {bad:g} is not a budget"):
            AdaptiveDepth([0.0667, 0.1, 0.25], 0.0667, queue=4, sparse=bad)


def test_only_admissions_that_fixed_nothing_change():
    depth = AdaptiveDepth([0.125, 0.25], 0.125, queue=2)
    params = SamplingParams(max_tokens=1)
    free = Request([1], None, params, mask_id=None, routing_text="x")
    fixed = Request([1], None, params, mask_id=None, routing_text="x", budget=0.125)
    bounded = Request([1], None, params, mask_id=None, routing_text="x", max_loss=0.3)
    forced = Request([1], torch.ones(BLOCKS, dtype=torch.bool), params)
    assert depth.admit([free, fixed, bounded, forced], waiting=1) == [] and free.budget is None  # not engaged
    assert depth.admit([free, fixed, bounded, forced], waiting=2) == [free]
    assert (free.budget, free.adapted) == (0.25, True) and depth.adapted == 1
    assert (fixed.budget, bounded.budget, bounded.max_loss) == (0.125, None, 0.3)
    assert not (fixed.adapted or bounded.adapted or forced.adapted)


class StubRouter:
    """Routes every text to 'm@<budget>' (1 block skipped at 0.125, 2 at 0.25); max_loss: the default."""

    budgets, default_budget, method = [0.125, 0.25], 0.125, "learned"

    def __init__(self):
        self.masks = {"m@0.125": torch.tensor([j != 1 for j in range(BLOCKS)]),
                      "m@0.25": torch.tensor([j not in (1, 4) for j in range(BLOCKS)])}

    def route(self, texts, budgets, max_losses):
        return [Route(f"m@{(self.default_budget if b is None else b):g}", 0.0, 0.1, self.default_budget if b is None
                      else b) for b in budgets]


def routed(n_prompt: int, max_tokens: int, **options) -> Request:
    return Request([1000 + i for i in range(n_prompt)], None, SamplingParams(max_tokens=max_tokens, temperature=0),
                   mask_id=None, routing_text="text", **options)


def test_engine_adapts_admissions_under_a_backlog_and_never_a_running_request(tiny):
    """Two slots, threshold 2: a request running before the backlog keeps its mask to the end; the
    ones admitted while 2 or more wait go sparser unless they fixed a budget or max_loss; once the
    queue drains the default is back."""
    eng = LLMEngine(FakeRunner(max_batch=2), tiny.tokenizer, router=StubRouter(),
                    depth=AdaptiveDepth(StubRouter.budgets, 0.125, queue=2))
    seen: dict[int, torch.Tensor] = {}

    def step():
        eng.step()
        for r in eng.running:  # a mask, once bound, never changes
            assert torch.equal(seen.setdefault(id(r), r.mask.clone()), r.mask)

    first = routed(3, max_tokens=20)
    eng.add(first)
    step()  # admitted with nothing waiting
    backlog = [routed(3, 3) for _ in range(4)] + [routed(3, 3, budget=0.125), routed(3, 3, max_loss=0.2)]
    for r in backlog:
        eng.add(r)
    while eng.has_work():
        step()
    assert (first.route.budget, first.adapted, first.mask_id) == (0.125, False, "m@0.125")
    assert backlog[0].adapted  # admitted with 5 waiting
    fixed, bounded = backlog[4:]
    assert not fixed.adapted and fixed.route.budget == 0.125 and not bounded.adapted and bounded.max_loss == 0.2
    for r in [first, *backlog]:
        assert r.finish_reason == "length"
        assert r.route.budget == (0.25 if r.adapted else 0.125) and r.mask_id == f"m@{r.route.budget:g}"
        assert r.budget == (0.25 if r.adapted else (0.125 if r is fixed else None))
    assert eng.depth.adapted == sum(r.adapted for r in backlog) >= 1
    assert not eng.depth.active
    last = routed(3, 2)
    eng.generate([last])
    assert not last.adapted and last.mask_id == "m@0.125"


def test_a_global_mask_under_load_is_bound_without_asking_the_router(tiny):
    """With global masks (the default of igserve serve) an adapted request runs the sparse budget's
    global mask, bound at admission: every adapted row of a step shares it, and the router sees
    only the requests that were not adapted."""
    router = StubRouter()
    shared = torch.tensor([j not in (2, 3) for j in range(BLOCKS)])
    asked = []
    route = router.route
    router.route = lambda texts, budgets, losses: asked.extend(budgets) or route(texts, budgets, losses)
    eng = LLMEngine(FakeRunner(max_batch=2), tiny.tokenizer, router=router,
                    depth=AdaptiveDepth(StubRouter.budgets, 0.125, queue=2, global_masks={0.25: ("g@0.25", shared)}))
    reqs = [routed(3, 3) for _ in range(6)]
    eng.generate(reqs)
    adapted = [r for r in reqs if r.adapted]
    assert adapted and len(adapted) < len(reqs)
    for r in adapted:
        assert r.mask_id == "g@0.25" and torch.equal(r.mask, shared) and r.route.budget == 0.25
        assert r.route.router_ms == 0.0 and r.route.distance is None
    assert asked == [None] * (len(reqs) - len(adapted))  # the router routed only the others
    with pytest.raises(ValueError, match="budget 0.25 has no global mask"):
        AdaptiveDepth(StubRouter.budgets, 0.125, queue=2, global_masks={0.125: ("g@0.125", shared)})


# ---------------------------------------------------------------------------- through the API
@pytest.mark.parametrize("shared", ["global", "routed"])
def test_api_admits_at_the_sparser_budget_while_requests_wait(serve_tiny, routed_bank_file, tiny, shared):
    """Default budget 0.125, threshold 2, 4 slots: four long streams fill the slots one after the
    other (each admitted with nothing waiting), then six short requests queue. The streams keep
    the mask they started with in every chunk; short requests admitted while 2 or more wait run at
    0.25 and say so; one that fixed its budget does not; the counter counts the adapted ones; an
    idle server is back at 0.125. Adapted requests run the 0.25 global mask (``shared`` global) or a
    routed 0.25 mask."""
    server = serve_tiny(bank=str(routed_bank_file), budget=0.125, adaptive_depth=True, adaptive_depth_queue=2,
                        adaptive_depth_mask=shared)
    global_id = MaskBank.load(routed_bank_file).global_id(0.25)
    client = server.client()
    health = httpx.get(server.base_url + "/health").json()
    assert health["default_budget"] == 0.125
    assert health["adaptive_depth"] == {"active": False, "budget": 0.25, "engage_at": 2, "release_below": 1,
                                        "adapted": 0, "mask": global_id if shared == "global" else "routed"}
    before = metric_value(server.metrics(), "igserve_adaptive_depth_requests_total")
    routed_before = metric_value(server.metrics(), "igserve_router_latency_seconds_count")
    prompt = TINY_BANK_TEXTS["math"]

    def long_stream(started):
        infos = []
        for chunk in client.completions.create(model=tiny.name, prompt=prompt, max_tokens=200, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            infos.append(chunk.model_extra["igserve"])
            started.append(1)
        return infos

    def short(budget):
        extra = {"ignore_eos": True, **({"igserve": {"budget": budget}} if budget else {})}
        return client.completions.create(model=tiny.name, prompt=prompt, max_tokens=4, temperature=0,
                                         extra_body=extra).model_extra["igserve"]

    with ThreadPoolExecutor(10) as pool:
        started = [[] for _ in range(4)]
        streams = []
        for s in started:  # one at a time: a stream that arrives while another waits would be adapted
            streams.append(pool.submit(long_stream, s))
            while not s and not streams[-1].done():
                time.sleep(0.01)
        assert httpx.get(server.base_url + "/health").json()["running"] == 4
        shorts = [pool.submit(short, b) for b in (None, None, None, 0.125, None, None)]
        long_infos = [f.result() for f in streams]
        short_infos = [f.result() for f in shorts]
    for infos in long_infos:  # running requests never change mask
        assert len({i["mask"] for i in infos}) == 1
        assert all(i["budget"] == 0.125 and not i["adaptive"] and i["router"] == "learned" for i in infos)
    adapted = [i for i in short_infos if i["adaptive"]]
    assert adapted and all(i["budget"] == 0.25 and i["mask"].endswith("@0.25") for i in adapted)
    if shared == "global":
        assert all(i["mask"] == global_id and i["router_ms"] == 0 and i["distance"] is None and i["router"] is None
                   for i in adapted)
    else:
        assert all(i["router"] == "learned" and i["distance"] is not None for i in adapted)
    assert all(i["budget"] == 0.125 and i["mask"].endswith("@0.125") for i in short_infos if not i["adaptive"])
    assert not short_infos[3]["adaptive"]  # fixed its budget
    assert metric_value(server.metrics(), "igserve_adaptive_depth_requests_total") == before + len(adapted)
    idle = short(None)
    assert not idle["adaptive"] and idle["budget"] == 0.125
    routed_now = metric_value(server.metrics(), "igserve_router_latency_seconds_count") - routed_before
    assert routed_now == 4 + 6 + 1 - (len(adapted) if shared == "global" else 0)  # the router's own requests
    health = httpx.get(server.base_url + "/health").json()
    assert health["adaptive_depth"]["active"] is False and health["adaptive_depth"]["adapted"] == len(adapted)
