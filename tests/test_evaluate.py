"""`igserve eval` on the tiny model: per-document scores against HF references, the method bookkeeping
(IG, oracle, random, compute saved), and the JSON + plot the CLI writes."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from masks.bank import MaskBank
from masks.evaluate import METHODS, _totals, evaluate_bank, score_batch
from masks.train import tokenize
from server.cli import main
from server.runner import BlockRunner

CODE = [f"def total_{i}(items):\n    return sum(x * {i} for x in items)\n" for i in range(3)]
COOKING = [f"Simmer the tomato sauce for {10 + i} minutes, add basil and garlic, then serve it over pasta."
           for i in range(3)]


@pytest.fixture(scope="module")
def runner(tiny):
    return BlockRunner(tiny.model, max_batch=1, max_len=64)


def _tiny_bank(tiny, centroids: list[list[float]]) -> MaskBank:
    names = [f"{k}_{i}" for i in range(4) for k in ("attn", "ffn")]
    drop = lambda *js: [j not in js for j in range(8)]  # noqa: E731
    return MaskBank(model={"name": "tiny", "fingerprint": tiny.fingerprint},
                    encoder={"name": "all-MiniLM-L6-v2", "dim": len(centroids[0])}, sparsity=0.25, blocks=names,
                    centroids=centroids, masks=[drop(2, 3), drop(6, 7)], mask_ids=["c0", "c1"],
                    baselines={"static_l0": drop(0, 1), "shortgpt": drop(4, 5), "greedy": drop(1, 7)})


def test_score_batch_matches_hf_and_ignores_padding(tiny, runner):
    texts = [CODE[0], COOKING[0]]
    ids, valid = tokenize(tiny.tokenizer, texts, 64)
    mask = torch.tensor([True, True, False, True, True, True, False, True])
    scores = score_batch(runner, ids, valid, {"dense": torch.ones(8, dtype=torch.bool), "m": mask})
    for i, text in enumerate(texts):
        alone = torch.tensor([tiny.tokenizer(text)["input_ids"]])
        logits = tiny.model(alone).logits[0, :-1]
        nll = F.cross_entropy(logits, alone[0, 1:], reduction="sum")
        assert float(scores["dense"]["nll"][i]) == pytest.approx(float(nll), rel=1e-4)
        assert float(scores["dense"]["kl"][i]) == pytest.approx(0.0, abs=1e-4)
        masked = runner.forward(alone, mask)[0, :-1].log_softmax(-1)
        kl = F.kl_div(masked, logits.log_softmax(-1), log_target=True, reduction="sum")
        assert float(scores["m"]["kl"][i]) == pytest.approx(float(kl), rel=1e-3)


def test_totals_pool_tokens():
    rows = [({"tokens": 1, "nll": {"a": 2.0}, "kl": {"a": 0.5}}, "a"),
            ({"tokens": 3, "nll": {"a": 4.0}, "kl": {"a": 1.5}}, "a")]
    out = _totals(rows)
    assert out["ppl"] == pytest.approx(math.exp(6 / 4)) and out["kl"] == pytest.approx(0.5) and out["tokens"] == 4


def test_methods_bookkeeping(tiny, runner):
    bank = _tiny_bank(tiny, [[1.0, 0.0], [0.0, 1.0]])
    domains = {"code": CODE, "cooking": COOKING}
    routes = {"ig": ["c0"] * 3 + ["c1", "c1", "c0"]}
    report = evaluate_bank(runner, tiny.tokenizer, bank, domains, routes, max_len=64, batch_size=2, seed=0)
    methods, masks = report["methods"], report["masks"]
    assert set(methods) == set(METHODS)
    assert methods["dense"]["overall_kl"] == pytest.approx(0.0, abs=1e-4)
    # IG on code used c0 for every document, so it is c0's score there.
    assert methods["ig"]["per_domain"]["code"]["ppl"] == pytest.approx(
        math.exp(_code_nll(runner, tiny, bank.mask("c0")) / report["tokens"]["code"]), rel=1e-4)
    assert methods["ig"]["masks_used"] == {"c0": 4, "c1": 2}
    # The oracle picks per document, so it is at least as good as IG and as every single cluster mask.
    for other in ("ig", "random"):
        assert methods["oracle"]["overall_ppl"] <= methods[other]["overall_ppl"] + 1e-9
    assert methods["oracle"]["overall_ppl"] <= min(masks["c0"]["ppl"], masks["c1"]["ppl"]) + 1e-9
    # Compute saved by a static mask: the share of per-token parameters its skipped blocks hold.
    dense = float(runner.cost.block_params.sum()) + runner.cost.head_params
    assert methods["shortgpt"]["compute_saved"] == pytest.approx(float(runner.cost.block_params[[4, 5]].sum()) / dense)
    assert methods["dense"]["compute_saved"] == 0.0
    s = report["summary"]
    assert s["best_static"] == min(("static_l0", "shortgpt", "greedy"), key=lambda m: methods[m]["overall_ppl"])
    assert s["ig_vs_best_static_ppl_pct"] == pytest.approx(
        100 * (methods["ig"]["overall_ppl"] / methods[s["best_static"]]["overall_ppl"] - 1))
    lo, hi = s["ig_vs_best_static_ppl_pct_ci95"]
    assert lo <= s["ig_vs_best_static_ppl_pct"] + 1e-9 and s["ig_vs_best_static_ppl_pct"] <= hi + 1e-9
    assert [d["route"] for d in report["documents"]] == routes["ig"]


def _code_nll(runner, tiny, mask) -> float:
    total = 0.0
    for text in CODE:
        ids = torch.tensor([tiny.tokenizer(text)["input_ids"]])
        logits = runner.forward(ids, mask)[0, :-1]
        total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
    return total


def test_eval_cli_writes_json_and_plot(tiny, tiny_model_dir, tmp_path):
    from router.encoder import embed

    data = tmp_path / "heldout"
    data.mkdir()
    (data / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CODE))
    (data / "cooking.txt").write_text("\n\n".join(COOKING))
    centroids = embed([CODE[0], COOKING[0]])
    _tiny_bank(tiny, centroids.tolist()).save(tmp_path / "bank.json")
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    assert main(["eval", "--model", str(tiny_model_dir), "--bank", str(tmp_path / "bank.json"), "--data", str(data),
                 "--json", str(out), "--plot", str(png), "--max-len", "48"]) == 0
    report = json.loads(out.read_text())
    assert report["sparsity"] == 0.25 and report["bank"] == str(tmp_path / "bank.json")
    for name in METHODS:
        m = report["methods"][name]
        assert math.isfinite(m["overall_ppl"]) and m["overall_kl"] >= -1e-6
        assert set(m["per_domain"]) == {"code", "cooking"}
        assert set(m["per_domain"]["code"]) >= {"ppl", "kl"}
    assert report["routing"] == {"code": {"c0": 3}, "cooking": {"c1": 3}}
    assert png.stat().st_size > 10_000


def test_eval_refuses_a_bank_for_other_weights(tiny, tiny_model_dir, tmp_path):
    bank = _tiny_bank(tiny, [[1.0] + [0.0] * 383, [0.0, 1.0] + [0.0] * 382])
    bank.model["fingerprint"] = "sha256:0000000000000000"
    bank.save(tmp_path / "bank.json")
    data = tmp_path / "d"
    data.mkdir()
    (data / "code.txt").write_text(CODE[0])
    with pytest.raises(Exception, match="fingerprint"):
        main(["eval", "--model", str(tiny_model_dir), "--bank", str(tmp_path / "bank.json"), "--data", str(data),
              "--json", str(tmp_path / "o.json")])
