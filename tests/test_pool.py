"""Candidate pools from greedy orders, the loss predictors and the per-document score cache."""

from __future__ import annotations

import pytest
import torch

from masks.bank import MaskBank
from masks.labels import score_documents
from masks.pool import candidate_pool, cluster_masks, more_cluster_masks, shared_skips, static_masks
from router.predictor import Predictor, cross_validate, fit, out_of_fold

BLOCKS = [f"{k}_{i}" for i in range(4) for k in ("attn", "ffn")]


def _bank() -> MaskBank:
    orders = {"c0": [1, 4, 6, 2], "c1": [3, 1, 0, 5]}
    return MaskBank(
        model={"name": "m", "fingerprint": "f"}, encoder={"name": "all-MiniLM-L6-v2", "dim": 2}, sparsity=0.5,
        blocks=BLOCKS, centroids=[[1.0, 0.0], [0.0, 1.0]],
        masks=[[j not in o for j in range(8)] for o in orders.values()], mask_ids=list(orders),
        clusters=[{"id": c, "greedy_removal": [BLOCKS[j] for j in o]} for c, o in orders.items()],
        training={"greedy": {"removal": [{"block": BLOCKS[j]} for j in (6, 1, 2, 7)]},
                  "shortgpt": {"block_influence": [0.9, 0.1, 0.8, 0.7, 0.6, 0.5, 0.2, 0.3]},
                  "static_l0": {"gate_logits": [1.0, 2.0, -1.0, 3.0, 4.0, 0.0, 5.0, 6.0]}})


def _skipped(mask: torch.Tensor) -> set[int]:
    return set((~mask).nonzero().squeeze(1).tolist())


def test_smaller_budgets_are_prefixes_of_the_greedy_orders():
    bank = _bank()
    assert {c: _skipped(m) for c, m in cluster_masks(bank, 0.25).items()} == {"c0": {1, 4}, "c1": {1, 3}}
    static = static_masks(bank, 0.25)
    assert _skipped(static["greedy"]) == {1, 6}
    assert _skipped(static["shortgpt"]) == {1, 6}  # the two least influential blocks
    assert _skipped(static["static_l0"]) == {2, 5}  # the two smallest gate logits
    with pytest.raises(ValueError, match="needs 6"):
        static_masks(bank, 0.75)


def test_shared_core_masks_all_skip_the_core():
    bank = _bank()
    core = cluster_masks(bank, 0.375, core=2)  # 3 blocks: greedy's first 2 + each cluster's first other block
    assert {c: _skipped(m) for c, m in core.items()} == {"c0": {6, 1, 4}, "c1": {6, 1, 3}}
    assert shared_skips(list(core.values())) == 2
    assert shared_skips(list(cluster_masks(bank, 0.375).values())) == 1  # without the core: only block 1
    pool = candidate_pool(bank, [0.25, 0.375], {0.375: 2})
    assert set(pool) == {f"{n}@{s}" for s in ("0.25", "0.375") for n in ("greedy", "shortgpt", "static_l0")} \
        | {"c0@0.25", "c1@0.25", "core2-c0@0.375", "core2-c1@0.375"}
    assert pool["core2-c1@0.375"]["kind"] == "core" and pool["core2-c1@0.375"]["cluster"] == "c1"
    assert all(int((~p["mask"]).sum()) == round(p["budget"] * 8) for p in pool.values())


def test_other_cluster_counts_add_their_masks_once():
    bank = _bank()
    other = _bank()  # a bank at k=3: one cluster repeats c0's order, the others are new
    orders = {"c0": [1, 4, 6, 2], "c1": [0, 2, 4, 6], "c2": [7, 5, 3, 1]}
    other.mask_ids = list(orders)
    other.clusters = [{"id": c, "greedy_removal": [BLOCKS[j] for j in o]} for c, o in orders.items()]
    pool = candidate_pool(bank, [0.25, 0.5])
    before = {k: _skipped(p["mask"]) for k, p in pool.items()}
    assert more_cluster_masks(pool, [other], [0.25, 0.5]) == 4
    added = {k: _skipped(p["mask"]) for k, p in pool.items() if k not in before}
    assert added == {"k3-c1@0.25": {0, 2}, "k3-c2@0.25": {5, 7}, "k3-c1@0.5": {0, 2, 4, 6},
                     "k3-c2@0.5": {1, 3, 5, 7}}  # k3-c0 is c0 at both budgets, k3-c1@0.5's set is new
    assert all(pool[k]["kind"] == "cluster" and "cluster" not in pool[k] for k in added)
    assert more_cluster_masks(pool, [other], [0.25, 0.5]) == 0  # nothing is added twice
    rival = _bank()  # another k=3 bank whose masks differ: its ids would overwrite the first's
    rival.mask_ids = list(orders)
    rival.clusters = [{"id": c, "greedy_removal": [BLOCKS[j] for j in o]}
                      for c, o in zip(orders, ([3, 5, 0, 7], [5, 0, 2, 4], [4, 7, 1, 6]))]
    with pytest.raises(ValueError, match="one bank per cluster count"):
        more_cluster_masks(pool, [rival], [0.25])


