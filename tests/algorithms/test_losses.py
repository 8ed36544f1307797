"""Policy/value/entropy losses and loss aggregation: hand-computed cases, gradients, and the proof that
micro-batch and data-parallel splits give the one-big-batch gradient when normalised globally."""

import math

import pytest
import torch

from mindrl.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    count_tokens_and_seqs,
    entropy_from_logits,
    entropy_loss,
    last_valid_index,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    scores_to_token_level,
    value_loss,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ---------------------------------------------------------------- masked ops


def test_masked_ops_hand_computed():
    x, m = t([[1.0, 100.0, 3.0], [5.0, 0.0, -7.0]]), t([[1, 0, 1], [1, 0, 0]])
    assert masked_mean(x, m).item() == pytest.approx(3.0)  # (1 + 3 + 5) / 3
    torch.testing.assert_close(masked_mean(x, m, dim=-1), t([2.0, 5.0]))
    assert masked_var(x, m).item() == pytest.approx(4.0)  # [1, 3, 5] -> unbiased var 4
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(8 / 3)
    w = masked_whiten(x, m)
    torch.testing.assert_close(w, t([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]) / math.sqrt(1 + 0.25e-8), atol=1e-7, rtol=0)
    # degenerate batches never produce NaN
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0
    assert masked_var(x, t([[1, 0, 0], [0, 0, 0]])).item() == 0.0


def test_last_valid_index_and_score_placement_with_gaps():
    mask = t([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert last_valid_index(mask).tolist() == [3, 0, -1]  # row 0: not mask.sum()-1 == 2
    placed = scores_to_token_level(t([2.0, -1.0, 9.0]), mask)
    torch.testing.assert_close(placed, t([[0, 0, 0, 2.0, 0], [-1.0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"scores=\(2,\)"):
        scores_to_token_level(t([1.0, 2.0]), mask)


# ---------------------------------------------------------------- policy loss


def test_policy_loss_hand_computed_clip_and_gradient():
    old = t([[0.0, 0.0, 0.0, 0.0]])
    new = torch.log(t([[1.5, 1.5, 0.5, 1.1]])).requires_grad_(True)
    adv = t([[1.0, -1.0, -1.0, 2.0]])
    mask = t([[1, 1, 1, 0]])
    loss, metrics = policy_loss(old, new, adv, mask)
    # token 0: A=1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); token 1: A=-1, r=1.5 -> max(1.5, 1.2) = 1.5
    # token 2: A=-1, r=.5 -> max(.5, .8) = .8 (clipped); token 3 masked
    assert loss.item() == pytest.approx((-1.2 + 1.5 + 0.8) / 3)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 3)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(-(math.log(1.5) * 2 + math.log(0.5)) / 3)
    loss.backward()
    # only the unclipped valid token carries gradient: d(-A r)/dlogp = -A r / N
    torch.testing.assert_close(new.grad, t([[0.0, 1.5 / 3, 0.0, 0.0]]))


def test_policy_loss_clip_higher_is_asymmetric():
    old, new, adv, mask = t([[0.0]]), torch.log(t([[1.25]])), t([[1.0]]), t([[1]])
    symmetric, _ = policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    higher, m = policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert symmetric.item() == pytest.approx(-1.2)
    assert higher.item() == pytest.approx(-1.25) and m["pg_clipfrac"].item() == 0.0
    low, _ = policy_loss(old, torch.log(t([[0.7]])), t([[-1.0]]), mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert low.item() == pytest.approx(0.8)  # the lower side still clips at 1 - 0.2


def test_policy_loss_dual_clip_caps_negative_advantages_only():
    old = t([[0.0, 0.0]])
    new = torch.log(t([[5.0, 5.0]]))
    adv = t([[-1.0, 1.0]])
    mask = t([[1, 1]])
    loss, metrics = policy_loss(old, new, adv, mask, clip_ratio_c=3.0)
    # A=-1, r=5: max(5, 1.2) = 5, capped at 3; A=+1, r=5: max(-5, -1.2) = -1.2, no cap
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.5)
    plain, _ = policy_loss(old, new, adv, mask)
    assert plain.item() == pytest.approx((5.0 - 1.2) / 2)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(old, new, adv, mask, clip_ratio_c=0.5)


def test_policy_loss_huge_log_ratio_stays_finite():
    loss, _ = policy_loss(t([[0.0]]), t([[500.0]]), t([[-1.0]]), t([[1]]))
    assert math.isfinite(loss.item())


def policy_loss_loop_reference(old, new, adv, mask, low, high, c):
    total, count = 0.0, 0
    for b in range(old.shape[0]):
        for i in range(old.shape[1]):
            if mask[b, i] == 0:
                continue
            r = math.exp(float(new[b, i] - old[b, i]))
            a = float(adv[b, i])
            term = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            if c is not None and a < 0:
                term = min(term, -a * c)
            total += term
            count += 1
    return total / count


@pytest.mark.parametrize("c", [None, 3.0])
def test_policy_loss_matches_loop_reference(c):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.3
    new = old + torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=g) > 0.3).to(torch.float64)
    loss, _ = policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=c)
    assert loss.item() == pytest.approx(policy_loss_loop_reference(old, new, adv, mask, 0.2, 0.3, c))


# ---------------------------------------------------------------- value loss


def test_value_loss_hand_computed():
    vpreds = t([[2.0, 1.2, 9.0]]).requires_grad_(True)
    returns, values, mask = t([[3.0, 1.0, 0.0]]), t([[1.0, 1.0, 0.0]]), t([[1, 1, 0]])
    loss, metrics = value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # token 0: (2-3)^2 = 1 vs (1.5-3)^2 = 2.25 -> 2.25 (clip active); token 1: .04 vs (1.2-1)^2 = .04 -> .04
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.04) / 2)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # clipped token has no gradient; token 1: d/dv .5*(v-R)^2/2 = (1.2-1)/2
    torch.testing.assert_close(vpreds.grad, t([[0.0, 0.1, 0.0]]))
    unclipped, m = value_loss(vpreds, returns, values, mask, cliprange_value=None)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.04) / 2) and m["vf_clipfrac"].item() == 0.0


