"""KL estimators between policy and reference, their two placements (reward or loss), and KL controllers.
Controllers hold the only state in this package, with state_dict/load_state_dict for exact resume."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindrl.algorithms.losses import agg_loss
from mindrl.algorithms.masked import check_same_shape, masked_mean
from mindrl.algorithms.registry import unknown_name_message

KL_PENALTY_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3).

    log_prob, ref_log_prob: (batch, response_length). Returns the same shape, unmasked.
      kl / k1      log_prob - ref_log_prob (unbiased, high variance, can be negative)
      abs          |log_prob - ref_log_prob|
      mse / k2     0.5 * (log_prob - ref_log_prob)^2
      low_var_kl / k3  exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]
    """
    check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
    diff = log_prob - ref_log_prob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        # clamp the exponent too: exp(>~88) is inf in fp32 and inf - inf would leak a NaN past the final clamp
        log_ratio = (-diff).clamp(min=-20.0, max=20.0)
        return (torch.exp(log_ratio) - log_ratio - 1).clamp(min=-10.0, max=10.0)
    raise ValueError(unknown_name_message("KL penalty kind", "rl_config.kl_penalty", kind, KL_PENALTY_KINDS))


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward (`use_kl_in_reward`): rewards = scores - kl_coef * KL on every valid token.

    token_level_scores: (batch, response_length), the sequence score on the last valid token (see
    `scores_to_token_level`); log_prob, ref_log_prob, response_mask: same shape.
    Returns token_level_rewards and metrics: actor/reward_kl_penalty (batch mean of the per-sequence
    mean KL; feed it to the KL controller's update) and actor/reward_kl_penalty_coeff.
    """
    check_same_shape(
        token_level_scores=token_level_scores, log_prob=log_prob, ref_log_prob=ref_log_prob, response_mask=response_mask
    )
    kld = kl_penalty(log_prob, ref_log_prob, kind) * response_mask
    token_level_rewards = token_level_scores - kl_coef * kld
    has_tokens = (response_mask.sum(dim=-1) > 0).to(kld.dtype)
    current_kl = masked_mean(masked_mean(kld, response_mask, dim=-1), has_tokens)
    metrics = {"actor/reward_kl_penalty": float(current_kl.item()), "actor/reward_kl_penalty_coeff": float(kl_coef)}
    return token_level_rewards, metrics


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    **agg_kwargs,
) -> torch.Tensor:
    """KL in the actor loss (`kl_loss_coef`): the aggregated KL estimate; the actor adds kl_loss_coef * this.

    log_prob, ref_log_prob, response_mask: (batch, response_length). GRPO uses kind="low_var_kl" (k3)."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kind), response_mask, loss_agg_mode, **agg_kwargs)


@dataclass
class FixedKLController:
    """Constant KL coefficient (`kl_ctrl_type: fixed`)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; the signature matches AdaptiveKLController so the trainer need not branch."""

    def state_dict(self) -> dict:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_state_type(state, "fixed")
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, `kl_ctrl_type: adaptive`).

    After each batch: error = clip(current_kl / kl_target - 1, -0.2, 0.2);
    value *= 1 + error * n_steps / kl_horizon. So the coefficient grows while KL is above target."""

    value: float
    kl_target: float
    kl_horizon: float

    def __post_init__(self) -> None:
        if not self.kl_target > 0 or not self.kl_horizon > 0:
            raise ValueError(
                f"adaptive KL control needs kl_target > 0 and kl_horizon > 0, got kl_target={self.kl_target}, "
                f"kl_horizon={self.kl_horizon}"
            )

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.kl_target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.kl_horizon

    def state_dict(self) -> dict:
        return {"type": "adaptive", "value": self.value, "kl_target": self.kl_target, "kl_horizon": self.kl_horizon}

    def load_state_dict(self, state: dict) -> None:
        _check_state_type(state, "adaptive")
        self.value = float(state["value"])
        self.kl_target = float(state["kl_target"])
        self.kl_horizon = float(state["kl_horizon"])


def _check_state_type(state: dict, expected: str) -> None:
    if state.get("type") != expected:
        raise ValueError(
            f"KL controller state is of type {state.get('type')!r} but this controller is {expected!r}; "
            "rl_config.kl_ctrl_type changed since the checkpoint was written"
        )


def build_kl_controller(
    kl_ctrl_type: str = "fixed",
    init_kl_coef: float = 0.001,
    kl_target: float | None = None,
    kl_horizon: float | None = None,
) -> FixedKLController | AdaptiveKLController:
    """The controller for `rl_config.kl_ctrl_type` ("fixed" or "adaptive")."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(value=float(init_kl_coef))
    if kl_ctrl_type == "adaptive":
        if kl_target is None or kl_horizon is None:
            raise ValueError("rl_config.kl_ctrl_type=adaptive requires rl_config.kl_target and rl_config.kl_horizon")
        return AdaptiveKLController(value=float(init_kl_coef), kl_target=float(kl_target), kl_horizon=float(kl_horizon))
    raise ValueError(
        unknown_name_message("KL controller", "rl_config.kl_ctrl_type", kl_ctrl_type, ("fixed", "adaptive"))
    )