def test_ridge_recovers_a_linear_map_and_knn_its_neighbours():
    gen = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(200, 6, generator=gen), dim=1)
    w = torch.randn(6, 3, generator=gen)
    y = x @ w + 0.5
    ridge = Predictor.from_dict(fit("ridge", x, y, ["a", "b", "c"], 1e-8).to_dict())
    torch.testing.assert_close(ridge.predict(x), y.float(), atol=1e-4, rtol=0)
    knn = fit("knn", x, y, ["a", "b", "c"], 1)
    torch.testing.assert_close(knn.predict(x[:5]), y[:5].float(), atol=1e-5, rtol=0)
    # out of fold, a 1-NN never sees the document itself, so it is worse than in sample
    oof = out_of_fold("knn=1", x, y, folds=5)
    assert (oof - y).abs().mean() > 0.05
    tokens = torch.ones(200)
    cv = cross_validate(x, y, tokens, [[0, 1, 2]], ["ridge=1e-08", "knn=1"])
    best = float(y.min(1).values.mean())
    assert cv["ridge=1e-08"] == pytest.approx(best, abs=1e-3) and cv["knn=1"] > best


def test_predictors_read_the_input_their_spec_names_and_a_mean_averages_its_parts():
    """Losses planted on the ``lm`` input: a ridge on it recovers them, one on the encoder's cannot;
    ``a+b`` predicts the mean of its parts, and every kind survives the bank's JSON."""
    from router.predictor import fit_spec, parse_spec

    gen = torch.Generator().manual_seed(1)
    x = {"encoder": torch.nn.functional.normalize(torch.randn(300, 5, generator=gen), dim=1),
         "lm": torch.nn.functional.normalize(torch.randn(300, 7, generator=gen), dim=1)}
    y = x["lm"] @ torch.randn(7, 3, generator=gen) + 0.5
    tokens, groups = torch.ones(300), [[0, 1, 2]]
    lm_ridge = fit_spec("lm:ridge=1e-08", x, y, ["a", "b", "c"])
    assert lm_ridge.needs() == {"lm"} and lm_ridge.to_dict()["inputs"] == "lm"
    torch.testing.assert_close(Predictor.from_dict(lm_ridge.to_dict()).predict(x), y.float(), atol=1e-4, rtol=0)
    cv = cross_validate(x, y, tokens, groups, ["ridge=1e-08", "lm:ridge=1e-08"])
    assert cv["lm:ridge=1e-08"] == pytest.approx(float(y.min(1).values.mean()), abs=1e-3)
    assert cv["ridge=1e-08"] > cv["lm:ridge=1e-08"] + 0.01
    mean = Predictor.from_dict(fit_spec("knn=3+lm:ridge=1e-08", x, y, ["a", "b", "c"]).to_dict())
    assert mean.kind == "mean" and mean.needs() == {"encoder", "lm"}
    knn = fit_spec("knn=3", x, y, ["a", "b", "c"])
    torch.testing.assert_close(mean.predict(x), (knn.predict(x) + lm_ridge.predict(x)) / 2)
    assert knn.to_dict().get("inputs") is None  # encoder-only predictors keep the format-2 JSON
    assert parse_spec("knn=20+lm:ridge=1") == [("encoder", "knn", 20.0), ("lm", "ridge", 1.0)]
    for bad in ("knn", "tree=3", "gpu:knn=3"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_score_cache_scores_only_what_is_new(tiny, tmp_path, monkeypatch):
    from server.runner import BlockRunner

    import masks.labels as labels

    runner = BlockRunner(tiny.model, max_batch=1, max_len=32)
    texts = ["def f(x): return x + 1", "The soup needs salt and a bay leaf.", "2 + 2 = 4"]
    masks = {"dense": torch.ones(8, dtype=torch.bool), "a": torch.tensor([1, 0, 1, 1, 1, 1, 1, 1], dtype=torch.bool)}
    fresh = score_documents(runner, tiny.tokenizer, "fp", texts, masks, 32, 2, None)
    cached = score_documents(runner, tiny.tokenizer, "fp", texts[:2], masks, 32, 2, tmp_path)
    monkeypatch.setattr(labels, "_with_kl", lambda *a, **k: pytest.fail("scored a cached pair"))
    again = score_documents(runner, tiny.tokenizer, "fp", texts[:2], {"same": masks["a"]}, 32, 2, tmp_path)
    assert again["nll"]["same"] == pytest.approx(fresh["nll"]["a"][:2]) == cached["nll"]["a"]
    assert (fresh["scored"], cached["scored"], again["scored"]) == (6, 4, 0)
    assert fresh["kl"]["dense"] == pytest.approx([0.0] * 3, abs=1e-4) and min(fresh["kl"]["a"]) > 0
    nll_only = score_documents(runner, tiny.tokenizer, "fp", texts, masks, 32, 2, tmp_path / "n", kl=False)
    assert nll_only["nll"]["a"] == pytest.approx(fresh["nll"]["a"], rel=1e-5) and nll_only["kl"] == {}


def test_score_cache_keeps_weight_formats_apart(tmp_path):
    from masks.labels import ScoreCache

    mask = torch.tensor([1, 0, 1, 1], dtype=torch.bool)
    ScoreCache(tmp_path, "fp", 32).put(mask, {"doc": (5, 1.0, None)})
    ScoreCache(tmp_path, "fp", 32, "bf16").put(mask, {"doc": (5, 2.0, None)})
    assert ScoreCache(tmp_path, "fp", 32).get(mask)["doc"][1] == 1.0
    assert ScoreCache(tmp_path, "fp", 32, "bf16").get(mask)["doc"][1] == 2.0
    assert ScoreCache(tmp_path, "fp", 32, "int4").get(mask) == {}
    # bf16's scores were cached with bfloat16 activations: the same key; float32 ones are kept apart
    assert ScoreCache(tmp_path, "fp", 32, "bf16", "bfloat16").get(mask)["doc"][1] == 2.0
    assert ScoreCache(tmp_path, "fp", 32, "bf16", "float32").get(mask) == {}
    assert ScoreCache(tmp_path, "fp", 32, "fp32", "float32").get(mask)["doc"][1] == 1.0
