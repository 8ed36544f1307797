"""KL estimators, KL in the reward or in the loss, and the KL controllers' update and exact resume."""

import math

import pytest
import torch

from mindrl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    get_advantage_estimator,
    kl_loss,
    kl_penalty,
    scores_to_token_level,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_kl_estimators_hand_computed():
    logp, ref = torch.log(t([[0.5]])), torch.log(t([[0.25]]))
    ln2 = math.log(2)
    for kind in ("kl", "k1"):
        assert kl_penalty(logp, ref, kind).item() == pytest.approx(ln2)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(ln2)
    for kind in ("mse", "k2"):
        assert kl_penalty(logp, ref, kind).item() == pytest.approx(0.5 * ln2**2)
    for kind in ("low_var_kl", "k3"):
        # r = ref/p = 0.5: r - log r - 1 = 0.5 + ln2 - 1
        assert kl_penalty(logp, ref, kind).item() == pytest.approx(0.5 + ln2 - 1)


def test_k3_is_clamped_and_finite():
    # |logp - ref| = 60 either way: r - log r - 1 is ~59 or ~e^60, both clamped to 10; equal log-probs give 0
    logp, ref = t([[0.0, -60.0, 0.0]]), t([[-60.0, 0.0, 0.0]])
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == [[10.0, 10.0, 0.0]]
    # fp32 with a gap where exp would overflow to inf
    assert kl_penalty(t([[0.0]]).float(), t([[-200.0]]).float(), "k3").item() == 10.0
    assert kl_penalty(t([[-200.0]]).float(), t([[0.0]]).float(), "k3").item() == 10.0


def test_unknown_kl_kind():
    with pytest.raises(ValueError, match="unknown KL penalty kind 'lowvar_kl'.*did you mean 'low_var_kl'"):
        kl_penalty(t([[0.0]]), t([[0.0]]), "lowvar_kl")


def test_kl_in_reward_penalises_every_valid_token_and_keeps_score_on_last():
    mask = t([[1, 0, 1, 0], [1, 1, 1, 1]])
    scores = scores_to_token_level(t([1.0, -1.0]), mask)
    logp = t([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0.5]])
    ref = torch.zeros_like(logp)
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.5, kind="kl")
    torch.testing.assert_close(rewards, t([[-0.05, 0.0, 1.0 - 0.15, 0.0], [-0.25, -0.25, -0.25, -1.0 - 0.25]]))
    # per-sequence mean KL: row 0 (.1+.3)/2 = .2, row 1 .5; batch mean .35
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.35)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    # GRPO's row-sum score then sees score - coef * sum(KL) over valid tokens only
    adv, _ = get_advantage_estimator("group_norm")(rewards, mask, [0, 0], norm_adv_by_std=False)
    row_sums = [1.0 - 0.5 * 0.4, -1.0 - 0.5 * 2.0]
    mean = sum(row_sums) / 2
    torch.testing.assert_close(adv[:, 0], t([row_sums[0] - mean, row_sums[1] - mean]))


def test_kl_in_loss_is_aggregated_k3():
    logp, ref, mask = t([[0.0, 0.0, 5.0]]), torch.log(t([[0.5, 1.0, 1.0]])), t([[1, 1, 0]])
    expected = ((0.5 - math.log(0.5) - 1) + 0.0) / 2
    assert kl_loss(logp, ref, mask).item() == pytest.approx(expected)
    assert kl_loss(logp, ref, mask, kind="k1").item() == pytest.approx(-math.log(0.5) / 2)


def test_adaptive_controller_hand_computed():
    ctrl = AdaptiveKLController(value=0.1, kl_target=0.01, kl_horizon=100)
    ctrl.update(current_kl=0.02, n_steps=10)  # error clipped to +.2: x (1 + .2 * 10/100)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.009, n_steps=10)  # error -.1: x (1 - .1 * 10/100)
    assert ctrl.value == pytest.approx(0.102 * 0.99)
    fixed = FixedKLController(0.05)
    fixed.update(1.0, 100)
    assert fixed.value == 0.05


def test_controller_resume_is_exact():
    ctrl = build_kl_controller("adaptive", init_kl_coef=0.2, kl_target=0.05, kl_horizon=1000)
    for kl in (0.01, 0.2, 0.07):
        ctrl.update(kl, 64)
    state = ctrl.state_dict()
    resumed = build_kl_controller("adaptive", init_kl_coef=0.2, kl_target=0.05, kl_horizon=1000)
    resumed.load_state_dict(state)
    assert resumed.value == ctrl.value != 0.2
    for kl in (0.03, 0.09):
        ctrl.update(kl, 64)
        resumed.update(kl, 64)
    assert resumed.value == ctrl.value
    with pytest.raises(ValueError, match="kl_ctrl_type changed"):
        build_kl_controller("fixed").load_state_dict(state)


def test_controller_config_errors():
    with pytest.raises(ValueError, match="requires rl_config.kl_target and rl_config.kl_horizon"):
        build_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="kl_target > 0"):
        AdaptiveKLController(0.1, kl_target=0.0, kl_horizon=10)
    with pytest.raises(ValueError, match="unknown KL controller 'adaptve'.*did you mean 'adaptive'"):
        build_kl_controller("adaptve")
