"""Mask bank file: cluster centroids + one block mask per cluster, versioned JSON.

A bank is tied to one model (name + weights fingerprint), one encoder, and one block budget.
The server refuses a bank that was built for other weights or another block count.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

FORMAT_VERSION = 1
DENSE = "dense"


class BankError(ValueError):
    """A bank file is malformed or does not fit the loaded model."""


@dataclass
class MaskBank:
    model: dict  # {"name": str, "fingerprint": str}
    encoder: dict  # {"name": str, "dim": int}
    sparsity: float
    blocks: list[str]
    centroids: list[list[float]]  # N x dim, L2-normalised
    masks: list[list[bool]]  # N x B, True = block runs
    mask_ids: list[str]
    clusters: list[dict] = field(default_factory=list)  # per cluster: size, calibration loss, examples
    baselines: dict[str, list[bool]] = field(default_factory=dict)  # static masks at the same budget
    training: dict = field(default_factory=dict)
    calibration_docs: list[str] = field(default_factory=list)  # ids of documents used to build it
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        n, b = len(self.masks), len(self.blocks)
        if not (len(self.centroids) == n == len(self.mask_ids)):
            raise BankError(f"bank has {len(self.centroids)} centroids, {n} masks, {len(self.mask_ids)} ids")
        if any(len(m) != b for m in list(self.masks) + list(self.baselines.values())):
            raise BankError(f"every mask must have {b} entries, one per block")
        if any(len(c) != self.encoder["dim"] for c in self.centroids):
            raise BankError(f"every centroid must have the encoder's {self.encoder['dim']} dimensions")
        if DENSE in self.mask_ids or len(set(self.mask_ids)) != n:
            raise BankError("mask ids must be unique and may not be 'dense'")

    # ------------------------------------------------------------------ io
    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "MaskBank":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BankError(f"cannot read mask bank {path}: {exc}") from exc
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise BankError(f"mask bank {path} has format_version {version}, this igserve reads {FORMAT_VERSION}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise BankError(f"mask bank {path} is malformed: {exc}") from exc

    # ------------------------------------------------------------------ use
    def check_model(self, fingerprint: str, num_blocks: int) -> None:
        if len(self.blocks) != num_blocks:
            raise BankError(f"mask bank has {len(self.blocks)} blocks but the model has {num_blocks}")
        if self.model["fingerprint"] != fingerprint:
            raise BankError(
                f"mask bank was built for model {self.model['name']!r} with weights fingerprint "
                f"{self.model['fingerprint']}, but the loaded model's fingerprint is {fingerprint}"
            )

    def mask(self, mask_id: str) -> torch.Tensor:
        """Bool mask for a mask id (a cluster id, a baseline name, or 'dense')."""
        if mask_id == DENSE:
            return torch.ones(len(self.blocks), dtype=torch.bool)
        if mask_id in self.mask_ids:
            return torch.tensor(self.masks[self.mask_ids.index(mask_id)], dtype=torch.bool)
        if mask_id in self.baselines:
            return torch.tensor(self.baselines[mask_id], dtype=torch.bool)
        raise KeyError(mask_id)

    def all_mask_ids(self) -> list[str]:
        return [DENSE, *self.mask_ids, *self.baselines]

    def centroid_tensor(self) -> torch.Tensor:
        return torch.tensor(self.centroids, dtype=torch.float32)

    def skip_ratio(self, mask_id: str) -> float:
        return 1.0 - float(self.mask(mask_id).float().mean())
