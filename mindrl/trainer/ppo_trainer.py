"""The driver: the PPO / GRPO loop over Ray worker groups (prompts -> rollout -> rewards, logprobs, values -> advantages
-> updates -> metrics -> checkpoint); it holds the loop's state, the workers hold every model tensor."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass

from mindrl.algorithms import build_kl_controller
from mindrl.batch import Batch
from mindrl.checkpoint.iterations import TrainerState
from mindrl.checkpoint.resume import ResumePoint, find_resume
from mindrl.checkpoint.save import CheckpointSaveError, RunCheckpoints, SaveAborted
from mindrl.data.prompt_dataset import PromptDataLoader, PromptDataset
from mindrl.data.tokenizer import load_tokenizer
from mindrl.trainer import experience, leftovers, worker_groups
from mindrl.trainer.evaluation import Evaluator
from mindrl.trainer.experience import TrainingAborted
from mindrl.trainer.metrics import MetricsLogger, RolloutLogger, iteration_throughput, memory_metrics, timed
from mindrl.trainer.model_rewards import RewardModelScorer, Rewards
from mindrl.trainer.pipeline.build import build as build_pipeline
from mindrl.trainer.pipeline.engines import Engine, RemoteRolloutError, connect_servers, trainer_rollout
from mindrl.trainer.reward_client import RewardClient
from mindrl.trainer.scoring import Scoring
from mindrl.trainer.trackers import trackers_from_config
from mindrl.workers import from_config
from mindrl.workers.group import WorkerError, WorkerGroup, start_ray, stop_ray
from mindrl.workers.profiling import announce_iteration
from mindrl.workers.results import Scores, UpdateResult, logprob_diff_summary

logger = logging.getLogger("mindrl.trainer")
__all__ = ["IterationResult", "PPOTrainer", "TrainingAborted", "train"]


@dataclass
class IterationResult:
    iteration: int
    metrics: dict[str, float]


class PPOTrainer:
    """Builds the Ray worker groups for `cfg` (a validated `mindrl.config.RLConfig`) and runs the loop."""

    def __init__(self, cfg):
        self.cfg = cfg
        mt, rl = cfg.megatron_training, cfg.rl_config
        self.run_dir = rl.run_dir or os.path.join("outputs", cfg.config_name)
        os.makedirs(self.run_dir, exist_ok=True)
        self.tokenizer = load_tokenizer(mt.tokenizer_name_or_path)
        self.dataset = PromptDataset(
            mt.data_path, rl.max_prompt_length, tuple(mt.dataset_additional_keys or ("labels",))
        )
        self.loader = PromptDataLoader(self.dataset, mt.global_batch_size, seed=mt.seed, shuffle=not mt.no_shuffle)
        self.sampling = from_config.sampling(cfg, self.tokenizer)
        self.kl_ctrl = build_kl_controller(rl.kl_ctrl_type, rl.init_kl_coef, rl.kl_target, rl.kl_horizon)
        self.num_mini, self.epochs = from_config.num_mini_batches(cfg), rl.epochs
        self.needs_ref = from_config.needs_reference(cfg)
        self.verifier_names = from_config.reward_settings(cfg).verifier_function
        self.rm_mix = from_config.reward_model_mix(cfg)  # None without a reward model
        self.evaluator = Evaluator.from_config(cfg, self.run_dir)  # None without rl_config.val_data_path
        self.pipeline = None  # the experience pipeline (built once the workers are up)

        # Everything that can be checked before Ray starts: where the run resumes, whether it can save.
        self.resume = find_resume(cfg)
        self.checkpoints = RunCheckpoints(cfg, writer_errors=(WorkerError,))
        self.checkpoints.check_writable()
        self.save_failures = 0
        self.sync_ref = rl.sync_ref_model  # validated at load: only with a reference model
        original_ref = self.resume is not None and self.resume.ref_dir is None  # not a synced one from the checkpoint
        # share_backbone: the reference is the actor's frozen backbone, the initial policy's in any checkpoint.
        own_ref = self.needs_ref and not rl.share_backbone
        if original_ref and own_ref and not rl.integrated_mode_config.ref_model_load_path:
            raise ValueError(
                f"resuming from actor_config.load={cfg.actor_config.load!r} (finetune: false) needs "
                "rl_config.integrated_mode_config.ref_model_load_path: the reference model must be the initial "
                "policy, not the resumed one"
            )
        leftovers.remove_leftovers(self.run_dir)
        self.remote = None  # rollout servers: reachable, token accepted, before any worker starts
        if cfg.generate_config.rollout_mode == "server":
            self.remote = connect_servers(cfg.generate_config, cfg.sequence_length)
        env = from_config.worker_env(cfg)  # every Ray worker of the job, samplers included
        self.started_ray = start_ray(
            rl.ray_address,
            worker_groups.total_devices(cfg),
            runtime_env={"env_vars": env} if env else None,
            runtime_env_path=rl.runtime_env_path,
        )
        self.groups: list = []
        try:
            integrated = from_config.integrated_settings(cfg, self.resume)
            self.profile = integrated.profile
            rm_settings = from_config.reward_model_settings(cfg)
            # Integrated mode: every model on every bundle; separate placement: each on its own (worker_groups).
            self.pg = worker_groups.reserve(cfg)
            self.placed = worker_groups.build_groups(cfg, self.pg, rm_settings is not None, self.groups)
            self.actor, self.critic = self.placed.actor, self.placed.critic
            self.reward_model, self.reference = self.placed.reward_model, self.placed.reference
            self.reward = RewardClient(from_config.reward_settings(cfg), self.run_dir, self.tokenizer)
            # collective: builds actor, reference (unless on its own bundles) and the engine
            self.actor.setup(integrated if self.reference is None else dataclasses.replace(integrated, ref_load=None))
            if self.reference is not None:
                self.reference.setup(integrated)
            self.engines = self.placed.rollout  # engines on devices of their own (rollout_resource), or None
            if self.engines is not None:
                self.engines.setup(integrated.rollout)
            engine_groups = [g for g in (self.actor, self.engines) if g is not None]
            self.shm_idents = {i for g in engine_groups for names in g.shm_names() for i in names}
            leftovers.record_shm(self.run_dir, self.shm_idents)  # for the next run if this one is killed
            if self.critic is not None:
                self.critic.setup(from_config.critic_settings(cfg, self.resume))
            self.rm_scorer = None  # the reward model on rows outside the scoring phase
            if self.reward_model is not None:
                self.reward_model.setup(rm_settings)
                micro = rm_settings.micro_batching.rows
                self.rm_scorer = RewardModelScorer(self.reward_model, micro, self.tokenizer.pad_token_id)
            self.rewards = Rewards(self.reward, self.rm_scorer, self.rm_mix, rl)
            self.scoring = Scoring(self.placed, self.rewards, rl.on_policy, self.needs_ref)
            itp = integrated.rollout.infer_tensor_parallel_size
            self.rollout = trainer_rollout(self.remote, self.actor, self.engines, itp)
            self.engine = Engine(self.rollout, self._enter_phase, rl.infer_dp)
            self.iteration = 0
            self.skipped_in_a_row = 0
            self.pipeline = build_pipeline(cfg, self.loader, self.dataset, self.engine, self.sampling, self.tokenizer,
                                           self.rewards, lambda: self.actor.export_weights()[0])  # fmt: skip
            self._restore(self.resume)
            self.pipeline.after_update(self.iteration, {})  # bounded: samplers start from the current weights
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> list[IterationResult]:
        mt, rl = self.cfg.megatron_training, self.cfg.rl_config
        results = []
        with MetricsLogger(
            self.run_dir,
            mt.train_iters,
            use_tensorboard=rl.use_tensorboard,
            trackers=trackers_from_config(rl, self.run_dir),
            config=self.cfg.to_dict(),
            start_iteration=self.iteration,
            # print the line only where the logger does not already show it (mindrl-train configures logging)
            console=not logger.isEnabledFor(logging.INFO),
        ) as log:
            rollouts = RolloutLogger(self.run_dir, rl.log_rollouts_interval, start_iteration=self.iteration)
            if self.evaluator is not None:
                self.evaluator.forget_after(self.iteration if self.iteration > 0 else -1)
            if self.iteration == 0 and self._eval_due():  # a resumed run logged its iteration's evaluation already
                with self._aborting("evaluation at iteration 0"):
                    log.log(0, self._evaluate())
            while self.iteration < mt.train_iters:
                self.iteration += 1
                announce_iteration(self.groups, self.profile, self.iteration)
                with self._aborting(f"iteration {self.iteration}"):
                    metrics, rows = self.step()
                if self._eval_due():
                    with self._aborting(f"evaluation at iteration {self.iteration}"):
                        metrics.update(self._evaluate())
                metrics["checkpoint/save_failures"] = float(self.save_failures)
                # logged before the save: a resume cuts metrics.jsonl back to the saved iteration
                log.log(self.iteration, metrics)
                rollouts.maybe_log(self.iteration, rows)
                results.append(IterationResult(self.iteration, metrics))
                if mt.save_interval and self.iteration % mt.save_interval == 0 and self.iteration < mt.train_iters:
                    self._periodic_save()
            self.save()  # the last iteration is always saved; a failure here fails the run
        return results

    @contextlib.contextmanager
    def _aborting(self, what: str):
        """A dead or failing worker as an error naming `what` (the group is already killed: no rank is left waiting
        in a collective)."""
        try:
            yield
        except (WorkerError, RemoteRolloutError) as e:
            raise TrainingAborted(f"{what}: {e}{self._resume_hint()}") from e

    def _eval_due(self) -> bool:
        return self.evaluator is not None and self.evaluator.due(self.iteration)

    def _evaluate(self) -> dict[str, float]:
        """The held-out evaluation of the current weights (`mindrl.trainer.evaluation`): its val/* metrics and
        timing/eval. It leaves the models where the step left them and draws nothing from training's random streams
        (its own seeds; the engine's samples depend only on them)."""

        episode, agent = self.pipeline.episode, []

        def generate(prompts, sampling, seeds):  # the training's episode: one turn, or the agent loop with its tools
            samples = episode.run(prompts, sampling, seeds, {})
            agent.append(episode.metrics)
            return samples

        def score(responses, labels):
            return self.reward.collect(self.reward.score(responses, labels), self.iteration)

        def model_score(prompts, responses, scored):  # the statistics of normalize_reward as they stand
            self._enter_phase("score", {})
            return self.rewards.mix(scored, self.rm_scorer.score_rows(prompts, responses)[0], update=False)

        with_model = model_score if self.rm_scorer is not None else None
        metrics = self.evaluator.run(self.iteration, self.sampling, generate, score, self.tokenizer, with_model)
        metrics.update({f"val/{k}": v for k, v in agent[0].items()})  # the greedy responses' agent/* metrics
        self._enter_phase("train", {})
        self._memory_ledger()  # the evaluation's phases are not the next iteration's
        return metrics

    def _periodic_save(self) -> None:
        """A save on the save_interval cadence. If it cannot be written (full disk...), the run goes on with its
        state intact and tries again at the next one (counted in checkpoint/save_failures)."""
        try:
            self.save()
        except CheckpointSaveError as e:
            self.save_failures += 1
            logger.error("iteration %d was NOT saved (the run goes on; the next save retries): %s", self.iteration, e)

    def _resume_hint(self) -> str:
        return self.checkpoints.resume_hint()

    def step(self) -> tuple[dict[str, float], list[dict]]:
        """One PPO / GRPO / DAPO iteration on the experience pipeline's next batch. Returns (metrics, sampled rows for
        rollouts.jsonl)."""
        timing: dict[str, float] = {}
        t_all = time.perf_counter()
        got = self.pipeline.next(self.iteration, timing)  # rollout (whatever the mode)
        batch = got.batch
        self._enter_phase("score", timing)
        scored = self._score(batch, got.labels, timing, got.scored)  # reference, values, rewards
        with timed(timing, "timing/adv"):
            metrics = self._advantages(batch, scored)
        metrics.update(got.metrics)
        if self.critic is not None:  # first: its targets come from the pre-update values
            self._enter_phase("critic_train", timing)
            with timed(timing, "timing/update_critic"):
                metrics.update(self._update_critic(batch))
        self._enter_phase("train", timing)
        with timed(timing, "timing/update"):
            actor = self.actor.update_actor(batch.select(experience.actor_keys(batch)), self.num_mini, self.epochs)
        metrics.update(self._actor_metrics(batch, actor))
        self.pipeline.after_update(self.iteration, timing)
        metrics.update(self._memory_ledger())
        self._check_skipped(metrics)
        self._maybe_sync_reference(metrics, timing)
        timing["timing/all"] = time.perf_counter() - t_all
        metrics.update(timing)
        metrics.update(iteration_throughput(self.cfg, metrics))
        return metrics, got.log_rows(experience.rollout_rows(batch, scored, self.tokenizer, self.verifier_names))

    # ------------------------------------------------------------------------------------------------ pieces
    def _enter_phase(self, phase: str, timing: dict[str, float]) -> None:
        """Every worker puts its models where the residency schedule has them in `phase` (the actor's group and the
        critic's move at once); `timing/residency/{phase}`: the seconds that took."""
        with timed(timing, f"timing/residency/{phase}"):
            pending = [group.enter_phase.start(phase) for group in self._model_groups()]
            for call in pending:
                call.wait()

    def _model_groups(self) -> list[WorkerGroup]:
        """The groups holding models on the devices: the actor's, and the critic's and reward model's where present."""
        return [group for group in (self.actor, self.critic, self.reward_model, self.reference) if group is not None]

    def _memory_ledger(self) -> dict[str, float]:
        """`memory/device_bytes/*` of this iteration: each device's actor (+ reference), critic and reward-model ranks
        together."""
        return memory_metrics(self.placed.device_ledgers({g.name: g.memory_ledger() for g in self._model_groups()}))

    def _score(
        self, batch: Batch, labels: list[list[int]], timing: dict[str, float], scored: Scores | None = None
    ) -> Scores:
        """The scoring phase (`scoring.Scoring`): logprobs, values and rewards of the batch."""
        return self.scoring.score(batch, labels, timing, self.iteration, scored)

    def _advantages(self, batch: Batch, scored: Scores) -> dict[str, float]:
        """token_level_scores / rewards (with the KL penalty, if in the reward), advantages and returns into the
        batch (`experience.advantages`); returns their metrics."""
        scores, penalty = self.rewards.shaped(scored, batch["response_mask"].sum(-1))
        kl_ctrl = self.kl_ctrl if self.needs_ref else None
        metrics = experience.advantages(batch, scores, penalty, self.cfg.rl_config, kl_ctrl)
        metrics.update(experience.advantage_metrics(batch, scores, scored, self.verifier_names))
        return metrics

    def _update_critic(self, batch: Batch) -> dict[str, float]:
        result = self.critic.update_critic(batch.select(experience.CRITIC_KEYS), self.num_mini, self.epochs)
        return {**experience.token_metrics("critic", result.tokens), **result.metrics}

    def _actor_metrics(self, batch: Batch, result: UpdateResult) -> dict[str, float]:
        """The actor update's metrics, its token counts, and |rollout logprob - trainer logprob| of the sampled
        tokens under the same weights: from the recomputed old logprobs, or (on-policy) from the update's own
        forward pass."""
        warn = self.cfg.rl_config.logprob_diff_warn
        r = experience.rollout_gap(batch) if "old_log_prob" in batch else result.logprob_diff
        diff = logprob_diff_summary(
            r.sum_abs, r.count, r.max_abs, warn, seqs=(r.seq_sum_abs, r.seq_count, r.seq_max_abs)
        )
        return {**diff, **experience.token_metrics("actor", result.tokens), **result.metrics}

    def _maybe_sync_reference(self, metrics: dict[str, float], timing: dict[str, float]) -> None:
        """TR-DPO: after the actor update of iterations K, 2K, ... (saved with this iteration)."""
        rl = self.cfg.rl_config
        if not self.sync_ref:
            return
        synced = self.iteration % rl.ref_model_sync_steps == 0
        if synced:
            timing["timing/ref_sync"] = max(self.actor.sync_reference(rl.ref_model_mixup_alpha))
        metrics["actor/ref_synced"] = float(synced)

    def _check_skipped(self, metrics: dict[str, float]) -> None:
        skipped = metrics.get("actor/skipped_updates", 0.0) + metrics.get("critic/skipped_updates", 0.0)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped > 0 else 0
        limit = self.cfg.rl_config.max_consecutive_skipped_updates
        if skipped:
            logger.warning(
                "iteration %d: %d update(s) skipped for non-finite loss or gradients", self.iteration, skipped
            )
        if limit > 0 and self.skipped_in_a_row >= limit:  # 0: never abort
            raise TrainingAborted(
                f"{self.skipped_in_a_row} iterations in a row produced non-finite losses or gradients (limit "
                f"rl_config.max_consecutive_skipped_updates={limit}); lower the learning rate or check the data"
            )

    # ------------------------------------------------------------------------------------------------ ends
    def save(self) -> None:
        """Actor (with the driver's state, and the synced reference) and critic at this iteration, committed
        together (`RunCheckpoints.save`). A save that cannot fit or be written raises CheckpointSaveError and leaves
        the previous checkpoint and the training state untouched; a rank failing to write ends the run."""
        try:
            ref = self.actor.save_reference if self.sync_ref else None
            groups = {"actor": self.actor, "critic": self.critic}
            self.checkpoints.save(self.iteration, self._trainer_state(), lambda role, *a: groups[role].save(*a), ref)
        except SaveAborted as e:  # a rank failed writing: its group is gone
            raise TrainingAborted(f"{e}{self._resume_hint()}") from e.__cause__

    def _trainer_state(self) -> TrainerState:
        return TrainerState(
            iteration=self.iteration,
            loader=self.loader.state_dict(),
            kl_ctrl=self.kl_ctrl.state_dict(),
            skipped_in_a_row=self.skipped_in_a_row,
            save_failures=self.save_failures,
            reference_saved=self.sync_ref,
            config_name=self.cfg.config_name,
            reward_moments=self.rewards.moments.state_dict() if self.rm_mix is not None else None,
            **self.pipeline.state_dict(),
        )

    def _restore(self, resume: ResumePoint | None) -> None:
        """The driver's part of a resume: iteration, data order, KL controller (the workers restored theirs)."""
        if resume is None:
            return
        state = TrainerState.read(resume.actor_dir)  # checked by find_resume
        self.iteration = state.iteration
        self.loader.load_state_dict(state.loader)
        self.kl_ctrl.load_state_dict(state.kl_ctrl)
        self.skipped_in_a_row = state.skipped_in_a_row
        self.save_failures = state.save_failures
        if state.reward_moments is not None:
            self.rewards.moments.load_state_dict(state.reward_moments)
        self.pipeline.load_state_dict(state, self.iteration)
        logger.info("resumed from %s at iteration %d", resume.actor_dir, self.iteration)

    def shutdown(self) -> None:

        for group in getattr(self, "groups", []):  # the actor's engines remove their shared-memory segments first
            group.shutdown(graceful_s=60.0 if group.name in ("actor", "rollout") else None)
        if getattr(self, "shm_idents", None) is not None:  # those of engines whose process was killed
            leftovers.remove_shm(self.run_dir, self.shm_idents)
        if getattr(self, "reward", None) is not None:
            self.reward.shutdown()
            self.reward = None
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
        if getattr(self, "pipeline", None) is not None:  # bounded: the sampler actors, the ZeroMQ ports
            self.pipeline.close()
            self.pipeline = None
        if getattr(self, "remote", None) is not None:  # the rollout servers' HTTP connections
            self.remote.close()
        if getattr(self, "started_ray", False):
            stop_ray()
            self.started_ray = False


def train(cfg) -> tuple[str, list[IterationResult]]:
    """Run `cfg` to the end; returns (run dir, per-iteration results)."""
    worker_groups.require_runnable(cfg)
    trainer = PPOTrainer(cfg)
    try:
        results = trainer.fit()
    finally:
        trainer.shutdown()
    return trainer.run_dir, results
