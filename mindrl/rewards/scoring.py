"""Batch scoring: validate the verifier config, score in the process pool, combine with the weights.
The entry points: `score_rule_rewards` (per-verifier scores too) and `compute_rule_rewards`."""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mindrl.rewards.pool import get_shared_pool
from mindrl.rewards.verifiers import get_verifier, score_sample, scored_inline, uses_math

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RewardSettings:
    """The rule rewards of a run (rl_config's verifier_function, verifier_weight, verifier_timeout,
    verifier_parallel), as `score_rule_rewards` takes them."""

    verifier_function: tuple[str, ...] = ("acc_for_ppo",)
    verifier_weight: tuple[float, ...] = (1.0,)
    timeout: float = DEFAULT_TIMEOUT_S
    num_workers: int = 1


def _as_names(verifier_function: str | Sequence[str]) -> list[str]:
    names = [verifier_function] if isinstance(verifier_function, str) else list(verifier_function)
    if not names:
        raise ValueError("rl_config.verifier_function is empty; name at least one verifier, e.g. ['acc']")
    return names


def _as_weights(verifier_weight: float | Sequence[float], names: list[str]) -> list[float]:
    weights = [verifier_weight] if isinstance(verifier_weight, (int, float)) else list(verifier_weight)
    if len(weights) != len(names):
        raise ValueError(
            f"rl_config.verifier_function has {len(names)} entries {names} but rl_config.verifier_weight has "
            f"{len(weights)} {weights}; give one weight per verifier"
        )
    for name, w in zip(names, weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"rl_config.verifier_weight for {name!r} must be a finite number, got {w!r}")
    return [float(w) for w in weights]


@dataclass
class RuleScores:
    rewards: list[float]  # weighted sum per sample (0 for a sample that timed out or crashed)
    per_verifier: list[list[float] | None]  # per sample: one score per verifier; None if it did not finish
    metrics: dict[str, float]


def compute_rule_rewards(*args: Any, **kwargs: Any) -> tuple[list[float], dict[str, float]]:
    """(rewards, metrics) of `score_rule_rewards`, which takes the same arguments."""
    scores = score_rule_rewards(*args, **kwargs)
    return scores.rewards, scores.metrics


def score_rule_rewards(
    responses: Sequence[str],
    labels: Sequence[str | None],
    verifier_function: str | Sequence[str],
    verifier_weight: float | Sequence[float],
    timeout: float = DEFAULT_TIMEOUT_S,
    num_workers: int | None = None,
) -> RuleScores:
    """Score a batch: reward_i = sum_k verifier_weight[k] * verifier_function[k](responses[i], labels[i]).

    responses: decoded response texts; labels: gold answers (None where a row has none), same length.
    timeout (`rl_config.verifier_timeout`): wall-clock seconds per sample, all verifiers together,
    enforced from outside the worker; a sample that times out or crashes its worker scores 0. Verifiers that are
    all linear-time scans (`scored_inline`) score in this process instead, and need no timeout.
    num_workers: pool size (default: usable CPUs, at most 8); the pool persists across calls.

    metrics: reward/mean, reward/<verifier>/mean (over samples that finished), reward/timeouts,
    reward/errors (a verifier raised), reward/crashes (a worker died), reward/worker_restarts,
    timing/rule_reward (seconds).
    """
    names = _as_names(verifier_function)
    weights = _as_weights(verifier_weight, names)
    fns = [get_verifier(name) for name in names]
    for name, fn in zip(names, fns):
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise ValueError(
                f"verifier {name!r} ({fn!r}) cannot be sent to the scoring processes: define it as a "
                f"module-level function, not a lambda or closure ({exc})"
            ) from None
    if len(responses) != len(labels):
        raise ValueError(f"got {len(responses)} responses but {len(labels)} labels; they must pair up")
    for i, response in enumerate(responses):
        if not isinstance(response, str):
            raise TypeError(f"responses[{i}] is {type(response).__name__}, expected the decoded text (str)")
    if not timeout > 0:
        raise ValueError(f"rl_config.verifier_timeout must be > 0 seconds, got {timeout}")
    # datasets often store numeric answers as numbers
    label_texts = [None if label is None else label if isinstance(label, str) else str(label) for label in labels]

    start = time.perf_counter()
    if responses and scored_inline(names):  # linear-time scans: here, without the pool's processes
        done = [score_sample(fns, r, label) for r, label in zip(responses, label_texts)]
        scores, status, restarts = [s for s, _ in done], ["ok" if s is not None else "error" for s, _ in done], 0
    elif responses:
        warm = uses_math(names)
        pool = get_shared_pool(num_workers, math_verifiers=warm)
        outcome = pool.score(list(responses), label_texts, fns, timeout, math_verifiers=warm)
        scores, status, restarts = outcome.scores, outcome.status, outcome.worker_restarts
    else:
        scores, status, restarts = [], [], 0

    rewards = [0.0 if s is None else sum(w * v for w, v in zip(weights, s)) for s in scores]
    finished = [s for s in scores if s is not None]
    metrics = {
        "reward/mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "reward/timeouts": float(status.count("timeout")),
        "reward/errors": float(status.count("error")),
        "reward/crashes": float(status.count("crash")),
        "reward/worker_restarts": float(restarts),
        "timing/rule_reward": time.perf_counter() - start,
    }
    for k, name in enumerate(names):
        metrics[f"reward/{name}/mean"] = sum(s[k] for s in finished) / len(finished) if finished else 0.0
    return RuleScores(rewards, [None if s is None else list(s) for s in scores], metrics)
