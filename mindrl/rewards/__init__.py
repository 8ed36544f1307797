"""Rule rewards: math-answer verifiers by name, weighted combination, and batch scoring in a process
pool whose per-sample timeout is enforced from outside. No Ray, no megatron; math-verify only where used."""

from mindrl.rewards.pool import PoolOutcome, VerifierPool, get_shared_pool, shutdown_shared_pool
from mindrl.rewards.scoring import (
    DEFAULT_TIMEOUT_S,
    RewardSettings,
    RuleScores,
    compute_rule_rewards,
    score_rule_rewards,
)
from mindrl.rewards.verifiers import get_verifier, list_verifiers, register_verifier

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PoolOutcome",
    "RewardSettings",
    "RuleScores",
    "VerifierPool",
    "compute_rule_rewards",
    "get_shared_pool",
    "get_verifier",
    "list_verifiers",
    "math_equal",
    "register_verifier",
    "score_rule_rewards",
    "shutdown_shared_pool",
]


def __getattr__(name: str):
    if name == "math_equal":  # math-verify and sympy load on first use only (verifiers.MATH_VERIFIERS)
        from mindrl.rewards.equivalence import math_equal

        return math_equal
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
