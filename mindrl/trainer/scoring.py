"""The scoring phase of an iteration: old logprobs (skipped on-policy), reference logprobs, critic values, the reward
model's scores and the rule rewards of a batch, the models' passes overlapped where they can be."""

from __future__ import annotations

import time

import torch

from mindrl.batch import Batch
from mindrl.trainer import experience
from mindrl.trainer.metrics import timed
from mindrl.workers.results import Scores
from mindrl.workers.reward_worker import SCORE_KEYS


class Scoring:
    """Scores batches with the run's model groups (`worker_groups.ModelGroups`) and `rewards`
    (`model_rewards.Rewards`)."""

    def __init__(self, groups, rewards, on_policy: bool, needs_ref: bool):
        self.actor, self.critic, self.reference = groups.actor, groups.critic, groups.reference
        self.reward_model, self.rewards = groups.reward_model, rewards
        self.on_policy, self.needs_ref = on_policy, needs_ref

    def score(
        self, batch: Batch, labels: list[list[int]], timing: dict[str, float], iteration: int, scored: Scores | None
    ) -> Scores:
        """Old logprobs (skipped on-policy), reference logprobs, critic values and the reward model's scores ("rm_scores")
        into the batch; the rewards returned: the rule rewards' answer (or `scored`, when they are known already), with
        the reward model's scores mixed in. The rule rewards run in the background, the critic's values and the
        reward model's scores alongside the actor's passes."""
        t_score = time.perf_counter()
        responses = batch.rows_meta["response_ids"]
        reward_ref = self.rewards.client.score(responses, labels) if scored is None else None
        fwd = batch.select(experience.FORWARD_KEYS)
        values = self.critic.compute_values.start(fwd) if self.critic is not None else None
        rm = None
        if self.reward_model is not None and scored is None:
            rm = self.reward_model.compute_scores.start(batch.select(SCORE_KEYS))
        elif self.reward_model is not None:  # dynamic sampling scored and mixed them already
            batch["rm_scores"] = torch.tensor(scored.model_scores, dtype=torch.float32)
        if not self.on_policy:
            with timed(timing, "timing/old_log_p"):
                old = self.actor.compute_log_prob(fwd, reference=False)
                batch["old_log_prob"] = old.tensor
                if old.routed_experts is not None:  # routing replay (R2): the update routes by them
                    batch["routed_experts"] = old.routed_experts
        if self.needs_ref and "ref_log_prob" not in batch:  # bounded: samplers may have sent them (async_sampler_ref)
            with timed(timing, "timing/reference_model"):
                batch["ref_log_prob"] = (self.reference or self.actor).compute_log_prob(fwd, reference=True).tensor
            timing["timing/non_overlap_reference_model"] = timing["timing/reference_model"]
        if values is not None:
            with timed(timing, "timing/non_overlap_critic_model"):
                gathered = values.wait()
            batch["values"] = gathered.tensor
            timing["timing/critic_model"] = gathered.seconds
        if rm is not None:
            with timed(timing, "timing/non_overlap_reward_model"):
                got = rm.wait()
            batch["rm_scores"] = got.tensor[:, 0]
            timing["timing/reward_model"] = got.seconds
        if reward_ref is not None:
            with timed(timing, "timing/non_overlap_rule_reward"):
                scored = self.rewards.client.collect(reward_ref, iteration)
            timing["timing/rule_reward"] = scored.metrics["timing/rule_reward"]
        if rm is not None:
            scored = self.rewards.mix(scored, batch["rm_scores"].tolist())
        timing["timing/scoring"] = time.perf_counter() - t_score
        return scored
