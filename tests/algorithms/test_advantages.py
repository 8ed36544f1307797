"""Advantage estimators: hand-computed cases, loop references against the vectorised code, masks with
gaps, groups of size 1, and the registry's error messages."""

import math
import statistics

import pytest
import torch

from mindrl.algorithms import (
    get_advantage_estimator,
    list_advantage_estimators,
    masked_whiten,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def whiten_list(xs):
    mean = statistics.fmean(xs)
    var = statistics.variance(xs) if len(xs) > 1 else 0.0
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


# ---------------------------------------------------------------- GAE


def test_gae_hand_computed_full_mask():
    gae = get_advantage_estimator("gae")
    rewards, values, mask = t([[1.0, 0.0, 2.0]]), t([[1.0, 2.0, 3.0]]), t([[1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # by hand: delta_2 = -1, A_2 = -1; delta_1 = 0 + .5*3 - 2 = -.5, A_1 = -.5 + .25*-1 = -.75;
    # delta_0 = 1 + .5*2 - 1 = 1, A_0 = 1 + .25*-.75 = .8125; returns = A + V
    raw = [0.8125, -0.75, -1.0]
    torch.testing.assert_close(ret, t([[1.8125, 1.25, 2.0]]))
    torch.testing.assert_close(adv, t([whiten_list(raw)]))


def test_gae_mask_gap_skips_the_masked_token():
    gae = get_advantage_estimator("gae")
    # the middle token is a tool token: its reward and value must be ignored entirely
    rewards, values, mask = t([[1.0, 5.0, 2.0]]), t([[1.0, 9.0, 3.0]]), t([[1, 0, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # GAE on the compressed sequence rewards [1, 2], values [1, 3]: A_1 = -1; A_0 = 1 + .5*3 - 1 + .25*-1 = 1.25
    torch.testing.assert_close(ret, t([[2.25, 0.0, 2.0]]))
    torch.testing.assert_close(adv, t([[whiten_list([1.25, -1.0])[0], 0.0, whiten_list([1.25, -1.0])[1]]]))


def gae_loop_reference(rewards, values, mask, gamma, lam):
    """Per row, drop the masked positions, run textbook GAE, scatter back; whiten over all valid tokens."""
    batch, length = rewards.shape
    raw = [[0.0] * length for _ in range(batch)]
    ret = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        idx = [i for i in range(length) if mask[b, i] > 0]
        r = [float(rewards[b, i]) for i in idx]
        v = [float(values[b, i]) for i in idx]
        a = [0.0] * len(idx)
        last = 0.0
        for k in reversed(range(len(idx))):
            next_v = v[k + 1] if k + 1 < len(idx) else 0.0
            last = r[k] + gamma * next_v - v[k] + gamma * lam * last
            a[k] = last
        for k, i in enumerate(idx):
            raw[b][i] = a[k]
            ret[b][i] = a[k] + v[k]
    flat = [raw[b][i] for b in range(batch) for i in range(length) if mask[b, i] > 0]
    white = iter(whiten_list(flat))
    adv = [[next(white) if mask[b, i] > 0 else 0.0 for i in range(length)] for b in range(batch)]
    return t(adv), t(ret)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_loop_reference_with_gappy_masks(seed):
    g = torch.Generator().manual_seed(seed)
    batch, length = 6, 9
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64)
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=g) > 0.35).to(torch.float64)
    mask[0] = 0  # an empty row
    mask[1] = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1, 0], dtype=torch.float64)  # gaps, then right padding
    adv, ret = get_advantage_estimator("gae")(rewards, values, mask, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = gae_loop_reference(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


def test_gae_accepts_bool_mask_and_rejects_shape_mismatch():
    gae = get_advantage_estimator("gae")
    r, v = torch.zeros(2, 3), torch.ones(2, 3)
    adv, _ = gae(r, v, torch.ones(2, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    assert adv.shape == (2, 3)
    with pytest.raises(ValueError, match=r"values=\(2, 4\)"):
        gae(r, torch.ones(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)


# ---------------------------------------------------------------- group estimators


def test_group_norm_hand_computed_and_group_of_one():
    rewards = t([[0, 0, 1], [0, 0, 0], [0, 1, 0], [0, 0, 5]])  # scores: row sums 1, 0, 1, 5
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    adv, ret = get_advantage_estimator("group_norm")(rewards, mask, ["a", "a", "a", "b"])
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1]
    per_row = [(1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6), (1 - 2 / 3) / (std + 1e-6), 0.0]
    torch.testing.assert_close(adv, t(per_row).unsqueeze(-1) * mask)
    torch.testing.assert_close(ret, adv)
    assert adv[3].abs().sum() == 0, "a group of size 1 must get advantage 0"


def test_group_norm_dr_grpo_does_not_divide_by_std():
    rewards, mask = t([[1.0], [0.0], [1.0], [3.0]]), t([[1], [1], [1], [1]])
    adv, _ = get_advantage_estimator("group_norm")(rewards, mask, torch.tensor([7, 7, 7, 9]), norm_adv_by_std=False)
    torch.testing.assert_close(adv, t([[1 / 3], [-2 / 3], [1 / 3], [0.0]]))


def test_group_norm_identical_scores_give_zero_not_nan():
    adv, _ = get_advantage_estimator("group_norm")(t([[1.0], [1.0]]), t([[1], [1]]), [0, 0])
    assert torch.equal(adv, t([[0.0], [0.0]]))


def group_loop_reference(scores, index, fn):
    out = []
    for i, s in enumerate(scores):
        peers = [scores[j] for j in range(len(scores)) if index[j] == index[i]]
        out.append(0.0 if len(peers) == 1 else fn(s, peers))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_group_estimators_match_loop_reference(seed):
    g = torch.Generator().manual_seed(seed)
    batch, length = 12, 5
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=g) > 0.3).to(torch.float64)
    rewards = rewards * mask
    index = [int(x) for x in torch.randint(0, 4, (batch,), generator=g)] + []
    index[-1] = 99  # guarantee one singleton group
    scores = rewards.sum(-1).tolist()

    def grpo(s, peers):
        return (s - statistics.fmean(peers)) / (statistics.stdev(peers) + 1e-6)

    def rloo(s, peers):
        others = list(peers)
        others.remove(s)
        return s - statistics.fmean(others)

    adv, _ = get_advantage_estimator("group_norm")(rewards, mask, index)
    torch.testing.assert_close(adv, t(group_loop_reference(scores, index, grpo)).unsqueeze(-1) * mask)
    adv, _ = get_advantage_estimator("rloo")(rewards, mask, index)
    torch.testing.assert_close(adv, t(group_loop_reference(scores, index, rloo)).unsqueeze(-1) * mask)
    adv, _ = get_advantage_estimator("reinforce_plus_plus_baseline")(rewards, mask, index)
    centred = group_loop_reference(scores, index, lambda s, peers: s - statistics.fmean(peers))
    torch.testing.assert_close(adv, masked_whiten(t(centred).unsqueeze(-1) * mask, mask))


def test_rloo_hand_computed():
    rewards, mask = t([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [4.0, 0.0]]), t([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv, ret = get_advantage_estimator("rloo")(rewards, mask, [0, 0, 0, 1])
    # row 0: 1 - mean(0, 1) = .5; row 1: 0 - mean(1, 1) = -1; row 2: .5; row 3 alone: 0
    torch.testing.assert_close(adv, t([[0.5, 0.5], [-1.0, 0.0], [0.5, 0.5], [0.0, 0.0]]))
    torch.testing.assert_close(ret, adv)


def test_reinforce_plus_plus_baseline_hand_computed():
    rewards, mask = t([[2.0], [0.0], [5.0]]), t([[1], [1], [1]])
    adv, _ = get_advantage_estimator("reinforce_plus_plus_baseline")(rewards, mask, ["p", "p", "q"])
    # centred: [1, -1, 0] (singleton -> 0); whitened over 3 tokens: mean 0, unbiased var 1
    torch.testing.assert_close(adv, t([[1 / math.sqrt(1 + 1e-8)], [-1 / math.sqrt(1 + 1e-8)], [0.0]]))


def test_index_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="index has 2 entries but the batch has 3 rows"):
        get_advantage_estimator("group_norm")(torch.zeros(3, 2), torch.ones(3, 2), [0, 1])


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_hand_computed_with_gap():
    rpp = get_advantage_estimator("reinforce_plus_plus")
    _, ret = rpp(t([[0.0, 0.0, 1.0]]), t([[1, 1, 1]]), gamma=0.5)
    torch.testing.assert_close(ret, t([[0.25, 0.5, 1.0]]))
    adv, ret = rpp(t([[0.0, 7.0, 1.0], [3.0, 0.0, 0.0]]), t([[1, 0, 1], [1, 0, 0]]), gamma=0.5)
    torch.testing.assert_close(ret, t([[0.5, 0.0, 1.0], [3.0, 0.0, 0.0]]))
    white = whiten_list([0.5, 1.0, 3.0])
    torch.testing.assert_close(adv, t([[white[0], 0.0, white[1]], [white[2], 0.0, 0.0]]))


# ---------------------------------------------------------------- registry


def test_registry_lists_all_estimators():
    assert set(list_advantage_estimators()) >= {
        "gae",
        "group_norm",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
    }


def test_unknown_estimator_names_known_and_close_matches():
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("group_nrom")
    msg = str(err.value)
    assert "'group_nrom'" in msg and "rl_config.adv_estimator" in msg
    assert "known: gae, group_norm" in msg and "did you mean 'group_norm'" in msg
