"""The driver: the PPO / GRPO loop over Ray worker groups. It holds the loop, the prompt sampler, the KL
controller and the metrics; the workers hold every model tensor.

One iteration: prompts -> rollout (reshard to infer, sample, reshard to train) -> rule rewards (CPU, in the
background) | old logprobs (skipped on-policy) | reference logprobs | critic values -> advantages -> critic
update -> actor update -> metrics -> checkpoint on cadence.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from mindrl.algorithms import (
    apply_kl_penalty,
    build_kl_controller,
    get_advantage_estimator,
    scores_to_token_level,
)
from mindrl.batch import Batch, pad_rows
from mindrl.trainer import build
from mindrl.trainer.metrics import stats_metrics
from mindrl.trainer.rollout import IntegratedRollout, RolloutSource

logger = logging.getLogger("mindrl.trainer")


class TrainingAborted(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite updates)."""


@dataclass
class IterationResult:
    iteration: int
    metrics: dict[str, float]


def _gather_rows(parts: list, num_rows: int, width: int) -> torch.Tensor:
    """Reassemble per-DP-shard (rows, result) pairs into one (num_rows, width) tensor."""
    out = torch.zeros(num_rows, width)
    for rows, value in parts:
        out[torch.as_tensor(rows)] = value.float()
    return out


def _masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return stats_metrics(prefix, values[mask.bool()])


