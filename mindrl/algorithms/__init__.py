"""PPO/GRPO math: advantage estimators, policy/value/entropy losses, KL estimators and controllers.
Pure functions on (batch, response_length) tensors; no Ray, no megatron, no I/O."""

from mindrl.algorithms.advantages import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_advantage_estimator,
    list_advantage_estimators,
    register_adv_est,
)
from mindrl.algorithms.dapo import keep_groups, overlong_penalty
from mindrl.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_loss,
    kl_penalty,
)
from mindrl.algorithms.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    agg_loss,
    count_tokens_and_seqs,
    entropy_from_logits,
    entropy_loss,
    gspo_policy_loss,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from mindrl.algorithms.masked import (
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    scores_to_token_level,
)

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "count_tokens_and_seqs",
    "entropy_from_logits",
    "entropy_loss",
    "get_advantage_estimator",
    "gspo_policy_loss",
    "keep_groups",
    "kl_loss",
    "kl_penalty",
    "last_valid_index",
    "list_advantage_estimators",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "register_adv_est",
    "scores_to_token_level",
    "value_loss",
]
