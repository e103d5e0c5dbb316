"""Per-candidate loss predictors over the routing inputs: the learned router's model.

A predictor maps a routing text's inputs to the loss each candidate mask is expected to add
(excess NLL per token over dense, in nats); the router takes the lowest within the requested
budget, or with ``max_loss`` the sparsest mask predicted to stay under it. The inputs
(``INPUTS``): ``encoder``, the L2-normalised MiniLM embedding, and ``lm``, the LM's own token
table averaged over the text (``router.lm_features``). Kinds, all small enough to live in the bank
JSON and cheap enough to run per request:

* ``ridge``: one linear map, closed form, regularisation ``alpha``;
* ``knn``: the mean label of the ``k`` calibration documents nearest in cosine similarity;
* ``mean``: the mean of several predictors' predictions (e.g. kNN on the encoder and ridge on
  the LM's inputs, which err differently).

A spec names one: ``knn=20`` (the encoder's input), ``lm:ridge=1`` (the LM's), or parts joined by
``+`` for a mean (``knn=20+lm:ridge=1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

INPUTS = ("encoder", "lm")
KINDS = ("ridge", "knn", "mean")

Inputs = dict[str, torch.Tensor]  # input name -> [n, dim]; a bare tensor is the encoder's


@dataclass
class Predictor:
    kind: str  # "ridge" | "knn" | "mean"
    candidates: list[str]  # column order of the predictions
    params: dict = field(default_factory=dict)  # ridge: weight [dim+1, M]; knn: keys [n, dim], values [n, M], k; mean: parts
    inputs: str = "encoder"  # which routing input a ridge or knn reads

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown predictor kind {self.kind!r}")
        if self.inputs not in INPUTS:
            raise ValueError(f"unknown predictor input {self.inputs!r}")
        self._t = {k: torch.tensor(v, dtype=torch.float32) for k, v in self.params.items() if k != "parts"
                   and isinstance(v, list)}
        self._parts = [Predictor.from_dict({"candidates": self.candidates, **p}) for p in self.params.get("parts", [])]

    def needs(self) -> set[str]:
        """The routing inputs this predictor reads."""
        return set().union(*(p.needs() for p in self._parts)) if self.kind == "mean" else {self.inputs}

    def predict(self, x: Inputs | torch.Tensor) -> torch.Tensor:
        """[n, M] predicted excess loss per candidate."""
        x = _as_inputs(x)
        if self.kind == "mean":
            return torch.stack([p.predict(x) for p in self._parts]).mean(0)
        emb = x[self.inputs].float()
        if self.kind == "ridge":
            return _with_bias(emb) @ self._t["weight"]
        sims = emb @ self._t["keys"].T
        k = min(int(self.params["k"]), sims.shape[1])
        idx = sims.topk(k, dim=1).indices
        return self._t["values"][idx].mean(1)

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "candidates": list(self.candidates), "params": self.params}
        return out if self.inputs == "encoder" else {**out, "inputs": self.inputs}

    @classmethod
    def from_dict(cls, data: dict) -> "Predictor":
        return cls(data["kind"], list(data["candidates"]), dict(data["params"]), data.get("inputs", "encoder"))


def _as_inputs(x: Inputs | torch.Tensor) -> Inputs:
    return {"encoder": x} if isinstance(x, torch.Tensor) else x


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)


def _rounded(t: torch.Tensor, digits: int = 6) -> list:
    """Nested lists rounded in float64, so the bank JSON holds short decimals, not float32 reprs."""
    return torch.round(t.double(), decimals=digits).tolist()


def parse_spec(spec: str) -> list[tuple[str, str, float]]:
    """``lm:ridge=1+knn=20`` -> [(inputs, kind, value), ...]."""
    parts = []
    for part in spec.split("+"):
        inputs, _, rest = part.rpartition(":")
        inputs = inputs or "encoder"
        kind, _, value = rest.partition("=")
        if kind not in ("ridge", "knn") or not value or inputs not in INPUTS:
            raise ValueError(f"not a predictor spec: {spec!r} (e.g. knn=20, lm:ridge=1, knn=20+lm:ridge=1)")
        parts.append((inputs, kind, float(value)))
    return parts


def fit(kind: str, emb: torch.Tensor, target: torch.Tensor, candidates: list[str], value: float,
        inputs: str = "encoder") -> Predictor:
    """Fit a ridge or knn on [n, dim] inputs and [n, M] targets; ``value`` is ridge's alpha or knn's k."""
    if kind == "ridge":
        x = _with_bias(emb.double())
        reg = value * torch.eye(x.shape[1], dtype=torch.float64)
        reg[-1, -1] = 0.0  # the bias is not shrunk
        weight = torch.linalg.solve(x.T @ x + reg, x.T @ target.double())
        return Predictor("ridge", candidates, {"alpha": value, "weight": _rounded(weight)}, inputs)
    return Predictor("knn", candidates, {"k": int(value), "keys": _rounded(emb), "values": _rounded(target)}, inputs)


def fit_spec(spec: str, x: Inputs | torch.Tensor, target: torch.Tensor, candidates: list[str]) -> Predictor:
    """The predictor a spec names, fit on inputs ``x`` and [n, M] targets."""
    x = _as_inputs(x)
    parts = [fit(kind, x[inputs], target, candidates, value, inputs) for inputs, kind, value in parse_spec(spec)]
    if len(parts) == 1:
        return parts[0]
    return Predictor("mean", candidates, {"parts": [{k: v for k, v in p.to_dict().items() if k != "candidates"}
                                                    for p in parts]})


def realised_loss(pred: torch.Tensor, excess: torch.Tensor, tokens: torch.Tensor, groups: list[list[int]]) -> float:
    """Mean excess NLL per token of the mask chosen (lowest prediction within each column group)."""
    total = 0.0
    for cols in groups:
        pick = pred[:, cols].argmin(1)
        total += float((excess[:, cols].gather(1, pick[:, None]).squeeze(1) * tokens).sum())
    return total / (float(tokens.sum()) * len(groups))


def out_of_fold(spec: str, x: Inputs | torch.Tensor, target: torch.Tensor, folds: int = 5,
                seed: int = 0) -> torch.Tensor:
    """[n, M] predictions for every document from a predictor fit without its fold (seeded folds)."""
    x = _as_inputs(x)
    n = len(target)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    pred = torch.empty(target.shape, dtype=torch.float32)
    for f in range(folds):
        test = order[f::folds]
        keep = torch.ones(n, dtype=torch.bool)
        keep[f::folds] = False
        train = order[keep]
        model = fit_spec(spec, {k: v[train] for k, v in x.items()}, target[train], [])
        pred[test] = model.predict({k: v[test] for k, v in x.items()})
    return pred


def cross_validate(x: Inputs | torch.Tensor, excess: torch.Tensor, tokens: torch.Tensor, groups: list[list[int]],
                   specs: list[str], folds: int = 5, seed: int = 0) -> dict[str, float]:
    """{spec: realised loss} of each spec over ``folds`` seeded folds of the training labels."""
    return {spec: realised_loss(out_of_fold(spec, x, excess, folds, seed), excess, tokens, groups) for spec in specs}
