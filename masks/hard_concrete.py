"""Hard Concrete gates (Louizos et al. 2018), their Lagrangian sparsity control, and exact-budget binarisation.

A gate z in [0, 1] per block: u ~ U(0, 1), s = sigmoid((log u - log(1 - u) + log_alpha) / beta),
z = clamp(s * (zeta - gamma) + gamma, 0, 1). The stretch past [0, 1] puts real probability mass on
exactly 0 and exactly 1, so a sampled gate can switch a block fully off (and the runner skips it).
"""

from __future__ import annotations

import math

import torch

BETA = 2.0 / 3.0
GAMMA = -0.1
ZETA = 1.1
# sigmoid(2.5) * (ZETA - GAMMA) + GAMMA = 1.009: every block starts with deterministic gate 1 (kept).
INIT_LOG_ALPHA = 2.5


class HardConcrete(torch.nn.Module):
    """``n`` independent Hard Concrete gates with trainable ``log_alpha``."""

    def __init__(self, n: int, init_log_alpha: float = INIT_LOG_ALPHA):
        super().__init__()
        self.log_alpha = torch.nn.Parameter(torch.full((n,), float(init_log_alpha)))

    def sample(self, rows: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Stochastic gates [rows, n], one independent draw per row (reparameterised, differentiable)."""
        u = torch.rand(rows, self.log_alpha.numel(), generator=generator).clamp(1e-6, 1 - 1e-6)
        s = torch.sigmoid((u.log() - (-u).log1p() + self.log_alpha) / BETA)
        return (s * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)

    def deterministic(self) -> torch.Tensor:
        """Test-time gate per block: clamp(sigmoid(log_alpha) * (zeta - gamma) + gamma, 0, 1)."""
        return (torch.sigmoid(self.log_alpha) * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)

    def expected_l0(self) -> torch.Tensor:
        """Expected number of non-zero gates: sum of P(z != 0) = sigmoid(log_alpha - beta * log(-gamma / zeta))."""
        return torch.sigmoid(self.log_alpha - BETA * math.log(-GAMMA / ZETA)).sum()

    def expected_skip(self) -> torch.Tensor:
        """Expected fraction of gates that are exactly 0."""
        return 1.0 - self.expected_l0() / self.log_alpha.numel()


class Lagrangian(torch.nn.Module):
    """lambda1 * (skip - t) + lambda2 * (skip - t)^2; train the lambdas with gradient *ascent*."""

    def __init__(self):
        super().__init__()
        self.lambdas = torch.nn.Parameter(torch.zeros(2))

    def forward(self, skip: torch.Tensor, target: float) -> torch.Tensor:
        gap = skip - target
        return self.lambdas[0] * gap + self.lambdas[1] * gap * gap


def warmup_target(step: int, warmup_steps: int, sparsity: float) -> float:
    """Target skip ratio at ``step``: linear from 0 to ``sparsity`` over ``warmup_steps``, then flat."""
    if warmup_steps <= 0:
        return sparsity
    return sparsity * min(1.0, step / warmup_steps)


def budget(num_blocks: int, sparsity: float) -> int:
    """Blocks a mask at this sparsity keeps: round((1 - s) * B)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    return round((1.0 - sparsity) * num_blocks)


def binarise(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Bool mask keeping the ``budget`` blocks of highest score; equal scores keep the earlier block.

    For gates pass log_alpha: the deterministic gate is a clamped, increasing function of it, so
    this keeps the blocks with the largest deterministic gate and breaks the ties among gates
    clamped to 0 or 1 by the unclamped value.
    """
    keep = budget(scores.numel(), sparsity)
    order = torch.sort(scores.detach().cpu(), descending=True, stable=True).indices
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[order[:keep]] = True
    return mask
