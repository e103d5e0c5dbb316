"""Per-candidate loss predictors over the routing embedding: the learned router's model.

A predictor maps an L2-normalised embedding to the loss each candidate mask is expected to add
(excess NLL per token over dense, in nats); the router takes the lowest within the requested
budget, or with ``max_loss`` the sparsest mask predicted to stay under it. Two kinds, both small
enough to live in the bank JSON and cheap enough to run per request:

* ``ridge``: one linear map, closed form, regularisation ``alpha``;
* ``knn``: the mean label of the ``k`` calibration documents nearest in cosine similarity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Predictor:
    kind: str  # "ridge" | "knn"
    candidates: list[str]  # column order of the predictions
    params: dict = field(default_factory=dict)  # ridge: weight [dim+1, M]; knn: keys [n, dim], values [n, M], k

    def __post_init__(self):
        if self.kind not in ("ridge", "knn"):
            raise ValueError(f"unknown predictor kind {self.kind!r}")
        self._t = {k: torch.tensor(v, dtype=torch.float32) for k, v in self.params.items() if isinstance(v, list)}

    def predict(self, emb: torch.Tensor) -> torch.Tensor:
        """[n, M] predicted excess loss per candidate."""
        emb = emb.float()
        if self.kind == "ridge":
            return _with_bias(emb) @ self._t["weight"]
        sims = emb @ self._t["keys"].T
        k = min(int(self.params["k"]), sims.shape[1])
        idx = sims.topk(k, dim=1).indices
        return self._t["values"][idx].mean(1)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "candidates": list(self.candidates), "params": self.params}

    @classmethod
    def from_dict(cls, data: dict) -> "Predictor":
        return cls(data["kind"], list(data["candidates"]), dict(data["params"]))


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)


def _rounded(t: torch.Tensor, digits: int = 6) -> list:
    """Nested lists rounded in float64, so the bank JSON holds short decimals, not float32 reprs."""
    return torch.round(t.double(), decimals=digits).tolist()


def fit(kind: str, emb: torch.Tensor, target: torch.Tensor, candidates: list[str], value: float) -> Predictor:
    """Fit a predictor on [n, dim] embeddings and [n, M] targets; ``value`` is ridge's alpha or knn's k."""
    if kind == "ridge":
        x = _with_bias(emb.double())
        reg = value * torch.eye(x.shape[1], dtype=torch.float64)
        reg[-1, -1] = 0.0  # the bias is not shrunk
        weight = torch.linalg.solve(x.T @ x + reg, x.T @ target.double())
        return Predictor("ridge", candidates, {"alpha": value, "weight": _rounded(weight)})
    return Predictor("knn", candidates, {"k": int(value), "keys": _rounded(emb), "values": _rounded(target)})


def realised_loss(pred: torch.Tensor, excess: torch.Tensor, tokens: torch.Tensor, groups: list[list[int]]) -> float:
    """Mean excess NLL per token of the mask chosen (lowest prediction within each column group)."""
    total = 0.0
    for cols in groups:
        pick = pred[:, cols].argmin(1)
        total += float((excess[:, cols].gather(1, pick[:, None]).squeeze(1) * tokens).sum())
    return total / (float(tokens.sum()) * len(groups))


def out_of_fold(kind: str, value: float, emb: torch.Tensor, target: torch.Tensor, folds: int = 5,
                seed: int = 0) -> torch.Tensor:
    """[n, M] predictions for every document from a predictor fit without its fold (seeded folds)."""
    order = torch.randperm(len(emb), generator=torch.Generator().manual_seed(seed))
    pred = torch.empty(target.shape, dtype=torch.float32)
    for f in range(folds):
        test = order[f::folds]
        keep = torch.ones(len(order), dtype=torch.bool)
        keep[f::folds] = False
        pred[test] = fit(kind, emb[order[keep]], target[order[keep]], [], value).predict(emb[test])
    return pred


def cross_validate(emb: torch.Tensor, excess: torch.Tensor, tokens: torch.Tensor, groups: list[list[int]],
                   specs: list[tuple[str, float]], folds: int = 5, seed: int = 0) -> dict[str, float]:
    """{"kind=value": realised loss} of each spec over ``folds`` seeded folds of the training labels."""
    return {f"{kind}={value:g}": realised_loss(out_of_fold(kind, value, emb, excess, folds, seed), excess, tokens, groups)
            for kind, value in specs}