class PPOTrainer:
    """Builds the Ray worker groups for `cfg` (a validated `mindrl.config.RLConfig`) and runs the loop."""

    def __init__(self, cfg):
        import ray
        from transformers import AutoTokenizer

        from mindrl.data.prompt_dataset import PromptDataLoader, PromptDataset
        from mindrl.workers.critic_worker import CriticWorker
        from mindrl.workers.group import WorkerGroup, device_placement_group, start_ray
        from mindrl.workers.integrated_worker import IntegratedWorker
        from mindrl.workers.reward_worker import RuleRewardWorker

        self.cfg = cfg
        mt, rl = cfg.megatron_training, cfg.rl_config
        self.run_dir = rl.run_dir or os.path.join("outputs", cfg.config_name)
        os.makedirs(self.run_dir, exist_ok=True)
        self.world = rl.world_size
        self.n = rl.n_samples_per_prompt
        self.tokenizer = AutoTokenizer.from_pretrained(mt.tokenizer_name_or_path)
        self.dataset = PromptDataset(
            mt.data_path, rl.max_prompt_length, tuple(mt.dataset_additional_keys or ("labels",))
        )
        self.loader = PromptDataLoader(self.dataset, mt.global_batch_size, seed=mt.seed, shuffle=not mt.no_shuffle)
        self.sampling = cfg.generate_config.sampling(self.n)
        stop = set(self.sampling.stop_token_ids)
        for tok in (self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|im_end|>")):
            if isinstance(tok, int) and tok >= 0 and tok != self.tokenizer.unk_token_id:
                stop.add(tok)
        self.sampling.stop_token_ids = sorted(stop)
        self.kl_ctrl = build_kl_controller(rl.kl_ctrl_type, rl.init_kl_coef, rl.kl_target, rl.kl_horizon)
        self.num_mini = build.num_mini_batches(cfg)
        self.needs_ref = build.needs_reference(cfg)
        self.verifier_names = build.reward_settings(cfg).verifier_function

        if (
            build.resume_dir(cfg.actor_config.load, cfg.actor_config.finetune)
            and self.needs_ref
            and not rl.integrated_mode_config.ref_model_load_path
        ):
            raise ValueError(
                f"resuming from actor_config.load={cfg.actor_config.load!r} (finetune: false) needs "
                "rl_config.integrated_mode_config.ref_model_load_path: the reference model must be the initial "
                "policy, not the resumed one"
            )
        self.started_ray = start_ray(rl.ray_address, self.world)
        self.groups: list = []
        try:
            self.pg = device_placement_group(self.world)
            integrated = build.integrated_settings(cfg)
            # The critic shares the actor's bundles (half a device each), in its own megatron world.
            self.actor = WorkerGroup(IntegratedWorker, "actor", self.pg, self.world, fraction=0.5)
            self.groups.append(self.actor)
            self.critic = None
            if rl.needs_critic:
                self.critic = WorkerGroup(CriticWorker, "critic", self.pg, self.world, fraction=0.5)
                self.groups.append(self.critic)
            self.reward = ray.remote(num_cpus=0)(RuleRewardWorker).remote(build.reward_settings(cfg))
            self.actor.setup(integrated)  # collective: builds actor, reference and the engine
            if self.critic is not None:
                self.critic.setup(build.critic_settings(cfg))
            self.rollout: RolloutSource = IntegratedRollout(self.actor, integrated.rollout.infer_tensor_parallel_size)
            self.iteration = 0
            self.skipped_in_a_row = 0
            self._restore(integrated.actor.resume_dir)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> list[IterationResult]:
        from mindrl.trainer.metrics import MetricsLogger, RolloutLogger

        mt, rl = self.cfg.megatron_training, self.cfg.rl_config
        results = []
        batches = iter(self.loader)
        with MetricsLogger(
            self.run_dir,
            mt.train_iters,
            use_tensorboard=rl.use_tensorboard,
            use_wandb=rl.use_wandb,
            wandb_project=rl.wandb_project,
            wandb_run_name=rl.wandb_exp_name,
            config=self.cfg.to_dict(),
            start_iteration=self.iteration,
            # print the line only where the logger does not already show it (mindrl-train configures logging)
            console=not logger.isEnabledFor(logging.INFO),
        ) as log:
            rollouts = RolloutLogger(self.run_dir, rl.log_rollouts_interval, start_iteration=self.iteration)
            while self.iteration < mt.train_iters:
                self.iteration += 1
                metrics, rows = self.step(next(batches))
                log.log(self.iteration, metrics)
                rollouts.maybe_log(self.iteration, rows)
                results.append(IterationResult(self.iteration, metrics))
                if mt.save_interval and self.iteration % mt.save_interval == 0:
                    self.save()
            if not mt.save_interval or self.iteration % mt.save_interval:
                self.save()
        return results

    def step(self, prompts) -> tuple[dict[str, float], list[dict]]:
        """One PPO / GRPO iteration on a PromptBatch. Returns (metrics, sampled rows for rollouts.jsonl)."""
        import ray

        rl, mt = self.cfg.rl_config, self.cfg.megatron_training
        timing: dict[str, float] = {}
        t_all = time.perf_counter()

        # 1. rollout: per-prompt seeds from (seed, dataset row) keep sampling independent of the layout.
        prompt_ids = [p.tolist() for p in prompts.prompts]
        seeds = [(mt.seed * 1_000_003 + self.iteration * 7919 + int(i) * self.n) % (2**31) for i in prompts.indices]
        t0 = time.perf_counter()
        result = self.rollout.generate(prompt_ids, self.sampling, seeds)
        timing["timing/rollout_total"] = time.perf_counter() - t0
        timing.update(result.timing)
        batch = self._make_batch(prompt_ids, result.samples)
        labels = [lab.tolist() for lab in prompts.extras.get("labels", [])]
        labels = [labels[i // self.n] for i in range(len(batch))] if labels else [[] for _ in range(len(batch))]

        # 2. scoring: rule rewards in the background; critic values concurrently with the actor's passes.
        t_score = time.perf_counter()
        reward_ref = self.reward.score.remote(batch.rows_meta["response_ids"], labels)
        fwd = batch.select(["input_ids", "attention_mask", "responses", "response_mask"])
        values_refs = None
        if self.critic is not None:
            values_refs = self.critic.sharded_async("compute_values", fwd)
        width = batch["responses"].shape[1]
        if not rl.on_policy:
            t0 = time.perf_counter()
            parts = self.actor.sharded("compute_log_prob", fwd, 1, False)
            batch["old_log_prob"] = _gather_rows([(r, v[0]) for r, v in parts], len(batch), width)
            timing["timing/old_log_p"] = time.perf_counter() - t0
        if self.needs_ref:
            t0 = time.perf_counter()
            parts = self.actor.sharded("compute_log_prob", fwd, 1, True)
            batch["ref_log_prob"] = _gather_rows([(r, v[0]) for r, v in parts], len(batch), width)
            timing["timing/reference_model"] = time.perf_counter() - t0
            timing["timing/non_overlap_reference_model"] = timing["timing/reference_model"]
        if values_refs is not None:
            t0 = time.perf_counter()
            parts = self.critic.collect_sharded(values_refs)
            batch["values"] = _gather_rows([(r, v[0]) for r, v in parts], len(batch), width)
            timing["timing/critic_model"] = max(v[1] for _, v in parts)
            timing["timing/non_overlap_critic_model"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        scored = ray.get(reward_ref)
        timing["timing/non_overlap_rule_reward"] = time.perf_counter() - t0
        timing["timing/rule_reward"] = scored["metrics"]["timing/rule_reward"]
        timing["timing/scoring"] = time.perf_counter() - t_score

        # 3. advantages (driver-side tensor math)
        t0 = time.perf_counter()
        metrics = self._advantages(batch, scored)
        timing["timing/adv"] = time.perf_counter() - t0

        # 4. updates: critic first (its targets come from the pre-update values), then the actor.
        train_keys = ["input_ids", "attention_mask", "responses", "response_mask", "rollout_log_prob", "advantages"]
        train_keys += [k for k in ("old_log_prob", "ref_log_prob") if k in batch]
        if self.critic is not None:
            t0 = time.perf_counter()
            keys = ["input_ids", "attention_mask", "responses", "response_mask", "values", "returns"]
            parts = self.critic.sharded("update_critic", batch.select(keys), self.num_mini, self.num_mini, rl.epochs)
            metrics.update(parts[0][1])
            timing["timing/update_critic"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        parts = self.actor.sharded("update_actor", batch.select(train_keys), self.num_mini, self.num_mini, rl.epochs)
        actor_metrics = dict(parts[0][1])
        timing["timing/update"] = time.perf_counter() - t0
        metrics.update(self._logprob_diff(batch, actor_metrics.pop("_logprob_diff")))
        metrics.update(actor_metrics)
        self._check_skipped(metrics)

        timing["timing/all"] = time.perf_counter() - t_all
        metrics.update(timing)
        metrics.update(self._throughput(metrics))
        rows = self._rollout_rows(batch, scored)
        return metrics, rows

    # ------------------------------------------------------------------------------------------------ pieces
    def _make_batch(self, prompt_ids: list[list[int]], samples) -> Batch:
        """The RL batch (see mindrl.batch) from prompts and their n samples each (rows grouped by prompt)."""
        rows_p, rows_r, rows_lp, uid = [], [], [], []
        for i, (p, group) in enumerate(zip(prompt_ids, samples)):
            if len(group) != self.n:
                raise RuntimeError(f"prompt {i}: the rollout returned {len(group)} samples, expected {self.n}")
            for s in group:
                rows_p.append(p)
                rows_r.append(list(s.token_ids) or [self.tokenizer.pad_token_id or 0])
                rows_lp.append(list(s.logprobs) or [0.0])
                uid.append(i)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        prompts, prompt_mask = pad_rows(rows_p, pad, left=True)
        responses, response_mask = pad_rows(rows_r, pad, left=False)
        for i, s in enumerate(g for group in samples for g in group):
            if not s.token_ids:  # an empty response: nothing to learn from
                response_mask[i] = 0
        rollout_lp = torch.zeros(responses.shape, dtype=torch.float32)
        for i, lp in enumerate(rows_lp):
            rollout_lp[i, : len(lp)] = torch.tensor(lp)
        return Batch(
            {
                "input_ids": torch.cat([prompts, responses], dim=1),
                "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
                "responses": responses,
                "response_mask": response_mask,
                "rollout_log_prob": rollout_lp * response_mask,
                "prompt_lengths": prompt_mask.sum(-1),
            },
            {"uid": uid, "response_ids": rows_r, "prompt_ids": rows_p},
            {"prompt_length": prompts.shape[1]},
        )

    def _advantages(self, batch: Batch, scored: dict) -> dict[str, float]:
        rl = self.cfg.rl_config
        mask = batch["response_mask"]
        scores = torch.tensor(scored["rewards"], dtype=torch.float32)
        token_scores = scores_to_token_level(scores, mask)
        metrics: dict[str, float] = {}
        if rl.kl_in_reward and self.needs_ref:
            rewards, kl_metrics = apply_kl_penalty(
                token_scores,
                batch["old_log_prob"] if "old_log_prob" in batch else batch["rollout_log_prob"],
                batch["ref_log_prob"],
                mask,
                self.kl_ctrl.value,
                rl.kl_penalty,
            )
            self.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=len(batch))
            metrics.update(kl_metrics)
        else:
            rewards = token_scores
        estimator = get_advantage_estimator(rl.adv_estimator)
        available = {"gamma": rl.gamma, "lam": rl.lam, "index": batch.rows_meta["uid"]}
        if "values" in batch:
            available["values"] = batch["values"]
        wanted = inspect.signature(estimator).parameters
        adv, ret = estimator(rewards, response_mask=mask, **{k: v for k, v in available.items() if k in wanted})
        batch["token_level_scores"] = token_scores
        batch["token_level_rewards"] = rewards
        batch["advantages"] = adv
        batch["returns"] = ret
        metrics.update(stats_metrics("critic/score", scores))
        metrics.update(_masked_stats("critic/rewards", rewards.sum(-1), mask.sum(-1) > 0))
        metrics.update(_masked_stats("critic/advantages", adv, mask))
        metrics.update(_masked_stats("critic/returns", ret, mask))
        if "values" in batch:
            metrics.update(_masked_stats("critic/values", batch["values"], mask))
        metrics.update(stats_metrics("response_length", mask.sum(-1)))
        metrics.update(stats_metrics("prompt_length", batch["prompt_lengths"]))
        metrics["reward/mean"] = scores.mean().item()
        names = self.verifier_names
        for name in names:
            metrics[f"{name}_rewards/mean"] = scored["metrics"].get(f"reward/{name}/mean", 0.0)
        for k in ("reward/timeouts", "reward/errors", "reward/crashes"):
            metrics[k] = scored["metrics"][k]
        return metrics

    def _logprob_diff(self, batch: Batch, actor_diff: tuple[float, float, float]) -> dict[str, float]:
        """|rollout logprob - trainer logprob| of the sampled tokens under the same weights: from the recomputed
        old logprobs, or (on-policy) from the update's own forward pass."""
        from mindrl.workers.hybrid_engine import logprob_diff_summary

        warn = self.cfg.rl_config.logprob_diff_warn
        if "old_log_prob" in batch:
            mask = batch["response_mask"].bool()
            d = (batch["old_log_prob"] - batch["rollout_log_prob"]).abs()[mask]
            return logprob_diff_summary(d.sum().item(), d.numel(), d.max().item() if d.numel() else 0.0, warn)
        return logprob_diff_summary(*actor_diff, warn)

    def _check_skipped(self, metrics: dict[str, float]) -> None:
        skipped = metrics.get("actor/skipped_updates", 0.0) + metrics.get("critic/skipped_updates", 0.0)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped > 0 else 0
        limit = self.cfg.rl_config.max_consecutive_skipped_updates
        if skipped:
            logger.warning(
                "iteration %d: %d update(s) skipped for non-finite loss or gradients", self.iteration, skipped
            )
        if self.skipped_in_a_row >= limit:
            raise TrainingAborted(
                f"{self.skipped_in_a_row} iterations in a row produced non-finite losses or gradients (limit "
                f"rl_config.max_consecutive_skipped_updates={limit}); lower the learning rate or check the data"
            )

    def _throughput(self, m: dict[str, float]) -> dict[str, float]:
        from mindrl.trainer.metrics import throughput_metrics

        return throughput_metrics(
            response_length_mean=m["response_length/mean"],
            prompt_length_mean=m["prompt_length/mean"],
            global_batch_size=self.cfg.megatron_training.global_batch_size,
            n_samples_per_prompt=self.n,
            world_size=self.world,
            timing=m,
        )

    def _rollout_rows(self, batch: Batch, scored: dict) -> list[dict]:
        names = self.verifier_names
        prompts = self.tokenizer.batch_decode(batch.rows_meta["prompt_ids"], skip_special_tokens=False)
        rows = []
        for i, text in enumerate(scored["texts"]):
            per = scored["per_verifier"][i]
            row = {"prompt": prompts[i], "response": text, "label": scored["labels"][i], "reward": scored["rewards"][i]}
            row.update({name: (None if per is None else per[k]) for k, name in enumerate(names)})
            row["response_length"] = int(batch["response_mask"][i].sum())
            rows.append(row)
        return rows

    # ------------------------------------------------------------------------------------------------ ends
    def save(self) -> None:
        """Actor (with the driver's state) and critic at this iteration; each atomic, tracker written last."""
        from mindrl.workers.checkpointing import begin_iteration, finalize_iteration

        a, c = self.cfg.actor_config, self.cfg.critic_config
        keep = self.cfg.megatron_training.save_total_limit
        t0 = time.perf_counter()
        if a.save:
            tmp = begin_iteration(a.save, self.iteration)
            self.actor.call("save", None, tmp, not a.no_save_optim, not a.no_save_rng)
            with open(os.path.join(tmp, build.TRAINER_STATE), "w") as f:
                json.dump(self._trainer_state(), f, indent=2)
            finalize_iteration(a.save, self.iteration, tmp, a.load, keep)
        if self.critic is not None and c is not None and c.save:
            save_dir = build.critic_dir(self.cfg, "save")
            tmp = begin_iteration(save_dir, self.iteration)
            self.critic.call("save", None, tmp, not c.no_save_optim, not c.no_save_rng)
            finalize_iteration(save_dir, self.iteration, tmp, build.critic_dir(self.cfg, "load"), keep)
        logger.info("iteration %d saved in %.1f s", self.iteration, time.perf_counter() - t0)

    def _trainer_state(self) -> dict:
        return {
            "iteration": self.iteration,
            "loader": self.loader.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "skipped_in_a_row": self.skipped_in_a_row,
            "config_name": self.cfg.config_name,
        }

    def _restore(self, it_dir: str | None) -> None:
        """The driver's part of a resume: iteration, data order, KL controller."""
        if it_dir is None:
            return
        path = os.path.join(it_dir, build.TRAINER_STATE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {it_dir} has model state but no trainer state")
        with open(path) as f:
            state = json.load(f)
        self.iteration = int(state["iteration"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.skipped_in_a_row = int(state["skipped_in_a_row"])
        if self.critic is not None:
            critic_it = build.resume_dir(build.critic_dir(self.cfg, "load"), self.cfg.critic_config.finetune)
            if critic_it is None or os.path.basename(critic_it) != os.path.basename(it_dir):
                raise ValueError(
                    f"the actor resumes from {it_dir} but the critic from {critic_it}: resume both from the same "
                    "iteration (critic_config.load, finetune: false)"
                )
        logger.info("resumed from %s at iteration %d", it_dir, self.iteration)

    def shutdown(self) -> None:
        import ray

        for group in getattr(self, "groups", []):
            if group.name == "actor" and group.actors:
                try:  # engines remove their shared-memory segments
                    ray.get([a.shutdown.remote() for a in group.actors], timeout=60)
                except Exception as e:
                    logger.warning("engine shutdown: %s", e)
            group.shutdown()
        if getattr(self, "reward", None) is not None:
            try:
                ray.get(self.reward.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(self.reward, no_restart=True)
            self.reward = None
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
        if getattr(self, "started_ray", False):
            ray.shutdown()
            self.started_ray = False


def train(cfg) -> tuple[str, list[IterationResult]]:
    """Run `cfg` to the end; returns (run dir, per-iteration results)."""
    trainer = PPOTrainer(cfg)
    try:
        results = trainer.fit()
    finally:
        trainer.shutdown()
    return trainer.run_dir, results
