"""The DPO family of preference losses on per-pair log-probability sums (pure tensors); defined in docs/dpo.md."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
    pref_ftx: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-pair terms, all (b,): `loss` (the preference loss plus pref_ftx x `sft_loss`), `sft_loss` = -policy_chosen
    / chosen_tokens (the chosen response's per-token mean NLL; 0 without chosen_tokens), the implicit rewards
    `chosen_rewards` = beta (policy_chosen - ref_chosen) and `rejected_rewards`. Inputs are each sequence's summed
    response-token log-probabilities (b,); chosen_tokens (b,): the chosen responses' token counts (with pref_ftx)."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown dpo_loss_type {loss_type!r}; one of {', '.join(DPO_LOSS_TYPES)}")
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":  # label_smoothing > 0: conservative DPO (cDPO), a flipped label with that probability
        loss = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "hinge":
        loss = torch.relu(1.0 - beta * h)
    else:
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    if chosen_tokens is None and pref_ftx:
        raise ValueError("pref_ftx needs chosen_tokens, the chosen responses' token counts")
    sft = torch.zeros_like(loss)
    if chosen_tokens is not None:  # the chosen response's per-token mean NLL: logged, and weighted in by pref_ftx
        sft = -policy_chosen / chosen_tokens.to(policy_chosen.dtype).clamp(min=1)
    if pref_ftx:  # MindSpeed-LLM's pref_ftx (LLaMA-Factory's ftx_gamma)
        loss = loss + pref_ftx * sft
    return {
        "loss": loss,
        "sft_loss": sft.detach(),
        "chosen_rewards": beta * (policy_chosen - ref_chosen).detach(),
        "rejected_rewards": beta * (policy_rejected - ref_rejected).detach(),
    }


def dpo_stats(terms: dict[str, torch.Tensor], policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> dict:
    """Sums over the pairs of the loss and of what the `dpo/*` metrics average; `correct` counts chosen_rewards >
    rejected_rewards (a tie is wrong)."""
    loss = terms["loss"]
    c, r = terms["chosen_rewards"], terms["rejected_rewards"]
    return {
        "loss_sum": loss.sum(),
        "correct": (c > r).sum().to(loss.dtype),
        "margin_sum": (c - r).sum().to(loss.dtype),
        "chosen_reward_sum": c.sum().to(loss.dtype),
        "rejected_reward_sum": r.sum().to(loss.dtype),
        "chosen_logp_sum": policy_chosen.detach().sum().to(loss.dtype),
        "rejected_logp_sum": policy_rejected.detach().sum().to(loss.dtype),
        "sft_loss_sum": terms["sft_loss"].sum().to(loss.dtype),
        "pairs": torch.tensor(float(loss.numel()), dtype=loss.dtype, device=loss.device),
    }
