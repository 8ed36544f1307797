"""DAPO's overlong penalty and the dynamic-sampling group filter against loop references; GSPO's loss and the
Dr.GRPO pieces (std-free group advantages, the constant-length aggregation) against independent float64 loops."""

import math

import pytest
import torch

from mindrl.algorithms import (
    agg_loss,
    compute_grpo_outcome_advantage,
    count_tokens_and_seqs,
    gspo_policy_loss,
    keep_groups,
    overlong_penalty,
)


def _ref_overlong(length, max_tokens, buffer, factor):
    expected = max_tokens - buffer
    exceed = min(length - expected, buffer)
    return min(-exceed / buffer * factor, 0.0)


@pytest.mark.parametrize("max_tokens, buffer, factor", [(20, 8, 1.0), (2048, 512, 1.0), (64, 1, 0.1)])
def test_overlong_penalty_matches_the_definition(max_tokens, buffer, factor):
    lengths = torch.arange(0, max_tokens + 3)
    got = overlong_penalty(lengths, max_tokens, buffer, factor)
    want = torch.tensor([_ref_overlong(int(n), max_tokens, buffer, factor) for n in lengths], dtype=torch.float64)
    assert torch.equal(got, want)
    assert got[max_tokens - buffer] == 0 and got[max_tokens] == -factor


def test_overlong_penalty_rejects_a_buffer_outside_the_range():
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([1]), 8, 8)


def test_keep_groups_drops_groups_that_all_score_the_same():
    metric = torch.tensor([1.0, 1, 1, 1, -1, 1, 1, 1, -1, -1, -1, -1, 0.1, 0.1, 0.1, 0.1])
    assert keep_groups(metric, 4).tolist() == [False, True, False, False]
    # 3 copies of 0.1 have a float std that is not 0 under some summation orders; equality is what counts
    assert keep_groups(torch.tensor([0.1, 0.1, 0.1]), 3).tolist() == [False]
    assert keep_groups(torch.tensor([0.0, 0.0]), 1).tolist() == [True, True]  # one sample: kept (MindSpeed-RL)
    with pytest.raises(ValueError):
        keep_groups(metric, 3)


# ------------------------------------------------------------------------------------------ Dr.GRPO
def test_dr_grpo_advantages_are_score_minus_group_mean():
    torch.manual_seed(0)
    scores = torch.randn(12, dtype=torch.float64)
    mask = (torch.rand(12, 7) > 0.3).double()
    mask[:, 0] = 1
    rewards = torch.zeros(12, 7, dtype=torch.float64)
    last = (mask * torch.arange(7)).argmax(-1)
    rewards[torch.arange(12), last] = scores
    index = [i // 4 for i in range(12)]
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std=False)
    for i in range(12):
        group = [scores[j].item() for j in range(12) if index[j] == index[i]]
        want = scores[i].item() - sum(group) / len(group)
        assert torch.allclose(adv[i], want * mask[i], atol=1e-12)


def test_constant_length_normalisation_is_token_sum_over_a_constant():
    torch.manual_seed(1)
    loss_mat = torch.randn(6, 9, dtype=torch.float64)
    mask = (torch.rand(6, 9) > 0.4).double()
    mask[:, 0] = 1
    want = sum((loss_mat[i] * mask[i]).sum().item() / 32 for i in range(6)) / 6
    got = agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=32)
    assert abs(got.item() - want) <= 1e-12
    # split in micro-batches with the global counts it adds up to the same
    tokens, seqs = count_tokens_and_seqs(mask)
    parts = sum(
        agg_loss(loss_mat[s], mask[s], "seq-mean-token-sum-norm", global_num_seqs=seqs, loss_scale_factor=32)
        for s in (slice(0, 2), slice(2, 6))
    )
    assert abs(parts.item() - want) <= 1e-12


# ------------------------------------------------------------------------------------------ GSPO
def _gspo_reference(old, new, adv, mask, low, high):
    """GSPO's objective written from the paper, response by response, in float64: s_i = exp(mean_t(new - old)),
    loss = mean_i max(-A_i s_i, -A_i clip(s_i, 1 - low, 1 + high)). `new` may require grad."""
    losses = []
    for i in range(new.shape[0]):
        m = mask[i].bool()
        if not m.any():
            continue
        s = torch.exp((new[i][m] - old[i][m]).mean())
        a = adv[i][m][0]
        losses.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - low, 1 + high)))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("low, high", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_loss_and_gradient_match_the_paper(low, high):
    torch.manual_seed(2)
    rows, length = 8, 11
    mask = (torch.rand(rows, length) > 0.3).double()
    mask[:, 0] = 1
    mask[3] = 0  # a response without tokens does not count
    old = -torch.rand(rows, length, dtype=torch.float64) * 2
    new = (old + 0.02 * torch.randn(rows, length, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(rows, 1, dtype=torch.float64).expand(rows, length) * mask
    loss, metrics = gspo_policy_loss(old, new, adv, mask, low, high)
    (grad,) = torch.autograd.grad(loss, new)
    new_ref = new.detach().clone().requires_grad_()
    ref = _gspo_reference(old, new_ref, adv, mask, low, high)
    (grad_ref,) = torch.autograd.grad(ref, new_ref)
    assert abs(loss.item() - ref.item()) <= 1e-6
    assert (grad - grad_ref).abs().max().item() <= 1e-6
    if low < 0.01:  # the tiny clip range clips some responses here
        assert 0 < metrics["pg_clipfrac"].item() < 1


def test_gspo_micro_batches_add_up_to_the_whole_batch():
    torch.manual_seed(3)
    mask = (torch.rand(6, 5) > 0.3).double()
    mask[:, 0] = 1
    old = -torch.rand(6, 5, dtype=torch.float64)
    new = old + 0.1 * torch.randn(6, 5, dtype=torch.float64)
    adv = torch.randn(6, 1, dtype=torch.float64).expand(6, 5) * mask
    whole, _ = gspo_policy_loss(old, new, adv, mask, 0.2, 0.2)
    _, seqs = count_tokens_and_seqs(mask)
    parts = sum(
        gspo_policy_loss(old[s], new[s], adv[s], mask[s], 0.2, 0.2, global_num_seqs=seqs)[0]
        for s in (slice(0, 1), slice(1, 6))
    )
    assert math.isclose(parts.item(), whole.item(), abs_tol=1e-12)
