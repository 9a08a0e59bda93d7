"""Weighted one-dimensional k-means: the non-uniform codebooks of KVQuant, weighted by Fisher information.

Owns the clustering only; what the samples and weights are is `kvquant`'s business.
"""

from __future__ import annotations

import torch


def weighted_kmeans_1d(
    values: torch.Tensor, weights: torch.Tensor, num_centroids: int, iterations: int = 60
) -> torch.Tensor:
    """Centroids minimising sum(weight * (value - nearest centroid)^2), ascending, fp32 [num_centroids].

    Deterministic: starts from the weighted quantiles (i + 0.5) / num_centroids, then Lloyd iterations (assign each
    value to its nearest centroid, move each centroid to its cluster's weighted mean) until nothing moves. A cluster
    left empty keeps its centroid.

    Args:
        values, weights: 1-D, the same length (at least 1); weights >= 0, not all zero.
    Raises:
        ValueError: shapes differ, no samples, negative or all-zero weights, num_centroids < 1.
    """
    if values.dim() != 1 or values.shape != weights.shape or values.numel() == 0:
        raise ValueError("values and weights must be 1-D tensors of the same, non-zero length")
    if num_centroids < 1:
        raise ValueError(f"num_centroids must be >= 1, got {num_centroids}")
    values, weights = values.double(), weights.double()
    if bool((weights < 0).any()) or float(weights.sum()) <= 0:
        raise ValueError("weights must be non-negative and not all zero")
    order = values.argsort()
    values, weights = values[order], weights[order]
    cumulative = weights.cumsum(0) / weights.sum()
    targets = (torch.arange(num_centroids, dtype=torch.float64) + 0.5) / num_centroids
    centroids = values[torch.searchsorted(cumulative, targets).clamp_max(values.numel() - 1)]
    for _ in range(iterations):
        midpoints = (centroids[1:] + centroids[:-1]) / 2
        assignment = torch.bucketize(values, midpoints)
        mass = torch.zeros(num_centroids, dtype=torch.float64).index_add_(0, assignment, weights)
        moment = torch.zeros(num_centroids, dtype=torch.float64).index_add_(0, assignment, weights * values)
        updated = torch.where(mass > 0, moment / mass.clamp_min(1e-300), centroids).sort().values
        if torch.equal(updated, centroids):
            break
        centroids = updated
    return centroids.float()


def weighted_error(values: torch.Tensor, weights: torch.Tensor, centroids: torch.Tensor) -> float:
    """sum(weight * (value - nearest centroid)^2) / sum(weight): the objective `weighted_kmeans_1d` lowers."""
    midpoints = (centroids[1:] + centroids[:-1]) / 2
    nearest = centroids[torch.bucketize(values.float().contiguous(), midpoints)]
    return float((weights * (values - nearest) ** 2).sum() / weights.sum())