def test_value_loss_counts_no_token_inside_the_clip_range_as_clipped():
    """Every vpred within cliprange_value of its old value: nothing is clipped, so the clip fraction is exactly 0 and
    the loss and gradient are the unclipped ones. (As V + clamp(v - V), 9e-4 of these tokens rounded to a "clipped"
    term larger than the unclipped one, which a rounding change in the model's GEMMs then flipped.)"""
    g = torch.Generator().manual_seed(0)
    vpreds, returns = torch.randn(4, 25_000, generator=g).requires_grad_(True), torch.randn(4, 25_000, generator=g)
    values = vpreds.detach() + 0.1 * (2 * torch.rand(4, 25_000, generator=g) - 1)
    back = values + (vpreds.detach() - values)
    assert ((back - returns) ** 2 > (vpreds.detach() - returns) ** 2).sum() > 0  # the case exists in this data
    mask = torch.ones(4, 25_000)
    loss, metrics = value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert metrics["vf_clipfrac"].item() == 0.0
    unclipped, _ = value_loss(vpreds, returns, values, mask, cliprange_value=None)
    assert loss.item() == unclipped.item()
    (grad,) = torch.autograd.grad(loss, vpreds)
    (want,) = torch.autograd.grad(unclipped, vpreds)
    assert torch.equal(grad, want)


# ---------------------------------------------------------------- entropy / logprobs


def test_entropy_uniform_and_against_definition():
    assert entropy_from_logits(torch.zeros(2, 3, 4)).allclose(torch.full((2, 3), math.log(4)))
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(logp.exp() * logp).sum(-1))
    labels = torch.randint(0, 11, (3, 5))
    torch.testing.assert_close(logprobs_from_logits(logits, labels), logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1))
    mask = t([[1, 1, 0, 0, 0]] * 3)
    assert entropy_loss(logits, mask).item() == pytest.approx(masked_mean(entropy_from_logits(logits), mask).item())


# ---------------------------------------------------------------- aggregation


def test_agg_modes_hand_computed():
    loss = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row is padding and must not count
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (3 * 2))
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(10 / 20)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token_mean'.*token-mean"):
        agg_loss(loss, mask, "token_mean")


def _grad_of(fn, param):
    param.grad = None
    fn().backward()
    return param.grad.clone()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_invariance_under_micro_batch_and_dp_split(mode):
    g = torch.Generator().manual_seed(1)
    batch, length = 8, 6
    theta = torch.randn(length, dtype=torch.float64, generator=g).requires_grad_(True)
    x = torch.randn(batch, length, dtype=torch.float64, generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.4).to(torch.float64)
    mask[2] = 0  # a sequence without any valid token
    mask[5] = 1  # a long one, so token counts differ a lot between splits

    def loss_mat(rows):
        return (x[rows] * theta) ** 2

    full = _grad_of(lambda: agg_loss(loss_mat(slice(None)), mask, mode), theta)

    num_tokens, num_seqs = count_tokens_and_seqs(mask)
    norm = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs}
    micro = [slice(0, 3), slice(3, 4), slice(4, 8)]
    # gradient accumulation: sum of micro-batch losses, each normalised by the mini-batch totals
    accumulated = _grad_of(lambda: sum(agg_loss(loss_mat(s), mask[s], mode, **norm) for s in micro), theta)
    torch.testing.assert_close(accumulated, full)

    # two data-parallel ranks, uneven micro-batches; the DP all-reduce averages the rank gradients
    ranks = [[slice(0, 1), slice(1, 5)], [slice(5, 8)]]
    rank_grads = [
        _grad_of(lambda r=r: sum(agg_loss(loss_mat(s), mask[s], mode, dp_size=2, **norm) for s in r), theta)
        for r in ranks
    ]
    torch.testing.assert_close(sum(rank_grads) / 2, full)

    # and the test can fail: normalising each micro-batch locally is NOT the same gradient
    local = _grad_of(lambda: sum(agg_loss(loss_mat(s), mask[s], mode) for s in micro) / len(micro), theta)
    assert not torch.allclose(local, full)
