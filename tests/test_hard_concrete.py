"""Hard Concrete gates, the Lagrangian, the warm-up target and exact-budget binarisation, against hand math."""

from __future__ import annotations

import math

import pytest
import torch

from masks.hard_concrete import HardConcrete, Lagrangian, binarise, budget, warmup_target

BETA, GAMMA, ZETA = 2 / 3, -0.1, 1.1


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _gates(values: list[float]) -> HardConcrete:
    g = HardConcrete(len(values))
    with torch.no_grad():
        g.log_alpha.copy_(torch.tensor(values))
    return g


def test_expected_l0_matches_hand_formula():
    values = [0.0, 2.0, -1.0]
    # beta * log(-gamma / zeta) = 2/3 * log(1/11) = -1.598597
    expected = sum(_sigmoid(v + 1.598597) for v in values)  # 0.831824 + 0.973367 + 0.645339
    assert expected == pytest.approx(2.450530, abs=1e-5)
    g = _gates(values)
    assert g.expected_l0().item() == pytest.approx(expected, abs=1e-5)
    assert g.expected_skip().item() == pytest.approx(1 - expected / 3, abs=1e-5)


def test_deterministic_gate_hand_values_and_clamp():
    # sigmoid(0)=0.5 -> 0.5*1.2-0.1 = 0.5; sigmoid(log 3)=0.75 -> 0.8; +-10 clamp to 1 and 0.
    g = _gates([0.0, math.log(3), 10.0, -10.0])
    assert g.deterministic().tolist() == pytest.approx([0.5, 0.8, 1.0, 0.0], abs=1e-6)


def test_init_keeps_every_block():
    g = HardConcrete(60)
    assert torch.equal(g.deterministic(), torch.ones(60))
    assert g.expected_skip().item() < 0.05


def test_samples_are_clamped_with_mass_on_zero_and_one():
    g = _gates([0.0])
    z = g.sample(200_000, torch.Generator().manual_seed(0)).squeeze(1).detach()
    assert float(z.min()) == 0.0 and float(z.max()) == 1.0
    # P(z > 0) = sigmoid(log_alpha - beta*log(-gamma/zeta)) = 0.831824;
    # P(z = 1) = sigmoid(log_alpha - beta*log((1-gamma)/(zeta-1))) = sigmoid(-2/3*log 11) = 0.168176.
    assert float((z > 0).float().mean()) == pytest.approx(0.831824, abs=0.005)
    assert float((z == 1).float().mean()) == pytest.approx(0.168176, abs=0.005)


def test_sample_is_seeded_and_differentiable():
    g = _gates([0.5, -0.5, 1.0])
    a = g.sample(4, torch.Generator().manual_seed(3))
    b = g.sample(4, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (4, 3)
    g.sample(64, torch.Generator().manual_seed(1)).sum().backward()
    assert g.log_alpha.grad is not None and bool((g.log_alpha.grad > 0).all())


def test_lagrangian_value_and_ascent():
    lag = Lagrangian()
    with torch.no_grad():
        lag.lambdas.copy_(torch.tensor([2.0, 3.0]))
    # 2 * (0.3 - 0.1) + 3 * (0.3 - 0.1)^2 = 0.52
    assert lag(torch.tensor(0.3), 0.1).item() == pytest.approx(0.52)
    opt = torch.optim.SGD(lag.parameters(), lr=1.0, maximize=True)
    lag(torch.tensor(0.0), 0.25).backward()  # skipping too little: lambda1 must fall, lambda2 rise
    opt.step()
    assert lag.lambdas.tolist() == pytest.approx([2.0 - 0.25, 3.0 + 0.0625])


def test_warmup_target_is_linear_then_flat():
    assert warmup_target(0, 10, 0.25) == 0.0
    assert warmup_target(4, 10, 0.25) == pytest.approx(0.1)
    assert warmup_target(10, 10, 0.25) == 0.25
    assert warmup_target(37, 10, 0.25) == 0.25
    assert warmup_target(0, 0, 0.25) == 0.25


@pytest.mark.parametrize("blocks,sparsity,keep", [(60, 0.25, 45), (60, 0.125, 52), (8, 0.25, 6), (8, 0.5, 4),
                                                  (10, 0.0, 10)])
def test_binarise_hits_the_exact_budget(blocks, sparsity, keep):
    assert budget(blocks, sparsity) == keep
    gen = torch.Generator().manual_seed(blocks)
    for _ in range(20):
        scores = torch.randn(blocks, generator=gen)
        mask = binarise(scores, sparsity)
        assert mask.dtype == torch.bool and int(mask.sum()) == keep
        if 0 < keep < blocks:
            assert float(scores[mask].min()) > float(scores[~mask].max())


def test_binarise_ties_keep_the_earlier_block():
    scores = torch.tensor([5.0, 1.0, 1.0, 1.0, -2.0, 1.0])  # keep round(0.5 * 6) = 3
    assert binarise(scores, 0.5).tolist() == [True, True, True, False, False, False]


def test_budget_rejects_bad_sparsity():
    with pytest.raises(ValueError, match="sparsity"):
        budget(60, 1.0)
