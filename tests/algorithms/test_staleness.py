"""Staleness helpers: the truncated importance ratio against a direct per-token computation in fp64."""

import math

import pytest
import torch

from mindrl.algorithms.staleness import keep_fresh, staleness, truncated_importance_ratio


@pytest.mark.parametrize("threshold", [1.0, 2.0, 5.0])
def test_truncated_ratio_matches_direct_computation(threshold):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 3
    mu = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(4, 9, generator=g) > 0.3).double()
    weights, metrics = truncated_importance_ratio(logp.float(), mu.float(), mask.float(), threshold)
    ratios, truncated = [], 0
    for b in range(4):
        for t in range(9):
            r = math.exp(logp[b, t].item() - mu[b, t].item())
            want = min(r, threshold) if mask[b, t] else 0.0
            # the fp32 inputs' own rounding is the reference gap: the same formula on the fp32-rounded values
            ref32 = min(math.exp(logp[b, t].float().item() - mu[b, t].float().item()), threshold) * mask[b, t].item()
            assert abs(weights[b, t].item() - ref32) <= 1e-6 * max(1.0, ref32)
            assert abs(weights[b, t].item() - want) <= 1e-6 * max(1.0, want) + abs(ref32 - want)
            if mask[b, t]:
                ratios.append(r)
                truncated += r >= threshold
    assert metrics["is_ratio_mean"].item() == pytest.approx(sum(ratios) / len(ratios), rel=1e-6)
    assert metrics["is_truncated_frac"].item() == pytest.approx(truncated / len(ratios), abs=1e-6)


def test_fp64_exact_and_no_gradient():
    logp = torch.tensor([[-0.1, -5.0, -30.0]], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([[-0.2, -1.0, -0.1]], dtype=torch.float64)
    w, _ = truncated_importance_ratio(logp, mu, torch.ones(1, 3, dtype=torch.float64), threshold=2.0)
    assert not w.requires_grad
    assert w[0, 0].item() == pytest.approx(math.exp(0.1), abs=1e-12)
    assert w[0, 1].item() == pytest.approx(math.exp(-4.0), abs=1e-12)
    assert w[0, 2].item() == pytest.approx(math.exp(-20.0), abs=1e-12)  # log-ratio clamped at -20


def test_errors_and_staleness():
    with pytest.raises(ValueError, match="threshold must be positive"):
        truncated_importance_ratio(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        truncated_importance_ratio(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
    v = torch.tensor([5, 4, 2])
    assert staleness(5, v).tolist() == [0, 1, 3]
    assert keep_fresh(5, v, 1).tolist() == [True, True, False]
    with pytest.raises(ValueError, match="newer than the trainer's 3"):
        staleness(3, v)
