"""Zero-shot scoring against direct HF forwards, a planted task every method must get right, the
method derivations against direct argmaxes, and exclusion of a bank's calibration documents."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_BANK_TEXTS, routed_bank
from test_runner import remove_blocks

from masks import zeroshot
from masks.bank import MaskBank
from masks.mc_tasks import MCExample, load_task, select, task_dir
from router.encoder import ENCODER_DIM, ENCODER_NAME
from server.runner import BlockRunner, block_names

TINY_BLOCKS = 8


def mask(*skip: int) -> list[bool]:
    return [j not in skip for j in range(TINY_BLOCKS)]


def make_bank(lm, calibration_docs=()) -> MaskBank:
    """4 cluster masks and the 3 static baselines at 2 of 8 blocks; 'greedy' repeats cluster c1."""
    clusters = [mask(1, 4), mask(2, 7), mask(0, 5), mask(3, 6)]
    centroids = F.normalize(torch.randn(len(clusters), ENCODER_DIM, generator=torch.Generator().manual_seed(0)), dim=1)
    return MaskBank(
        model={"name": lm.name, "fingerprint": lm.fingerprint}, encoder={"name": ENCODER_NAME, "dim": ENCODER_DIM},
        sparsity=0.25, blocks=block_names(TINY_BLOCKS // 2), centroids=centroids.tolist(), masks=clusters,
        mask_ids=[f"c{i}" for i in range(len(clusters))],
        baselines={"static_l0": mask(6, 7), "shortgpt": mask(5, 7), "greedy": mask(2, 7)},
        calibration_docs=list(calibration_docs),
    )


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """Reference: encode context+continuation whole (trailing context spaces moved to the
    continuation), split at the encoded context's length, sum log p of the continuation tokens."""
    stripped = context.rstrip()
    whole = tokenizer(stripped + context[len(stripped):] + continuation, add_special_tokens=False)["input_ids"]
    n = len(tokenizer(stripped, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logp = model(torch.tensor([whole]), use_cache=False).logits[0].log_softmax(-1)
    return float(sum(logp[t - 1, whole[t]] for t in range(n, len(whole))))


EXAMPLES = [
    MCExample("toy", 0, ("Question: What colour is the sky on a clear day?\nAnswer:",) * 3,
              (" blue", " a deep shade of green with stripes", " red"), 0),
    MCExample("toy", 1, ("The trophy did not fit in the suitcase because the trophy",
                         "The trophy did not fit in the suitcase because the suitcase"),
              (" was too big.",) * 2, 0),
    MCExample("toy", 2, ("Goal: boil an egg. Solution: ",) * 2, ("Put it in hot water.", "Freeze it overnight."), 1),
    MCExample("toy", 3, ("A",) * 4, (" b", " c d e f g", " h", " i j"), 2),
]


@pytest.mark.parametrize("kv_positions, batch_tokens", [(zeroshot.KV_POSITIONS, zeroshot.BATCH_TOKENS), (150, 40)])
def test_scoring_matches_hf_forward(tiny, monkeypatch, kv_positions, batch_tokens):
    """Prefix-shared, batched, multi-mask scoring equals one HF forward per (choice, mask); the
    tight setting forces several example groups and runner calls."""
    monkeypatch.setattr(zeroshot, "KV_POSITIONS", kv_positions)
    masks = torch.tensor([mask(), mask(1, 4), mask(0, 1, 2, 3)])
    got, computed = zeroshot.loglikelihoods(tiny.model, tiny.tokenizer, EXAMPLES, masks, batch_tokens)
    assert got.shape == (len(EXAMPLES), len(masks), 4)
    assert computed > 0
    for u, m in enumerate(masks):
        model = remove_blocks(tiny.model, m)
        for i, e in enumerate(EXAMPLES):
            ref = [hf_loglikelihood(model, tiny.tokenizer, c, x) for c, x in zip(e.contexts, e.continuations)]
            np.testing.assert_allclose(got[i, u, : len(ref)], ref, rtol=1e-4, atol=1e-3)
            assert np.all(got[i, u, len(ref):] == -np.inf)


def test_score_cache_reuses_and_extends(tiny, tmp_path):
    """A rerun reads every score from the cache; new masks and examples are the only work done."""
    masks = torch.tensor([mask(), mask(1, 4), mask(0, 1, 2, 3)])
    direct, _ = zeroshot.loglikelihoods(tiny.model, tiny.tokenizer, EXAMPLES, masks)
    first, computed = zeroshot.cached_loglikelihoods(tiny, EXAMPLES[:2], masks[:2], tmp_path)
    assert computed > 0
    again, computed = zeroshot.cached_loglikelihoods(tiny, EXAMPLES[:2], masks[:2], tmp_path)
    assert computed == 0
    np.testing.assert_array_equal(again, first)
    _, only_new = zeroshot.loglikelihoods(tiny.model, tiny.tokenizer, EXAMPLES[2:], masks)
    full, computed = zeroshot.cached_loglikelihoods(tiny, EXAMPLES, masks, tmp_path)
    _, new_mask = zeroshot.loglikelihoods(tiny.model, tiny.tokenizer, EXAMPLES[:2], masks[2:])
    assert computed == only_new + new_mask
    np.testing.assert_allclose(full, direct, rtol=1e-5, atol=1e-4)


def test_methods_follow_direct_argmax():
    """acc / acc_norm of every mask and the oracle (any cluster mask right) against plain argmaxes."""
    rng = np.random.default_rng(0)
    examples = [MCExample("toy", i, ("ctx",) * k, tuple(" " + "x" * int(n) for n in rng.integers(1, 9, k)),
                          int(rng.integers(k))) for i, k in enumerate(rng.integers(2, 5, 200))]
    ll = rng.normal(size=(len(examples), 5, 4)) * 5
    for i, e in enumerate(examples):
        ll[i, :, len(e.contexts):] = -np.inf
    margins = zeroshot.predictions(ll, examples)
    for i, e in enumerate(examples):
        k = len(e.contexts)
        chars = np.array([len(c) for c in e.continuations])
        for u in range(5):
            assert (margins["acc"][i, u] > 0) == (ll[i, u, :k].argmax() == e.gold)
            assert (margins["acc_norm"][i, u] > 0) == ((ll[i, u, :k] / chars).argmax() == e.gold)

    clusters = ["c0", "c1", "c2"]
    bank = SimpleNamespace(cluster_ids=lambda s: clusters, static_ids=lambda s: {"static_l0": "static_l0"})
    index = {"dense": 0, "static_l0": 4, "c0": 1, "c1": 2, "c2": 3}
    routes = [clusters[i % 3] for i in range(len(examples))]
    picks = zeroshot.picks(["dense", "ig", "static_l0", "oracle", "random"], bank, 0.25, {"ig": routes},
                           len(examples), torch.Generator().manual_seed(0))
    assert "oracle" not in picks and picks["dense"] == ["dense"] * len(examples)
    assert picks["ig"] == routes and set(picks["random"]) == set(clusters)
    assert picks["static_l0"] == ["static_l0"] * len(examples)
    oracle = zeroshot.oracle_picks(clusters, index, margins)
    for metric in zeroshot.METRICS:
        right = np.array([margins[metric][i, index[m]] > 0 for i, m in enumerate(oracle[metric])])
        np.testing.assert_array_equal(right, (margins[metric][:, 1:4] > 0).any(1))


def test_one_budget_ood_routes_far_contexts_to_greedy(tiny):
    """ig_ood of a one-budget bank: the nearest centroid's mask, greedy beyond the distance given."""
    bank = make_bank(tiny)
    texts = [e.routing_text for e in EXAMPLES]
    nearest = zeroshot.routes(bank, texts, 0.25)
    assert set(nearest) == {"ig"} and set(nearest["ig"]) <= set(bank.mask_ids)
    from router.encoder import embed

    distance = 1 - (embed(texts) @ bank.centroid_tensor().T).max(1).values
    # halfway between the two middle distances: no text lies within float error of the cut (the
    # router embeds and measures distances its own way, equal only to rounding)
    middle = distance.sort().values[len(texts) // 2 - 1: len(texts) // 2 + 1]
    cut = float(middle.mean())
    assert middle[1] - middle[0] > 1e-4
    routed = zeroshot.routes(bank, texts, 0.25, ood_distance=cut)
    assert routed["ig_ood"] == ["greedy" if d > cut else m for d, m in zip(distance.tolist(), nearest["ig"])]
    assert "greedy" in routed["ig_ood"] and routed["ig_ood"] != nearest["ig"]


def _domain_examples() -> list[MCExample]:
    """Two examples per tiny-bank domain text (the learned router and the centroids differ there),
    then the toy examples, far from every centroid."""
    out = []
    for n, text in enumerate(TINY_BANK_TEXTS.values()):
        out.append(MCExample("toy", 2 * n, (text,) * 3, (" yes", " no, not at all", " maybe"), n % 3))
        out.append(MCExample("toy", 2 * n + 1, (text + " So",) * 2, (" it is.", " it is not."), 1))
    return out + [MCExample("toy", 100 + e.doc_id, e.contexts, e.continuations, e.gold) for e in EXAMPLES]


def test_format2_bank_routes_as_the_server_and_scores_only_what_methods_use(tiny, tiny_bank):
    """A format-2 bank at each budget: ig is the learned router's pick, ig_centroid the nearest
    centroid's, ig_ood the centroid router with the bank's threshold; a run of fewer methods
    scores fewer masks and gives those methods the same results."""
    from router.router import Router

    bank = routed_bank(tiny_bank, ood=0.3)[0]
    examples = _domain_examples()
    texts = [e.routing_text for e in examples]
    for budget in (0.125, 0.25):
        full = zeroshot.evaluate(tiny, bank, {"toy": examples}, budget)
        assert set(full["methods"]) == {"dense", "ig", "ig_centroid", "ig_ood", "global", "oracle", "random"}
        expect = {"ig": Router(bank), "ig_centroid": Router(bank, method="centroid", ood=False),
                  "ig_ood": Router(bank, method="centroid")}
        for method, router in expect.items():
            ids = [r.mask_id for r in router.route(texts, [budget] * len(texts))]
            assert full["methods"][method]["masks_used"]["toy"] == {m: ids.count(m) for m in set(ids)}, method
        used = {m: full["methods"][m]["masks_used"]["toy"] for m in expect}
        assert used["ig"] != used["ig_centroid"] != used["ig_ood"]
        assert 0 < used["ig_ood"].get(f"global@{budget:g}", 0) < len(examples)
        assert all(m == "dense" or m.endswith(f"@{budget:g}") for m in full["masks"])
        few = zeroshot.evaluate(tiny, bank, {"toy": examples}, budget, methods=["ig", "global"])
        assert set(few["methods"]) == {"ig", "global"}
        for method in few["methods"]:
            assert few["methods"][method]["tasks"] == full["methods"][method]["tasks"]
        assert few["timing"]["toy"]["positions_computed"] < full["timing"]["toy"]["positions_computed"]
        assert few["ig_minus"]["global"] == full["ig_minus"]["global"]
        assert few["summary"]["best_static"] == "global"


def _single_token_words(tokenizer, context: str) -> list[str]:
    """Words ' abcde' that are one token, and stay that token appended to the context."""
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    words = []
    for i in range(3000, 12000):
        word = tokenizer.decode([i])
        if re.fullmatch(r" [a-z]{5}", word) and tokenizer(context + word, add_special_tokens=False)["input_ids"] == ctx + [i]:
            words.append(word)
    return words


def test_planted_task_is_always_right(tiny):
    """Single-token choices of equal length: the gold one is the model's most likely next token under
    every distinct mask, the others its least likely; every method scores 100% on both metrics."""
    bank = make_bank(tiny)
    masks, _ = zeroshot.unique_masks(bank, [*bank.baselines, *bank.mask_ids])
    runner = BlockRunner(tiny.model, max_batch=1, max_len=64)
    contexts = ["The capital of the country is", "My favourite thing to cook is", "def main(): return",
                "She opened the door and saw a", "Prove that the sum of two even numbers is"]
    examples = []
    for n, ctx in enumerate(contexts):
        words = _single_token_words(tiny.tokenizer, ctx)[:150]
        ids = torch.tensor([tiny.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words])
        ctx_ids = torch.tensor([tiny.tokenizer(ctx, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logp = torch.stack([runner.forward(ctx_ids, m)[0, -1].log_softmax(-1)[ids] for m in masks])
        gold_word = int(logp.min(0).values.argmax())
        wrong = logp.max(0).values.argsort()[:3].tolist()
        assert logp[:, gold_word].min() > logp[:, wrong].max()  # certain under every mask
        gold = n % 4
        options = [words[w] for w in wrong]
        options.insert(gold, words[gold_word])
        examples.append(MCExample("planted", n, (ctx,) * 4, tuple(options), gold))

    report = zeroshot.evaluate(tiny, bank, {"planted": examples})
    assert report["distinct_masks"] == 7  # dense + 3 static + 4 clusters, less greedy == c1
    assert set(report["methods"]) == {"dense", "ig", "static_l0", "shortgpt", "greedy", "oracle", "random"}
    for name, m in report["methods"].items():
        assert m["tasks"]["planted"]["n"] == len(examples)
        assert m["mean_acc"] == m["mean_acc_norm"] == 1.0, name
        assert sum(m["masks_used"]["planted"].values()) == len(examples)


def test_loader_drops_unconditional_requests():
    docs = load_task("arc_challenge")
    config = json.loads((task_dir("arc_challenge") / "config.json").read_text())
    assert len(docs) == config["num_instances"]
    assert all(len(e.contexts) == len(e.continuations) >= 3 and 0 <= e.gold < len(e.contexts) for e in docs)


def test_calibration_docs_are_excluded(tiny, tmp_path):
    """Documents a bank was built on never reach the evaluation, with or without --limit."""
    docs = load_task("arc_challenge")
    keep = {docs[3].doc_id, docs[10].doc_id, docs[11].doc_id}
    excluded = [e.doc_key for e in docs if e.doc_id not in keep]
    assert {e.doc_id for e in select(docs, set(excluded), None)} == keep
    assert {e.doc_id for e in select(docs, set(excluded), 2)} < keep
    bank_path = tmp_path / "bank.json"
    make_bank(tiny, calibration_docs=excluded + ["piqa:0"]).save(bank_path)

    from server.cli import main

    out = tmp_path / "zs.json"
    assert main(["eval", "zeroshot", "--model", str(tiny.path), "--bank", str(bank_path), "--tasks", "arc_challenge",
                 "--json", str(out), "--plot", str(tmp_path / "zs.png")]) == 0
    report = json.loads(out.read_text())
    data = report["data"]["arc_challenge"]
    assert sorted(data["doc_ids"]) == sorted(keep)
    assert data["excluded_calibration_docs"] == len(excluded)
    assert report["methods"]["ig"]["tasks"]["arc_challenge"]["n"] == len(keep)
    assert (tmp_path / "zs.png").stat().st_size > 0
