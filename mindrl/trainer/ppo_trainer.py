"""The driver: the PPO / GRPO loop over Ray worker groups (prompts -> rollout -> rewards, logprobs, values -> advantages
-> updates -> metrics -> checkpoint); it holds the loop's state, the workers hold every model tensor."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import time
from dataclasses import dataclass

import torch

from mindrl.algorithms import (
    apply_kl_penalty,
    build_kl_controller,
    get_advantage_estimator,
    overlong_penalty,
    scores_to_token_level,
)
from mindrl.batch import Batch
from mindrl.checkpoint.iterations import TrainerState
from mindrl.checkpoint.resume import ResumePoint, find_resume
from mindrl.checkpoint.save import CheckpointSaveError, RunCheckpoints, SaveAborted
from mindrl.data.prompt_dataset import PromptDataLoader, PromptDataset
from mindrl.data.tokenizer import load_tokenizer
from mindrl.rewards.model_scores import RunningMoments, mix_rewards, shaped_model_scores
from mindrl.trainer import async_bounded, async_rollout, experience, leftovers, partial_rollout, worker_groups
from mindrl.trainer.dynamic_sampling import KeptGroups, filter_metric
from mindrl.trainer.evaluation import Evaluator
from mindrl.trainer.metrics import MetricsLogger, RolloutLogger, iteration_throughput, memory_metrics
from mindrl.trainer.model_rewards import RewardModelScorer
from mindrl.trainer.reward_client import RewardClient
from mindrl.trainer.rollout import (
    EngineGroupRollout,
    IntegratedRollout,
    RemoteRolloutError,
    RolloutSource,
    connect_servers,
)
from mindrl.trainer.trackers import trackers_from_config
from mindrl.workers import from_config
from mindrl.workers.group import WorkerError, WorkerGroup, start_ray, stop_ray
from mindrl.workers.profiling import announce_iteration
from mindrl.workers.results import Scores, UpdateResult, logprob_diff_summary
from mindrl.workers.reward_worker import SCORE_KEYS

logger = logging.getLogger("mindrl.trainer")


class TrainingAborted(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite updates, a worker died)."""


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
        self.world = rl.world_size
        self.n = rl.n_samples_per_prompt
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
        self.rm_moments = RunningMoments()  # normalize_reward's running statistics
        self.evaluator = Evaluator.from_config(cfg, self.run_dir)  # None without rl_config.val_data_path
        self.partial = partial_rollout.from_config(cfg, self.sampling)  # None unless partial_rollout_max_split > 1
        self.ahead = async_rollout.one_step_off(cfg)  # None in the synchronous mode
        self.bounded = None  # async_mode bounded's end of the samplers (bound once the workers are up)

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
            self.remote = connect_servers(cfg.generate_config, rl.max_prompt_length + self.sampling.max_tokens)
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
            itp = integrated.rollout.infer_tensor_parallel_size
            self.rollout: RolloutSource = (
                self.remote.attach(self.actor)
                if self.remote is not None
                else EngineGroupRollout(self.actor, self.engines, itp)
                if self.engines is not None
                else IntegratedRollout(self.actor, itp)
            )
            self.iteration = 0
            self.skipped_in_a_row = 0
            self.bounded = async_bounded.bounded(cfg, len(self.dataset))
            self._restore(self.resume)
            self._publish_weights({})  # bounded: samplers start from the current weights
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> list[IterationResult]:
        mt, rl = self.cfg.megatron_training, self.cfg.rl_config
        results = []
        batches = iter(self.loader)
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
                log.log(0, self._evaluate_or_abort())
            while self.iteration < mt.train_iters:
                self.iteration += 1
                announce_iteration(self.groups, self.profile, self.iteration)
                metrics, rows = self._step_or_abort(batches)
                if self._eval_due():
                    metrics.update(self._evaluate_or_abort())
                metrics["checkpoint/save_failures"] = float(self.save_failures)
                # logged before the save: a resume cuts metrics.jsonl back to the saved iteration
                log.log(self.iteration, metrics)
                rollouts.maybe_log(self.iteration, rows)
                results.append(IterationResult(self.iteration, metrics))
                if mt.save_interval and self.iteration % mt.save_interval == 0 and self.iteration < mt.train_iters:
                    self._periodic_save()
            self.save()  # the last iteration is always saved; a failure here fails the run
        return results

    def _step_or_abort(self, batches) -> tuple[dict[str, float], list[dict]]:
        """`step`, with a dead or failing worker turned into an error naming the iteration (the group is already
        killed: no rank is left waiting in a collective)."""
        try:
            return self.step(batches)
        except (WorkerError, RemoteRolloutError) as e:
            raise TrainingAborted(f"iteration {self.iteration}: {e}{self._resume_hint()}") from e

    def _eval_due(self) -> bool:
        return self.evaluator is not None and self.evaluator.due(self.iteration)

    def _evaluate_or_abort(self) -> dict[str, float]:
        """The held-out evaluation of the current weights (`mindrl.trainer.evaluation`): its val/* metrics and
        timing/eval. It leaves the models where the step left them and draws nothing from training's random streams
        (its own seeds; the engine's samples depend only on them)."""
        try:
            return self._evaluate()
        except (WorkerError, RemoteRolloutError) as e:
            raise TrainingAborted(f"evaluation at iteration {self.iteration}: {e}{self._resume_hint()}") from e

    def _evaluate(self) -> dict[str, float]:
        replicas = self.cfg.rl_config.infer_dp

        def generate(prompts, sampling, seeds):
            # each call streams the weights in: they must be on the device (a rollout leaves them where scoring wants)
            self._enter_phase("rollout", {})
            # the prompts split evenly over the engine replicas: pad with copies of the last, dropped after
            pad = -len(prompts) % replicas
            out = self.rollout.generate(prompts + prompts[-1:] * pad, sampling, seeds + seeds[-1:] * pad).samples
            return out[: len(prompts)]

        def score(responses, labels):
            return self.reward.collect(self.reward.score(responses, labels), self.iteration)

        def model_score(prompts, responses, scored):  # the statistics of normalize_reward as they stand
            self._enter_phase("score", {})
            return self._mix_model_scores(scored, self.rm_scorer.score_rows(prompts, responses)[0], update=False)

        with_model = model_score if self.rm_scorer is not None else None
        metrics = self.evaluator.run(self.iteration, self.sampling, generate, score, self.tokenizer, with_model)
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

    def step(self, batches) -> tuple[dict[str, float], list[dict]]:
        """One PPO / GRPO / DAPO iteration on the PromptBatches it draws from the iterator `batches` (one, or with
        dynamic sampling as many as it takes). Returns (metrics, sampled rows for rollouts.jsonl)."""
        timing: dict[str, float] = {}
        t_all = time.perf_counter()
        sampled: dict[str, float] = {}
        dropped: list[dict] = []
        if self.cfg.rl_config.filter_groups_enable:
            batch, labels, scored, sampled, dropped = self._sample_filtered(batches, timing)
            self._enter_phase("score", timing)
            self._score(batch, labels, timing, scored)  # reference, values (the rewards are known)
        elif self.partial is not None:  # pieces of responses, continued across iterations; a rollout call per round
            taken = self.partial.step(self.iteration, batches, lambda *args: self._sample(*args, timing, phase=True))
            batch, labels, sampled = taken.batch(self.tokenizer.pad_token_id), taken.labels, taken.metrics
            self._enter_phase("score", timing)
            scored = self._score(batch, labels, timing)
        else:
            prompts, batch = self._rollout_next(batches, timing, sampled)
            labels = experience.row_labels(prompts.extras, self.n, len(batch))
            self._enter_phase("score", timing)
            scored = self._score(batch, labels, timing)  # reference, values, rewards
        with _timed(timing, "timing/adv"):
            metrics = self._advantages(batch, scored)
        metrics.update(sampled)
        if self.critic is not None:  # first: its targets come from the pre-update values
            self._enter_phase("critic_train", timing)
            with _timed(timing, "timing/update_critic"):
                metrics.update(self._update_critic(batch))
        self._enter_phase("train", timing)
        with _timed(timing, "timing/update"):
            actor = self.actor.update_actor(batch.select(experience.actor_keys(batch)), self.num_mini, self.epochs)
        metrics.update(self._actor_metrics(batch, actor))
        self._publish_weights(timing)
        metrics.update(self._memory_ledger())
        self._check_skipped(metrics)
        self._maybe_sync_reference(metrics, timing)
        timing["timing/all"] = time.perf_counter() - t_all
        metrics.update(timing)
        metrics.update(iteration_throughput(self.cfg, metrics))
        rows = experience.rollout_rows(batch, scored, self.tokenizer, self.verifier_names)
        async_bounded.tag_rows(rows, batch)  # bounded: each row's prompt_index and epoch
        if self.cfg.rl_config.filter_groups_enable:  # what dynamic sampling did with each generated group
            rows = [{**row, "dynamic_sampling": "trained"} for row in rows] + dropped
        return metrics, rows

    # ------------------------------------------------------------------------------------------------ pieces
    def _enter_phase(self, phase: str, timing: dict[str, float]) -> None:
        """Every worker puts its models where the residency schedule has them in `phase` (the actor's group and the
        critic's move at once); `timing/residency/{phase}`: the seconds that took."""
        with _timed(timing, f"timing/residency/{phase}"):
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

    def _rollout_next(self, batches, timing: dict[str, float], metrics: dict[str, float]):
        """(prompts, the batch of their samples) this iteration trains: drawn and sampled now with the current policy,
        or with async_mode one_step_off generated one iteration earlier (`async_rollout`; its async/* metrics into
        `metrics`). Per-prompt seeds from (seed, iteration, generation batch, dataset row) keep sampling independent
        of the layout and of the mode."""
        if self.bounded is not None:  # the samplers' groups, no older than max_staleness versions
            prompts, batch, async_metrics = self.bounded.take(
                self.iteration - 1, self.dataset, self.n, self.tokenizer.pad_token_id
            )
            metrics.update(async_metrics)
            return prompts, batch
        if self.ahead is None:
            prompts = next(batches)
            self._enter_phase("rollout", timing)
            samples = self._generate([p.tolist() for p in prompts.prompts], prompts.indices, timing, 0)
            version = self.iteration - 1
        else:

            def generate(prompts, iteration, timing):
                self._enter_phase("rollout", timing)  # each rollout leaves the models where scoring wants them
                return self._generate([p.tolist() for p in prompts.prompts], prompts.indices, timing, 0, iteration)

            got, async_metrics = self.ahead.take(batches, generate, self.iteration, timing)
            prompts, samples, version = got.prompts, got.samples, got.version
            metrics.update(async_metrics)
        batch = experience.make_batch(
            [p.tolist() for p in prompts.prompts], samples, self.n, self.tokenizer.pad_token_id
        )
        batch.rows_meta["weight_version"] = [version] * len(batch)
        return prompts, batch

    def _publish_weights(self, timing: dict[str, float]) -> None:
        """bounded: publish the actor's weights (version = updates done) to the samplers, every weight_sync_interval
        updates."""
        if self.bounded is None or not self.bounded.due(self.iteration):
            return
        with _timed(timing, "timing/publish_weights"):
            self.bounded.publish(self.iteration, self.actor.export_weights()[0])

    def _generate(self, prompt_ids, indices, timing: dict[str, float], gen_batch: int, iteration=None) -> list:
        """`n` samples per prompt, with the seeds of `iteration` (None: this one); the rollout's timings added to
        `timing` (summed over generation batches)."""
        mt = self.cfg.megatron_training
        it = self.iteration if iteration is None else iteration
        base = mt.seed * 1_000_003 + it * 7919 + gen_batch * 104_729
        seeds = [(base + int(i) * self.n) % (2**31) for i in indices]
        return self._sample(prompt_ids, self.sampling, seeds, timing)

    def _sample(self, prompt_ids, sampling, seeds, timing: dict[str, float], phase: bool = False) -> list:
        """The rollout's samples of `prompt_ids` (padded to split over the engine replicas), its timings added to
        `timing` (summed over calls). phase: enter the rollout phase first (a rollout leaves the weights where
        scoring wants them)."""
        if phase:
            self._enter_phase("rollout", timing)
        pad = -len(prompt_ids) % self.cfg.rl_config.infer_dp
        t0 = time.perf_counter()
        result = self.rollout.generate(prompt_ids + prompt_ids[-1:] * pad, sampling, seeds + seeds[-1:] * pad)
        timing["timing/rollout_total"] = timing.get("timing/rollout_total", 0.0) + time.perf_counter() - t0
        for k, v in result.timing.items():
            timing[k] = timing.get(k, 0.0) + v if k.startswith("timing/") else v
        return result.samples[: len(prompt_ids)]

    def _sample_filtered(self, batches, timing: dict[str, float]):
        """DAPO's dynamic sampling: generation batches of global_batch_size prompts, each scored, its groups whose
        samples all score the same on filter_groups_metric dropped, until train_batch_size groups are kept (the
        surplus of the last batch is dropped too). Returns (batch, row labels, Scores, dynamic-sampling metrics, the
        rollouts.jsonl rows of the groups not trained on).
        The prompt sampler advances once per generation batch, so a resume continues after the last one drawn."""
        rl = self.cfg.rl_config
        want, limit = rl.train_batch_size, rl.filter_groups_max_batches
        kept = KeptGroups(self.n, self.verifier_names)
        while kept.num_groups < want:
            if limit > 0 and kept.gen_batches >= limit:
                raise TrainingAborted(
                    f"iteration {self.iteration}: dynamic sampling kept {kept.num_groups} of the "
                    f"filter_groups_train_batch_size={want} prompts after rl_config.filter_groups_max_batches={limit} "
                    f"generation batches ({kept.filtered_groups} of {kept.generated_groups} groups scored alike on "
                    f"{rl.filter_groups_metric}); raise filter_groups_max_batches (<= 0: no limit) or use easier / "
                    "more varied prompts"
                )
            prompts = next(batches)
            self._enter_phase("rollout", timing)
            prompt_ids = [p.tolist() for p in prompts.prompts]
            samples = self._generate(prompt_ids, prompts.indices, timing, kept.gen_batches)
            responses = [list(s.token_ids) or [self.tokenizer.pad_token_id or 0] for group in samples for s in group]
            labels = experience.row_labels(prompts.extras, self.n, len(responses))
            t0 = time.perf_counter()
            scored = self.reward.collect(self.reward.score(responses, labels), self.iteration)
            timing["timing/non_overlap_rule_reward"] = (
                timing.get("timing/non_overlap_rule_reward", 0.0) + time.perf_counter() - t0
            )
            if self.rm_scorer is not None:  # the filter sees the whole reward, the reward model's score mixed in
                self._enter_phase("score", timing)
                rows_prompts = [prompt_ids[r // self.n] for r in range(len(responses))]
                raw, seconds = self.rm_scorer.score_rows(rows_prompts, [s.token_ids for g in samples for s in g])
                timing["timing/reward_model"] = timing.get("timing/reward_model", 0.0) + seconds
                scored = self._mix_model_scores(scored, raw)
            lengths = torch.tensor([len(s.token_ids) for group in samples for s in group])
            shaped, _ = self._shaped_scores(scored, lengths)
            metric = filter_metric(scored, shaped, rl.filter_groups_metric, self.verifier_names)
            texts = self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
            rows = experience.sample_rows([texts[r // self.n] for r in range(len(responses))], scored, lengths.tolist(),
                                          self.verifier_names)  # fmt: skip
            kept.add(prompt_ids, samples, labels, scored, metric, shaped, rows)
        prompt_ids, samples, labels, scored = kept.take(want)
        timing["timing/rule_reward"] = scored.metrics.get("timing/rule_reward", 0.0)
        batch = experience.make_batch(prompt_ids, samples, self.n, self.tokenizer.pad_token_id)
        return batch, labels, scored, kept.metrics(want), kept.dropped_rows(want)

    def _shaped_scores(self, scored: Scores, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows,) each response's score: its rule reward, plus DAPO's overlong penalty (returned second; None when
        off) from its length `lengths` (rows,) in tokens."""
        rl = self.cfg.rl_config
        scores = torch.tensor(scored.rewards, dtype=torch.float32)
        if not rl.overlong_buffer_enable:
            return scores, None
        penalty = overlong_penalty(
            lengths, int(rl.rollout_max_tokens), rl.overlong_buffer, rl.overlong_buffer_penalty_factor
        ).float()
        return scores + penalty, penalty

    def _score(
        self, batch: Batch, labels: list[list[int]], timing: dict[str, float], scored: Scores | None = None
    ) -> Scores:
        """Old logprobs (skipped on-policy), reference logprobs, critic values and the reward model's scores ("rm_scores")
        into the batch; the rewards returned: the rule rewards' answer (or `scored`, when they are known already), with
        the reward model's scores mixed in. The rule rewards run in the background, the critic's values and the
        reward model's scores alongside the actor's passes."""
        t_score = time.perf_counter()
        responses = batch.rows_meta["response_ids"]
        reward_ref = self.reward.score(responses, labels) if scored is None else None
        fwd = batch.select(experience.FORWARD_KEYS)
        values = self.critic.compute_values.start(fwd) if self.critic is not None else None
        rm = None
        if self.reward_model is not None and scored is None:
            rm = self.reward_model.compute_scores.start(batch.select(SCORE_KEYS))
        elif self.reward_model is not None:  # dynamic sampling scored and mixed them already
            batch["rm_scores"] = torch.tensor(scored.model_scores, dtype=torch.float32)
        if not self.cfg.rl_config.on_policy:
            with _timed(timing, "timing/old_log_p"):
                batch["old_log_prob"] = self.actor.compute_log_prob(fwd, reference=False).tensor
        if self.needs_ref and "ref_log_prob" not in batch:  # bounded: samplers may have sent them (async_sampler_ref)
            with _timed(timing, "timing/reference_model"):
                batch["ref_log_prob"] = (self.reference or self.actor).compute_log_prob(fwd, reference=True).tensor
            timing["timing/non_overlap_reference_model"] = timing["timing/reference_model"]
        if values is not None:
            with _timed(timing, "timing/non_overlap_critic_model"):
                gathered = values.wait()
            batch["values"] = gathered.tensor
            timing["timing/critic_model"] = gathered.seconds
        if rm is not None:
            with _timed(timing, "timing/non_overlap_reward_model"):
                got = rm.wait()
            batch["rm_scores"] = got.tensor[:, 0]
            timing["timing/reward_model"] = got.seconds
        if reward_ref is not None:
            with _timed(timing, "timing/non_overlap_rule_reward"):
                scored = self.reward.collect(reward_ref, self.iteration)
            timing["timing/rule_reward"] = scored.metrics["timing/rule_reward"]
        if rm is not None:
            scored = self._mix_model_scores(scored, batch["rm_scores"].tolist())
        timing["timing/scoring"] = time.perf_counter() - t_score
        return scored

    def _mix_model_scores(self, scored: Scores, model_scores: list[float], update: bool = True) -> Scores:
        """The rule rewards with the reward model's scores mixed in (normalised and clipped as configured, weighted;
        `mindrl.rewards.model_scores`; update=False leaves the running statistics as they are); the raw scores kept
        in `Scores.model_scores`."""
        shaped = shaped_model_scores(model_scores, self.rm_mix, self.rm_moments, update)
        return dataclasses.replace(
            scored, rewards=mix_rewards(scored.rewards, shaped, self.rm_mix), model_scores=model_scores
        )

    def _advantages(self, batch: Batch, scored: Scores) -> dict[str, float]:
        """token_level_scores / rewards (with the KL penalty, if in the reward), advantages and returns into the
        batch; returns their metrics."""
        rl = self.cfg.rl_config
        mask = batch["response_mask"]
        scores, penalty = self._shaped_scores(scored, mask.sum(-1))
        token_scores = scores_to_token_level(scores, mask)
        metrics: dict[str, float] = {}
        if penalty is not None:
            metrics["reward/overlong_penalty"] = penalty.mean().item()
            metrics["reward/overlong_ratio"] = (penalty < 0).float().mean().item()
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
        available = {
            "gamma": rl.gamma,
            "lam": rl.lam,
            "index": batch.rows_meta["uid"],
            "norm_adv_by_std": rl.norm_adv_by_std_in_grpo,
        }
        if "values" in batch:
            available["values"] = batch["values"]
        wanted = inspect.signature(estimator).parameters
        adv, ret = estimator(rewards, response_mask=mask, **{k: v for k, v in available.items() if k in wanted})
        batch["token_level_scores"] = token_scores
        batch["token_level_rewards"] = rewards
        batch["advantages"] = adv
        batch["returns"] = ret
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
            self.checkpoints.save(
                self.iteration,
                self._trainer_state(),
                self._write_model,
                self._write_reference if self.sync_ref else None,
            )
        except SaveAborted as e:  # a rank failed writing: its group is gone
            raise TrainingAborted(f"{e}{self._resume_hint()}") from e.__cause__

    def _write_model(self, role: str, it_dir: str, optim: bool, rng: bool) -> None:
        group = self.actor if role == "actor" else self.critic
        group.save(it_dir, optim, rng)

    def _write_reference(self, ref_dir: str) -> None:
        self.actor.save_reference(ref_dir)

    def _trainer_state(self) -> TrainerState:
        return TrainerState(
            iteration=self.iteration,
            loader=self.loader.state_dict(),
            kl_ctrl=self.kl_ctrl.state_dict(),
            skipped_in_a_row=self.skipped_in_a_row,
            save_failures=self.save_failures,
            reference_saved=self.sync_ref,
            config_name=self.cfg.config_name,
            reward_moments=self.rm_moments.state_dict() if self.rm_mix is not None else None,
            partial_rollout=self.partial.state_dict() if self.partial is not None else None,
            **(async_bounded.trainer_state(self.bounded) or async_rollout.trainer_state(self.ahead)),
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
            self.rm_moments.load_state_dict(state.reward_moments)
        if self.partial is not None:
            self.partial.load_state_dict(state.partial_rollout, self.iteration)
        async_rollout.restore(self.ahead, state)
        async_bounded.restore(self.bounded, state)
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
        if getattr(self, "bounded", None) is not None:  # the samplers' ZeroMQ ports
            self.bounded.close()
            self.bounded = None
        if getattr(self, "remote", None) is not None:  # the rollout servers' HTTP connections
            self.remote.close()
        if getattr(self, "started_ray", False):
            stop_ray()
            self.started_ray = False


@contextlib.contextmanager
def _timed(timing: dict[str, float], key: str):
    """timing[key] = the seconds the block took."""
    t0 = time.perf_counter()
    yield
    timing[key] = time.perf_counter() - t0


def train(cfg) -> tuple[str, list[IterationResult]]:
    """Run `cfg` to the end; returns (run dir, per-iteration results)."""
    worker_groups.require_runnable(cfg)
    trainer = PPOTrainer(cfg)
    try:
        results = trainer.fit()
    finally:
        trainer.shutdown()
    return trainer.run_dir, results
