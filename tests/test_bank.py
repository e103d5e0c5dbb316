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
