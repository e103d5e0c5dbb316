"""Mask bank file: cluster centroids + block masks, versioned JSON.

A bank is tied to one model (name + weights fingerprint) and one encoder. Format 1 holds one block
budget: one mask per cluster plus the static baselines. Format 2 adds a candidate ``pool`` over
several budgets (ids '<name>@<budget>'), ``budgets`` (per budget: the cluster masks aligned with
the centroids, the candidates a learned router chooses among, the global fallback mask), the
learned ``router`` and the ``ood`` fallback threshold; ``sparsity`` is then the default budget and
``masks``/``mask_ids``/``baselines`` mirror its masks, so a format-1 reader's fields keep their
meaning. The server refuses a bank that was built for other weights or another block count.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import weakref

import torch

FORMAT_VERSION = 2
# 3: a format-2 bank whose learned router also reads the LM's token table (router.lm_features),
# so that a reader without it refuses the bank rather than routing on half its inputs
LM_FEATURES_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
DENSE = "dense"


_TENSORS: dict[int, dict[str, torch.Tensor]] = {}  # per bank object: its mask tensors, built once


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
    pool: dict[str, dict] = field(default_factory=dict)  # id -> {budget, kind, cluster?, mask}
    budgets: dict[str, dict] = field(default_factory=dict)  # "<budget>" -> {cluster_masks, candidates, global}
    router: dict = field(default_factory=dict)  # {"kind": "centroid"} or a router.predictor.Predictor dict
    ood: dict = field(default_factory=dict)  # {"distance": cosine distance beyond which the global mask is used}

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
        if any(len(p["mask"]) != b for p in self.pool.values()) or DENSE in self.pool:
            raise BankError(f"every pool mask must have {b} entries and none may be 'dense'")
        for key, spec in self.budgets.items():
            ids = [*spec["cluster_masks"], *spec["candidates"], *filter(None, [spec.get("global")])]
            if any(i not in self.pool for i in ids) or len(spec["cluster_masks"]) != n:
                raise BankError(f"budget {key}: needs {n} cluster masks and only ids of the pool")
        _TENSORS.pop(id(self), None)
        weakref.finalize(self, _TENSORS.pop, id(self), None)

    # ------------------------------------------------------------------ io
    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        path.write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "MaskBank":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BankError(f"cannot read mask bank {path}: {exc}") from exc
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            raise BankError(f"mask bank {path} has format_version {version}, this igserve reads {READABLE_VERSIONS}")
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

    def mask_tensors(self) -> dict[str, torch.Tensor]:
        """Every mask a client may force, by id, as one bool tensor each, built once: 'dense', the
        cluster masks, the baselines and (format 2) every pool mask. Callers share these tensors."""
        if id(self) not in _TENSORS:
            rows = {DENSE: [True] * len(self.blocks), **dict(zip(self.mask_ids, self.masks)), **self.baselines,
                    **{k: p["mask"] for k, p in self.pool.items()}}
            _TENSORS[id(self)] = {k: torch.tensor(v, dtype=torch.bool) for k, v in rows.items()}
        return _TENSORS[id(self)]

    def mask(self, mask_id: str) -> torch.Tensor:
        """Bool mask for a mask id (a cluster id, a baseline name, a pool id, or 'dense')."""
        return self.mask_tensors()[mask_id]

    def all_mask_ids(self) -> list[str]:
        return list(self.mask_tensors())

    def budget_list(self) -> list[float]:
        """The budgets (sparsities) this bank holds, ascending."""
        return sorted(float(k) for k in self.budgets) if self.budgets else [self.sparsity]

    def _spec(self, sparsity: float | None) -> dict:
        s = self.sparsity if sparsity is None else sparsity
        if not self.budgets:
            if s != self.sparsity:
                raise KeyError(s)
            return {"cluster_masks": list(self.mask_ids), "candidates": list(self.mask_ids),
                    "global": "greedy" if "greedy" in self.baselines else None}
        return self.budgets[f"{s:g}"]

    def cluster_ids(self, sparsity: float | None = None) -> list[str]:
        """Mask ids aligned with the centroids at a budget (default: the bank's)."""
        return list(self._spec(sparsity)["cluster_masks"])

    def candidate_ids(self, sparsity: float | None = None) -> list[str]:
        """The masks a learned router chooses among at a budget."""
        return list(self._spec(sparsity)["candidates"])

    def global_id(self, sparsity: float | None = None) -> str | None:
        """The mask fit on the whole corpus at a budget: the out-of-distribution fallback."""
        return self._spec(sparsity).get("global")

    def static_ids(self, sparsity: float | None = None) -> dict[str, str]:
        """{baseline name: mask id} of the static masks at a budget."""
        if not self.budgets:
            return {k: k for k in self.baselines}
        return {k.split("@")[0]: k for k in self.candidate_ids(sparsity) if self.pool[k]["kind"] == "static"}

    def budget_of(self, mask_id: str) -> float:
        if mask_id == DENSE:
            return 0.0
        return float(self.pool[mask_id]["budget"]) if mask_id in self.pool else self.sparsity

    def centroid_tensor(self) -> torch.Tensor:
        return torch.tensor(self.centroids, dtype=torch.float32)

    def skip_ratio(self, mask_id: str) -> float:
        return 1.0 - float(self.mask(mask_id).float().mean())
