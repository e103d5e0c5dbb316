"""Seeded spherical k-means recovers planted clusters, and nearest-centroid routing sends new points home."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from masks.cluster import assign, kmeans, summarise


def _planted(k: int = 5, per: int = 40, dim: int = 24, noise: float = 0.15, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    centers = F.normalize(torch.randn(k, dim, generator=gen), dim=1)
    labels = torch.arange(k).repeat_interleave(per)
    points = F.normalize(centers[labels] + noise * torch.randn(k * per, dim, generator=gen), dim=1)
    perm = torch.randperm(k * per, generator=gen)
    return centers, points[perm], labels[perm]


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b group the points identically (up to renaming the clusters)."""
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_kmeans_recovers_planted_clusters():
    centers, x, truth = _planted()
    centroids, labels = kmeans(x, 5, seed=0)
    assert _same_partition(labels, truth)
    assert torch.allclose(centroids.norm(dim=1), torch.ones(5), atol=1e-5)
    # Each found centroid sits on one planted center.
    assert bool(((centroids @ centers.T).max(1).values > 0.95).all())


def test_kmeans_is_seeded():
    _, x, _ = _planted(seed=1)
    a = kmeans(x, 5, seed=7)
    b = kmeans(x, 5, seed=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_routing_sends_fresh_points_to_their_planted_cluster():
    centers, x, truth = _planted(seed=2)
    centroids, labels = kmeans(x, 5, seed=0)
    assert torch.equal(assign(x, centroids), labels)
    rename = {t: l for t, l in zip(truth.tolist(), labels.tolist())}
    gen = torch.Generator().manual_seed(9)
    fresh_truth = torch.arange(5).repeat(10)
    fresh = centers[fresh_truth] + 0.15 * torch.randn(50, centers.shape[1], generator=gen)  # not normalised
    assert assign(fresh, centroids).tolist() == [rename[t] for t in fresh_truth.tolist()]


def test_kmeans_never_returns_an_empty_cluster():
    x = F.normalize(torch.tensor([[1.0, 0.0]] * 6 + [[0.0, 1.0]] * 2 + [[0.7, 0.7]]), dim=1)
    _, labels = kmeans(x, 3, seed=0)
    assert sorted(torch.bincount(labels, minlength=3).tolist()) == [1, 2, 6]


def test_summarise_sizes_and_examples():
    labels = torch.tensor([1, 0, 1, 1])
    texts = ["a  b", "c", "d\ne", "f"]
    out = summarise(labels, texts, 3, examples=2)
    assert [c["size"] for c in out] == [1, 3, 0]
    assert out[1]["examples"] == ["a b", "d e"]
    assert out[2]["examples"] == []
