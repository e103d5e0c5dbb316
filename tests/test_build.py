"""Mask building on the tiny model: the top-k KL, resumable L0 training, the static baselines, and an
end-to-end `igserve masks build` that takes seconds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from masks.bank import MaskBank
from masks.baselines import block_influence, greedy_removal
from masks.hard_concrete import budget
from masks.train import TrainConfig, mask_kl, sample_positions, teacher_targets, tokenize, topk_kl, train_gates
from server.cli import main
from server.runner import BlockRunner

CODE = [f"def scale_{i}(values, factor):\n    return [v * factor + {i} for v in values if v > {i}]\n" for i in range(8)]
COOKING = [f"Preheat the oven to {170 + i} degrees. Whisk {i + 2} eggs with sugar, fold in the flour and "
           f"butter, then bake the cake for {20 + i} minutes until golden." for i in range(8)]
TINY_CFG = TrainConfig(steps=6, batch_size=2, seq_len=24, kl_positions=6, top_k=16, checkpoint_every=3)


def _write_docs(folder):
    folder.mkdir()
    (folder / "code.jsonl").write_text("".join(json.dumps({"id": f"code:{i}", "text": t}) + "\n"
                                               for i, t in enumerate(CODE)))
    (folder / "cooking.txt").write_text("\n\n".join(COOKING) + "\n")
    return folder


@pytest.fixture(scope="module")
def runner(tiny):
    return BlockRunner(tiny.model, max_batch=1, max_len=32)


@pytest.fixture(scope="module")
def targets(tiny, runner):
    ids, valid = tokenize(tiny.tokenizer, CODE + COOKING, TINY_CFG.seq_len)
    positions, weights = sample_positions(valid.sum(1), TINY_CFG.kl_positions, torch.Generator().manual_seed(0))
    return teacher_targets(runner, ids, valid, positions, weights, TINY_CFG.top_k)


def test_topk_kl_hand_values():
    teacher = torch.tensor([0.5, 0.3, 0.2]).log()
    student = torch.tensor([0.2, 0.3, 0.5]).log()
    top = teacher.topk(3)
    # full KL: 0.5 ln(2.5) + 0.3 ln(1) + 0.2 ln(0.4) = 0.274887
    assert float(topk_kl(student, top.indices, top.values)) == pytest.approx(0.274887, abs=1e-5)
    top1 = teacher.topk(1)
    # bins {0}, {1, 2}: 0.5 ln(0.5 / 0.2) + 0.5 ln(0.5 / 0.8) = 0.223144
    assert float(topk_kl(student, top1.indices, top1.values)) == pytest.approx(0.223144, abs=1e-5)
    assert float(topk_kl(teacher, top1.indices, top1.values)) == pytest.approx(0.0, abs=1e-6)


def test_sample_positions_stay_inside_each_document():
    positions, weights = sample_positions(torch.tensor([10, 3, 1]), 4, torch.Generator().manual_seed(0))
    assert weights.sum(1).tolist() == [4, 2, 0]
    assert bool((positions[0] <= 8).all()) and positions[0].unique().numel() == 4
    assert sorted(positions[1, :2].tolist()) == [0, 1]


def test_teacher_targets_match_the_hf_model(tiny, targets):
    ids, valid = targets.ids[:1], targets.valid[:1]
    logp = tiny.model(ids, attention_mask=valid.long()).logits[0].log_softmax(-1)
    pos = targets.positions[0, 0]
    assert torch.allclose(targets.top_logp[0, 0], logp[pos].topk(TINY_CFG.top_k).values, atol=1e-4)


def test_interrupted_training_resumes_to_the_same_gates(runner, targets, tmp_path, monkeypatch):
    import masks.train

    straight = train_gates(runner, targets, 0.25, TINY_CFG, seed=3)
    real_batch_kl, calls = masks.train.batch_kl, []

    def dies_at_step_5(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_batch_kl(*args)

    ckpt = tmp_path / "gates.pt"
    monkeypatch.setattr(masks.train, "batch_kl", dies_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train_gates(runner, targets, 0.25, TINY_CFG, seed=3, checkpoint=ckpt)  # checkpointed at step 3
    monkeypatch.setattr(masks.train, "batch_kl", real_batch_kl)
    assert torch.load(ckpt)["step"] == 3
    resumed = train_gates(runner, targets, 0.25, TINY_CFG, seed=3, checkpoint=ckpt)
    assert [h["step"] for h in resumed["history"]] == list(range(1, TINY_CFG.steps + 1))
    assert torch.allclose(resumed["log_alpha"], straight["log_alpha"])


def test_training_moves_gates_toward_the_target(runner, targets):
    cfg = TrainConfig(**{**TINY_CFG.to_dict(), "steps": 30, "lr": 0.3})
    out = train_gates(runner, targets, 0.5, cfg, seed=0)
    assert out["history"][-1]["skip"] > out["history"][0]["skip"] + 0.1


def test_greedy_first_removal_is_the_best_single_block(runner, targets, tmp_path):
    calib = targets.take(torch.arange(4))
    single = []
    for j in range(runner.num_blocks):
        mask = torch.ones(runner.num_blocks, dtype=torch.bool)
        mask[j] = False
        single.append(mask_kl(runner, calib, mask))
    ckpt = tmp_path / "greedy.json"
    one = greedy_removal(runner, calib, 1, checkpoint=ckpt)
    assert one[0]["block"] == min(range(runner.num_blocks), key=single.__getitem__)
    assert one[0]["kl"] == pytest.approx(min(single))
    three = greedy_removal(runner, calib, 3, checkpoint=ckpt)  # continues from the saved first step
    assert three[0] == one[0] and len({s["block"] for s in three}) == 3
    assert greedy_removal(runner, calib, 2, checkpoint=ckpt) == three[:2]  # nested: a prefix


def test_block_influence_is_zero_for_a_block_that_adds_nothing(tiny, targets):
    import copy

    model = copy.deepcopy(tiny.model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.zero_()  # ffn_1 outputs zeros: in == out
    influence = block_influence(BlockRunner(model, max_batch=1, max_len=32), targets.take(torch.arange(4)))
    assert float(influence[3]) == pytest.approx(0.0, abs=1e-6)
    assert bool((influence[[0, 1, 2, 4, 5, 6, 7]] > 1e-4).all())


def test_build_end_to_end_on_the_tiny_model(tiny, tiny_model_dir, tmp_path):
    data = _write_docs(tmp_path / "docs")
    args = ["masks", "build", "--model", str(tiny_model_dir), "--clusters", "2", "--sparsity", "0.25",
            "--data", str(data), "--work-dir", str(tmp_path / "work"), "--docs-per-cluster", "4", "--calib-docs", "3",
            "--steps", "6", "--batch-size", "2", "--seq-len", "24", "--kl-positions", "6", "--top-k", "16"]
    assert main(args + ["--out", str(tmp_path / "a.json")]) == 0
    bank = MaskBank.load(tmp_path / "a.json")
    bank.check_model(tiny.fingerprint, 8)
    keep = budget(8, 0.25)
    assert bank.mask_ids == ["c0", "c1"]
    assert all(int(bank.mask(m).sum()) == keep for m in bank.mask_ids + ["static_l0", "shortgpt", "greedy"])
    # The planted domains are the clusters.
    assert sorted(c["size"] for c in bank.clusters) == [8, 8]
    assert {("def " in c["examples"][0]) for c in bank.clusters} == {True, False}
    assert sorted(bank.calibration_docs)[:2] == ["code:0", "code:1"] and len(bank.calibration_docs) == 16
    assert all(math.isfinite(c["calibration_kl"]) for c in bank.clusters)
    # A second build reuses the work dir (embeddings, teacher, finished gates) and is identical.
    assert main(args + ["--out", str(tmp_path / "b.json")]) == 0
    again = MaskBank.load(tmp_path / "b.json")
    assert again.masks == bank.masks and again.baselines == bank.baselines and again.centroids == bank.centroids
    # Greedy cluster masks are nested across budgets; the L0 learner gives the same budget from gate logits.
    assert main(args + ["--out", str(tmp_path / "c.json"), "--sparsity", "0.125"]) == 0
    smaller = MaskBank.load(tmp_path / "c.json")
    assert all(set(s["skipped"]) < set(b["skipped"]) for s, b in zip(smaller.clusters, bank.clusters))
    assert main(args + ["--out", str(tmp_path / "d.json"), "--learner", "l0"]) == 0
    l0 = MaskBank.load(tmp_path / "d.json")
    assert l0.training["learner"] == "l0" and all(len(c["gate_logits"]) == 8 for c in l0.clusters)
    assert all(int(l0.mask(m).sum()) == keep for m in l0.mask_ids) and l0.baselines == bank.baselines


def test_extending_a_bank_continues_its_removal_orders(tiny_model_dir, tmp_path, monkeypatch):
    import masks.baselines

    searched = []
    real_kl = masks.baselines.mask_kl
    monkeypatch.setattr(masks.baselines, "mask_kl", lambda *a: searched.append(1) or real_kl(*a))
    data = _write_docs(tmp_path / "docs")
    args = ["masks", "build", "--model", str(tiny_model_dir), "--clusters", "2", "--data", str(data),
            "--docs-per-cluster", "4", "--calib-docs", "3", "--steps", "6", "--batch-size", "2", "--seq-len", "24",
            "--kl-positions", "6", "--top-k", "16"]
    assert main(args + ["--sparsity", "0.125", "--work-dir", str(tmp_path / "w1"), "--out", str(tmp_path / "s.json")]) == 0
    searched.clear()
    assert main(args + ["--sparsity", "0.375", "--work-dir", str(tmp_path / "w2"), "--out", str(tmp_path / "x.json"),
                        "--extend", str(tmp_path / "s.json")]) == 0
    extend_searches = len(searched)
    assert main(args + ["--sparsity", "0.375", "--work-dir", str(tmp_path / "w3"), "--out", str(tmp_path / "f.json")]) == 0
    assert extend_searches < len(searched) - extend_searches  # the first removal was not searched again
    small, extended, full = (MaskBank.load(tmp_path / f) for f in ("s.json", "x.json", "f.json"))
    for s, x in zip(small.clusters, extended.clusters):
        assert len(x["greedy_removal"]) == 3 and x["greedy_removal"][:1] == s["greedy_removal"]
    # The global order is exact greedy: continuing its prefix gives the order a search from scratch gives.
    assert extended.training["greedy"] == full.training["greedy"] and extended.baselines["greedy"] == full.baselines["greedy"]
    # A bank of other clusters cannot be extended.
    with pytest.raises(SystemExit, match="--extend"):
        main(args[:5] + ["1"] + args[6:] + ["--sparsity", "0.375", "--work-dir", str(tmp_path / "w4"),
                                            "--out", str(tmp_path / "y.json"), "--extend", str(tmp_path / "s.json")])


def test_run_once_defers_locked_jobs_and_takes_over_dead_locks(tmp_path):
    import os
    import subprocess
    import sys
    import threading

    from masks.build import run_once

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "a.lock").write_text(dead.stdout.strip())  # left behind by a build that died
    (tmp_path / "b.lock").write_text(str(os.getppid()))  # held by a live build
    order = []
    threading.Timer(0.5, lambda: (tmp_path / "b.lock").unlink()).start()
    out = run_once({"a": (tmp_path / "a.lock", lambda: order.append("a") or 1),
                    "b": (tmp_path / "b.lock", lambda: order.append("b") or 2)}, "test")
    assert out == {"a": 1, "b": 2} and order == ["a", "b"]
    assert not (tmp_path / "a.lock").exists() and not (tmp_path / "b.lock").exists()


def test_lazy_greedy_matches_exact_greedy_with_fewer_evaluations(monkeypatch):
    import types

    import masks.baselines

    weights = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 0.05])
    calls = []

    def fake_kl(_runner, _targets, mask, _batch_size):  # (sum of removed weights)^2: removing more never helps
        calls.append(1)
        return float(weights[~mask].sum()) ** 2

    monkeypatch.setattr(masks.baselines, "mask_kl", fake_kl)
    runner = types.SimpleNamespace(num_blocks=10)
    exact = greedy_removal(runner, None, 5)
    exact_calls = len(calls)
    calls.clear()
    lazy = greedy_removal(runner, None, 5, lazy=True)
    assert [s["block"] for s in exact] == [9, 1, 5, 3, 7]  # lightest blocks first
    assert [s["block"] for s in lazy] == [9, 1, 5, 3, 7]
    assert [s["kl"] for s in lazy] == pytest.approx([s["kl"] for s in exact])
    assert exact_calls == 10 + 9 + 8 + 7 + 6 and len(calls) < exact_calls
