"""Mask bank files: round trip, refusal of a bank built for other weights or another block count, and the shipped banks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from masks.bank import BankError, MaskBank
from masks.hard_concrete import budget

BANKS = Path(__file__).resolve().parent.parent / "masks" / "banks"
SHIPPED = sorted(BANKS.glob("smollm2-135m-instruct-s*.json"))


def _bank(blocks: int = 8, n: int = 2, dim: int = 4) -> MaskBank:
    names = [f"{kind}_{i}" for i in range(blocks // 2) for kind in ("attn", "ffn")]
    masks = [[j != c for j in range(blocks)] for c in range(n)]
    return MaskBank(
        model={"name": "toy", "fingerprint": "sha256:0123456789abcdef"},
        encoder={"name": "all-MiniLM-L6-v2", "dim": dim},
        sparsity=1 / blocks,
        blocks=names,
        centroids=[[1.0 if k == c else 0.0 for k in range(dim)] for c in range(n)],
        masks=masks,
        mask_ids=[f"c{c}" for c in range(n)],
        clusters=[{"id": f"c{c}", "size": 3 + c, "calibration_kl": 0.1 * c, "examples": [f"text {c}"]} for c in range(n)],
        baselines={"static_l0": masks[0], "shortgpt": masks[1], "greedy": masks[0]},
        training={"config": {"steps": 3}},
        calibration_docs=["code:0", "math:1"],
    )


def test_round_trip(tmp_path):
    bank = _bank()
    bank.save(tmp_path / "b.json")
    loaded = MaskBank.load(tmp_path / "b.json")
    assert loaded == bank
    assert torch.equal(loaded.mask("c1"), torch.tensor([True, False] + [True] * 6))
    assert torch.equal(loaded.mask("greedy"), loaded.mask("c0"))
    assert loaded.skip_ratio("c0") == pytest.approx(1 / 8)


def test_refuses_other_weights_with_a_clear_message():
    bank = _bank()
    bank.check_model("sha256:0123456789abcdef", 8)
    with pytest.raises(BankError, match=r"fingerprint.*sha256:0123456789abcdef.*sha256:ffffffffffffffff"):
        bank.check_model("sha256:ffffffffffffffff", 8)


def test_refuses_another_block_count_with_a_clear_message():
    with pytest.raises(BankError, match="8 blocks but the model has 60"):
        _bank().check_model("sha256:0123456789abcdef", 60)


def test_refuses_a_malformed_or_foreign_file(tmp_path):
    path = tmp_path / "b.json"
    _bank().save(path)
    data = json.loads(path.read_text())
    data["masks"][0] = data["masks"][0][:-1]
    path.write_text(json.dumps(data))
    with pytest.raises(BankError, match="one per block"):
        MaskBank.load(path)
    data["format_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(BankError, match="format_version"):
        MaskBank.load(path)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_bank_is_consistent(path):
    bank = MaskBank.load(path)
    blocks = len(bank.blocks)
    keep = budget(blocks, bank.sparsity)
    assert path.name == f"{bank.model['name']}-s{bank.sparsity:g}.json"
    assert bank.mask_ids == [f"c{i}" for i in range(len(bank.masks))]
    assert set(bank.baselines) == {"static_l0", "shortgpt", "greedy"}
    for mask_id in bank.mask_ids + list(bank.baselines):
        assert int(bank.mask(mask_id).sum()) == keep, mask_id
    assert torch.allclose(bank.centroid_tensor().norm(dim=1), torch.ones(len(bank.masks)), atol=1e-4)
    assert sum(c["size"] for c in bank.clusters) == len(bank.calibration_docs)
    assert bank.training["config"]["steps"] > 0


ROUTED = sorted(BANKS.glob("smollm2-135m-instruct-routed*.json"))


@pytest.mark.parametrize("path", ROUTED, ids=[p.name for p in ROUTED])
def test_shipped_routed_bank_is_consistent(path):
    from router.predictor import Predictor

    bank = MaskBank.load(path)
    # format 3 exactly where the learned router reads the LM's token table (router.lm_features)
    assert bank.format_version == (3 if "lm_features" in bank.router else 2) and bank.sparsity in bank.budget_list()
    blocks = len(bank.blocks)
    for s in bank.budget_list():
        ids = bank.candidate_ids(s)
        assert set(bank.cluster_ids(s)) <= set(ids) and bank.global_id(s) in ids
        for mask_id in ids:
            assert int(bank.mask(mask_id).sum()) == budget(blocks, s), mask_id
    assert bank.mask_ids == bank.cluster_ids() and set(bank.baselines) == set(bank.static_ids().values())
    predictor = Predictor.from_dict(bank.router)
    assert set(predictor.candidates) == set(bank.pool)
    inputs = {"encoder": bank.centroid_tensor()}
    if "lm" in predictor.needs():
        centre = bank.router["lm_features"]["centre"]
        inputs["lm"] = torch.nn.functional.normalize(torch.randn(len(bank.centroids), len(centre)), dim=1)
    assert predictor.predict(inputs).shape == (len(bank.centroids), len(bank.pool))
    assert 0 < bank.ood["distance"] < 2


def test_format_2_fields_round_trip_and_are_checked(tmp_path):
    bank = _bank()
    data = {k: v for k, v in vars(bank).items()}
    pool = {"c0@0.125": {"budget": 0.125, "kind": "cluster", "mask": bank.masks[0]},
            "c1@0.125": {"budget": 0.125, "kind": "cluster", "mask": bank.masks[1]}}
    spec = {"0.125": {"cluster_masks": ["c0@0.125", "c1@0.125"], "candidates": list(pool), "global": "c0@0.125"}}
    routed = MaskBank(**{**data, "pool": pool, "budgets": spec, "ood": {"distance": 0.5}})
    routed.save(tmp_path / "b.json")
    back = MaskBank.load(tmp_path / "b.json")
    assert back == routed and back.budget_list() == [0.125] and back.global_id() == "c0@0.125"
    assert back.budget_of("c1@0.125") == 0.125 and back.budget_of("dense") == 0.0
    with pytest.raises(BankError, match="only ids of the pool"):
        MaskBank(**{**data, "pool": pool, "budgets": {"0.125": {**spec["0.125"], "global": "nope"}}})
    with pytest.raises(KeyError):
        back.cluster_ids(0.25)
