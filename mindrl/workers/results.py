"""The typed results workers hand back to the driver: per-row tensors gathered over the DP shards, an update's
metrics with its token counts and logprob-diff totals, a batch's rule rewards, and a rank's memory ledger."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only for the annotations: the driver's reward code reads Scores without it
    import torch


@dataclass
class RowTensor:
    """A per-row tensor of the batch and the seconds it took. From a rank: its DP shard's (shard rows, R); from the
    group (`gather`): the whole batch's (rows, R) in fp32, with the slowest rank's seconds."""

    tensor: torch.Tensor
    seconds: float

    @classmethod
    def gather(cls, parts: Sequence[tuple[Sequence[int], RowTensor]], num_rows: int) -> RowTensor:
        """The shards' tensors put back at their rows (`parts`: (rows of shard d, result of DP group d))."""
        import torch

        width = parts[0][1].tensor.shape[1]
        out = torch.zeros(num_rows, width)
        for rows, part in parts:
            out[torch.as_tensor(rows)] = part.tensor.float()
        return cls(out, max(part.seconds for _, part in parts))


@dataclass
class LogProbs(RowTensor):
    """(rows, R) logprob of each response token (0 on padding), under the actor or the reference model; with
    routing replay (R2) the old-logprob pass's routed_experts [rows, P + R, MoE layers, k] too."""

    routed_experts: torch.Tensor | None = None

    @classmethod
    def gather(cls, parts: Sequence[tuple[Sequence[int], LogProbs]], num_rows: int) -> LogProbs:
        import torch

        out = super().gather(parts, num_rows)
        first = parts[0][1].routed_experts
        if first is not None:
            routed = first.new_zeros((num_rows, *first.shape[1:]))
            for rows, part in parts:
                routed[torch.as_tensor(rows)] = part.routed_experts
            out.routed_experts = routed
        return out


@dataclass
class Values(RowTensor):
    """(rows, R) the critic's value of the state before each response token (0 on padding)."""


@dataclass(frozen=True)
class TokenCounts:
    """Positions an update ran on, over all its micro-batches and DP ranks (see `mindrl.workers.rl_model._Plan`)."""

    computed: float
    real: float
    untrimmed: float
    shared: float
    """Real prompt tokens not computed again (prefix groups compute a shared prompt once)."""


@dataclass(frozen=True)
class LogprobDiff:
    """|rollout logprob - trainer logprob| totals over the sampled tokens of an actor update's forward passes, and
    over its responses of |sum of the response's token differences| (the log of its sequence-level ratio)."""

    sum_abs: float
    count: float
    max_abs: float
    seq_sum_abs: float = 0.0
    seq_count: float = 0.0
    seq_max_abs: float = 0.0


def logprob_diff_summary(
    sum_abs: float, count: float, max_abs: float, warn: float, seqs: tuple[float, float, float] | None = None
) -> dict[str, float]:
    """`rollout/logprob_diff_mean` / `_max` from |engine - actor| totals per token, and with `seqs` (sum, count,
    max of the per-response |sum of differences|) `rollout/seq_logprob_diff_mean` / `_max`; warns loudly when the
    token mean exceeds `warn`: the rollout is then not sampling from the policy being trained."""
    metrics = {"rollout/logprob_diff_mean": sum_abs / max(count, 1.0), "rollout/logprob_diff_max": max_abs}
    if seqs is not None:
        metrics["rollout/seq_logprob_diff_mean"] = seqs[0] / max(seqs[1], 1.0)
        metrics["rollout/seq_logprob_diff_max"] = seqs[2]
    if metrics["rollout/logprob_diff_mean"] > warn:
        logging.getLogger("mindrl.hybrid_engine").warning(
            "rollout and actor disagree: mean |logprob diff| %.3g > %.3g (max %.3g). The rollout is not "
            "sampling from the policy being trained (dtype, weights not reloaded, or a layout bug).",
            metrics["rollout/logprob_diff_mean"],
            warn,
            metrics["rollout/logprob_diff_max"],
        )
    return metrics


@dataclass
class Scores:
    """The rule rewards of a batch's responses (`RewardClient.collect`)."""

    rewards: list[float]
    """Per response: the verifiers' weighted score."""
    per_verifier: list[list[float] | None]
    """Per response: each verifier's score (None: not scored, e.g. its worker crashed)."""
    texts: list[str]
    """The decoded responses."""
    labels: list[str]
    """The decoded labels."""
    metrics: dict[str, float]
    """reward/<verifier>/mean, reward/timeouts, reward/errors, reward/crashes, reward/worker_restarts,
    timing/rule_reward."""
    model_scores: list[float] | None = None
    """Per response: the reward model's raw score, already mixed into `rewards` (None: no reward model)."""


@dataclass
class UpdateResult:
    """What a PPO update (actor or critic) reports: metrics averaged over its optimizer steps (the same on every
    rank), the positions it computed, and (actor) the logprob-diff totals of its forward passes."""

    metrics: dict[str, float]
    tokens: TokenCounts
    logprob_diff: LogprobDiff | None = None


@dataclass
class DeviceLedger:
    """What one rank's models held on its device at each phase of an iteration, counted from their storages (a
    storage offloaded to the host counts 0): phase -> model (actor, reference, critic) -> term (weights, grads,
    optimizer) -> bytes. A worker's ledger names its own models; `merge` adds those of the workers on one device."""

    phases: dict[str, dict[str, dict[str, int]]]

    @classmethod
    def merge(cls, parts: Sequence[DeviceLedger]) -> DeviceLedger:
        phases: dict[str, dict[str, dict[str, int]]] = {}
        for part in parts:
            for phase, models in part.phases.items():
                phases.setdefault(phase, {}).update(models)
        return cls(phases)

    def total(self, phase: str) -> int:
        return sum(sum(terms.values()) for terms in self.phases.get(phase, {}).values())
