"""Seeded spherical k-means (k-means++ init) over L2-normalised embeddings, and nearest-centroid assignment.

Embeddings and centroids live on the unit sphere and points go to the centroid of highest cosine
similarity, the same rule the online router uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (cosine) for each row of ``x``."""
    return (F.normalize(x.float(), dim=1) @ F.normalize(centroids.float(), dim=1).T).argmax(1)


def _kmeans_pp(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding with cosine distance 1 - cos."""
    picks = [int(torch.randint(len(x), (1,), generator=gen))]
    dist = 1.0 - x @ x[picks[0]]
    for _ in range(1, k):
        weights = dist.clamp_min(0) ** 2
        idx = int(torch.multinomial(weights, 1, generator=gen)) if weights.sum() > 0 else \
            int(torch.randint(len(x), (1,), generator=gen))
        picks.append(idx)
        dist = torch.minimum(dist, 1.0 - x @ x[idx])
    return x[picks].clone()


def kmeans(x: torch.Tensor, k: int, seed: int = 0, iters: int = 100, restarts: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [k, d] unit-norm, labels [n]) of the best of ``restarts`` seeded runs (highest total cosine).

    An emptied cluster is re-seeded with the point farthest from its centroid.
    """
    x = F.normalize(x.float(), dim=1)
    if not 1 <= k <= len(x):
        raise ValueError(f"cannot make {k} clusters from {len(x)} points")
    gen = torch.Generator().manual_seed(seed)
    best: tuple[float, torch.Tensor, torch.Tensor] | None = None
    for _ in range(restarts):
        centroids = _kmeans_pp(x, k, gen)
        labels = torch.full((len(x),), -1, dtype=torch.long)
        for _ in range(iters):
            sims = x @ centroids.T
            new = sims.argmax(1)
            for c in range(k):
                if not (new == c).any():  # re-seed an empty cluster
                    far = int(sims.max(1).values.argmin())
                    new[far] = c
                    sims[far] = 2.0  # taken: not the farthest point any more
            if torch.equal(new, labels):
                break
            labels = new
            sums = torch.zeros_like(centroids).index_add_(0, labels, x)
            centroids = F.normalize(sums, dim=1)
        score = float((x * centroids[labels]).sum())
        if best is None or score > best[0] + 1e-9:
            best = (score, centroids, labels)
    return best[1], best[2]


def summarise(labels: torch.Tensor, texts: list[str], k: int, examples: int = 3, chars: int = 160) -> list[dict]:
    """Per cluster: size and the first ``examples`` member texts (shortened to ``chars``)."""
    out = []
    for c in range(k):
        members = (labels == c).nonzero().squeeze(1).tolist()
        out.append({"size": len(members),
                    "examples": [" ".join(texts[i].split())[:chars] for i in members[:examples]]})
    return out
