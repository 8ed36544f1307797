"""The driver: the PPO / GRPO loop over Ray worker groups. It holds the loop, the prompt sampler, the KL
controller and the metrics; the workers hold every model tensor.

One iteration: prompts -> rollout (reshard to infer, sample, reshard to train) -> rule rewards (CPU, in the
background) | old logprobs (skipped on-policy) | reference logprobs | critic values -> advantages -> critic
update -> actor update -> metrics -> checkpoint on cadence.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import shutil
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
from mindrl.checkpoint.iterations import TrainerState
from mindrl.checkpoint.resume import ResumePoint, find_resume
from mindrl.checkpoint.save import CheckpointSaveError, RunCheckpoints, SaveAborted
from mindrl.trainer import build
from mindrl.trainer.metrics import stats_metrics
from mindrl.trainer.rollout import IntegratedRollout, RemoteRolloutError, RolloutSource, connect_servers

logger = logging.getLogger("mindrl.trainer")


SHM_RECORD = ".engine_shm.json"
"""In the run dir while the run's engines live: their /dev/shm names, removed by the next run if this one was
killed (a SIGKILLed driver cannot clean up; Ray's reaper stops the workers, not their shared memory)."""


SHM_PREFIXES = ("mindrl", "psm_")  # our engines' TP segments; vLLM's message-queue buffers (Python's default names)

TEMP_RECORD = ".reward_tmp.json"
"""In the run dir while the run's rule-reward worker lives: {"host", "path"} of its multiprocessing temporary
folder (pymp-*), removed by the next run on that host if this one was killed (Ray's reaper kills the worker, which
then runs no exit handler)."""


def _read_record(path: str) -> list | None:
    try:
        with open(path) as f:
            found = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return []
    return found if isinstance(found, list) else []


def _remove_leftovers(run_dir: str) -> None:
    """What a previous run in `run_dir` that did not shut down (a SIGKILLed driver) left behind and recorded: its
    engines' shared memory and its reward worker's temporary folder (this host's)."""
    import socket

    from mindrl.rollout.vllm_engine import remove_shm_segments

    path = os.path.join(run_dir, SHM_RECORD)
    idents = _read_record(path)
    if idents is not None:
        for ident in idents:
            if isinstance(ident, str) and ident.startswith(SHM_PREFIXES):
                remove_shm_segments(ident)
        logger.info("removed the shared memory of a previous run in %s that did not shut down", run_dir)
        os.remove(path)
    path = os.path.join(run_dir, TEMP_RECORD)
    folders = _read_record(path)
    if folders is not None:
        host = socket.gethostname()
        for entry in folders:
            folder = entry.get("path") if isinstance(entry, dict) else None
            # only what the record can have named: an absolute multiprocessing folder
            if not (isinstance(folder, str) and os.path.isabs(folder) and os.path.basename(folder).startswith("pymp-")):
                continue
            if entry.get("host") == host:
                shutil.rmtree(folder, ignore_errors=True)
                logger.info("removed the reward worker's temporary folder %s of a previous run in %s that did not "
                            "shut down", folder, run_dir)  # fmt: skip
            else:
                logger.info("a previous run in %s left its reward worker's temporary folder %s on host %s",
                            run_dir, folder, entry.get("host"))  # fmt: skip
        os.remove(path)


class TrainingAborted(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite updates, a worker died)."""


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


def _token_metrics(role: str, counts: tuple[float, float, float, float]) -> dict[str, float]:
    """perf/* for the update's positions (see `mindrl.workers.rl_model._Plan`): the actor's unprefixed, the
    critic's as perf/critic_*. Its forward passes cut micro-batches the same way."""
    computed, real, untrimmed, shared = counts
    prefix = "perf/" if role == "actor" else "perf/critic_"
    return {
        f"{prefix}computed_tokens": computed,
        f"{prefix}real_tokens": real,
        f"{prefix}untrimmed_tokens": untrimmed,
        f"{prefix}shared_prompt_tokens": shared,
        f"{prefix}padding_ratio": 1.0 - (real - shared) / computed if computed else 0.0,
    }


class PPOTrainer:
    """Builds the Ray worker groups for `cfg` (a validated `mindrl.config.RLConfig`) and runs the loop."""

    def __init__(self, cfg):
        from transformers import AutoTokenizer

        from mindrl.data.prompt_dataset import PromptDataLoader, PromptDataset
        from mindrl.workers.critic_worker import CriticWorker
        from mindrl.workers.group import WorkerError, WorkerGroup, device_placement_group, start_ray, worker_threads
        from mindrl.workers.integrated_worker import IntegratedWorker

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

        # Everything that can be checked before Ray starts: where the run resumes, whether it can save.
        self.resume = find_resume(cfg)
        self.checkpoints = RunCheckpoints(cfg, writer_errors=(WorkerError,))
        self.checkpoints.check_writable()
        self.save_failures = 0
        self.sync_ref = rl.sync_ref_model  # validated at load: only with a reference model
        original_ref = self.resume is not None and self.resume.ref_dir is None  # not a synced one from the checkpoint
        if original_ref and self.needs_ref and not rl.integrated_mode_config.ref_model_load_path:
            raise ValueError(
                f"resuming from actor_config.load={cfg.actor_config.load!r} (finetune: false) needs "
                "rl_config.integrated_mode_config.ref_model_load_path: the reference model must be the initial "
                "policy, not the resumed one"
            )
        _remove_leftovers(self.run_dir)
        self.remote = None  # rollout servers: reachable, token accepted, before any worker starts
        if cfg.generate_config.rollout_mode == "server":
            self.remote = connect_servers(cfg.generate_config, rl.max_prompt_length + self.sampling.max_tokens)
        self.started_ray = start_ray(rl.ray_address, self.world, runtime_env_path=rl.runtime_env_path)
        self.groups: list = []
        try:
            self.pg = device_placement_group(self.world)
            integrated = build.integrated_settings(cfg, self.resume)
            self.profile = integrated.profile
            # The critic shares the actor's bundles (half a device each), in its own megatron world. Both get their
            # node's cores shared among the ranks there (they run in turn), not one thread each.
            threads = worker_threads(self.pg, self.world)
            self.actor = WorkerGroup(IntegratedWorker, "actor", self.pg, self.world, fraction=0.5, threads=threads)
            self.groups.append(self.actor)
            self.critic = None
            if rl.needs_critic:
                self.critic = WorkerGroup(CriticWorker, "critic", self.pg, self.world, fraction=0.5, threads=threads)
                self.groups.append(self.critic)
            self.reward = None
            self._start_reward_worker()
            self.actor.setup(integrated)  # collective: builds actor, reference and the engine
            self.shm_idents = {i for names in self.actor.call("shm_names") for i in names}
            with open(os.path.join(self.run_dir, SHM_RECORD), "w") as f:  # for the next run if this one is killed
                json.dump(sorted(self.shm_idents), f)
            if self.critic is not None:
                self.critic.setup(build.critic_settings(cfg, self.resume))
            self.rollout: RolloutSource = (
                self.remote.attach(self.actor)
                if self.remote is not None
                else IntegratedRollout(self.actor, integrated.rollout.infer_tensor_parallel_size)
            )
            self.iteration = 0
            self.skipped_in_a_row = 0
            self._restore(self.resume)
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
                self._profile_iteration()
                metrics, rows = self._step_or_abort(next(batches))
                metrics["checkpoint/save_failures"] = float(self.save_failures)
                # logged before the save: a resume cuts metrics.jsonl back to the saved iteration
                log.log(self.iteration, metrics)
                rollouts.maybe_log(self.iteration, rows)
                results.append(IterationResult(self.iteration, metrics))
                if mt.save_interval and self.iteration % mt.save_interval == 0 and self.iteration < mt.train_iters:
                    self._periodic_save()
            self.save()  # the last iteration is always saved; a failure here fails the run
        return results

    def _profile_iteration(self) -> None:
        """While profiling is on (profiler_config), tell every worker which iteration runs next; after the last
        profiled one, that none does, and where the traces went."""
        prof = self.profile
        if prof is None or not prof.start <= self.iteration <= prof.end:
            return
        profiled = self.iteration < prof.end
        written = []
        for group in self.groups:
            for traces in group.call("profile_iteration", None, self.iteration if profiled else None):
                written += traces
        if profiled:
            logger.info("profiler: recording iteration %d (%s) under %s", self.iteration, ", ".join(prof.stages),
                        prof.save_path)  # fmt: skip
        else:
            logger.info("profiler: %d traces of iterations %d-%d under %s", len(written), prof.start, prof.end - 1,
                        prof.save_path)  # fmt: skip

    def _step_or_abort(self, prompts) -> tuple[dict[str, float], list[dict]]:
        """`step`, with a dead or failing worker turned into an error naming the iteration (the group is already
        killed: no rank is left waiting in a collective)."""
        from mindrl.workers.group import WorkerError

        try:
            return self.step(prompts)
        except (WorkerError, RemoteRolloutError) as e:
            raise TrainingAborted(f"iteration {self.iteration}: {e}{self._resume_hint()}") from e

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

    def step(self, prompts) -> tuple[dict[str, float], list[dict]]:
        """One PPO / GRPO iteration on a PromptBatch. Returns (metrics, sampled rows for rollouts.jsonl)."""

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
        scored = self._collect_scores(reward_ref, batch.rows_meta["response_ids"], labels)
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
            critic_metrics = dict(parts[0][1])
            metrics.update(_token_metrics("critic", critic_metrics.pop("_tokens")))
            metrics.update(critic_metrics)
            timing["timing/update_critic"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        parts = self.actor.sharded("update_actor", batch.select(train_keys), self.num_mini, self.num_mini, rl.epochs)
        actor_metrics = dict(parts[0][1])
        timing["timing/update"] = time.perf_counter() - t0
        metrics.update(self._logprob_diff(batch, actor_metrics.pop("_logprob_diff")))
        metrics.update(_token_metrics("actor", actor_metrics.pop("_tokens")))
        metrics.update(actor_metrics)
        self._check_skipped(metrics)
        if self.sync_ref:  # TR-DPO: after the actor update of iterations K, 2K, ... (saved with this iteration)
            synced = self.iteration % rl.ref_model_sync_steps == 0
            if synced:
                timing["timing/ref_sync"] = max(self.actor.call("sync_reference", None, rl.ref_model_mixup_alpha))
            metrics["actor/ref_synced"] = float(synced)

        timing["timing/all"] = time.perf_counter() - t_all
        metrics.update(timing)
        metrics.update(self._throughput(metrics))
        rows = self._rollout_rows(batch, scored)
        return metrics, rows

    # ------------------------------------------------------------------------------------------------ pieces
    REWARD_SLACK_S = 60.0
    """A rule-reward call may take this long beyond its samples' own timeouts before the worker counts as hung."""
    REWARD_PING_S = 15.0
    """While a rule-reward call runs, the worker is pinged this often (and given as long to answer)."""
    REWARD_EXIT_S = 5.0
    """At shutdown, how long the rule-reward worker's own exit may take to remove its temporary folder."""
    REWARD_START_S = 300.0
    """A new rule-reward worker (a Ray worker process, its imports, its tokenizer) may take this long to start; until
    it has started (its first ping answered), a missed ping means "still starting", not "hung". The worker has 2
    threads, so that first reply can come after later calls' replies: a worker that hangs before sending it counts as
    starting, and is replaced after this bound."""

    def _start_reward_worker(self) -> None:
        import ray

        from mindrl.workers.reward_worker import RuleRewardWorker

        # 2 threads: `ping` is answered while `score` runs, so a hung worker is told from a slow batch.
        remote = ray.remote(num_cpus=0, max_concurrency=2)(RuleRewardWorker)
        self.reward = remote.remote(build.reward_settings(self.cfg))
        self._reward_started = self.reward.ping.remote()  # resolves once the actor's __init__ has returned
        self._reward_temp = self.reward.temp_dir.remote()
        self._reward_temp_recorded = False

    def _record_reward_temp(self) -> None:
        """Once the (current) reward worker has answered: its temporary folder into TEMP_RECORD, for the next run
        should this driver be killed (`_remove_leftovers`)."""
        import ray

        if self._reward_temp_recorded:
            return
        self._reward_temp_recorded = True
        try:
            _, host, path = ray.get(self._reward_temp, timeout=30)
        except Exception as e:  # died since it answered: the next call replaces it, and records the new one
            logger.warning("the rule-reward worker did not say where its temporary folder is: %s", e)
            return
        try:
            with open(os.path.join(self.run_dir, TEMP_RECORD), "w") as f:
                json.dump([{"host": host, "path": path}], f)
        except OSError as e:  # a record for a later cleanup: not worth failing the run over (e.g. a full disk)
            logger.warning("could not record the rule-reward worker's temporary folder %s: %s", path, e)

    def _kill_reward_worker(self, exiting: bool = False) -> None:
        """Kill the rule-reward worker and remove the multiprocessing folder it leaves behind in the temporary
        directory (killed, it runs no exit handler), when it ran on this node and had said where the folder is.
        exiting: the worker is ending through Python's exit (`shutdown`), whose handler removes the folder: wait a
        little for that first (removing it under the handler made the worker print a FileNotFoundError)."""
        import ray

        try:
            node, _, path = ray.get(self._reward_temp, timeout=5)
        except Exception:  # it never answered (killed while starting): nothing known to remove
            node = path = None
        here = path is not None and node == ray.get_runtime_context().get_node_id()
        if here and exiting:
            until = time.monotonic() + self.REWARD_EXIT_S
            while os.path.exists(path) and time.monotonic() < until:
                time.sleep(0.05)
        ray.kill(self.reward, no_restart=True)
        if path is None:
            return
        if here:
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.run_dir, TEMP_RECORD))

    def _collect_scores(self, ref, responses: list[list[int]], labels: list[list[int]]) -> dict:
        """The reward worker's answer. A worker that died, stops answering pings, or outlives the worst case of its
        samples' own timeouts (plus REWARD_SLACK_S) is replaced; its samples score 0 and are counted in
        reward/crashes."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        s = build.reward_settings(self.cfg)
        deadline = self.REWARD_SLACK_S + s.timeout * math.ceil(len(responses) / s.num_workers)
        t0 = time.perf_counter()
        while True:
            left = deadline - (time.perf_counter() - t0)
            try:
                scored = ray.get(ref, timeout=max(0.0, min(self.REWARD_PING_S, left)))
            except RayActorError:
                what = "died"
                break
            except GetTimeoutError:
                if left <= self.REWARD_PING_S:
                    what = f"did not answer within {deadline:.0f} s"
                    break
            else:
                self._record_reward_temp()
                return scored
            if not ray.wait([self._reward_started], timeout=0)[0]:
                # A replacement (or the first worker) still starting is not hung: wait for its start, which does
                # not count against the call's deadline.
                t_start = time.perf_counter()
                try:
                    ray.get(self._reward_started, timeout=self.REWARD_START_S)
                except RayActorError:
                    what = "died while starting"
                    break
                except GetTimeoutError:
                    what = f"did not start within {self.REWARD_START_S:.0f} s"
                    break
                deadline += time.perf_counter() - t_start
                continue
            try:
                ray.get(self.reward.ping.remote(), timeout=self.REWARD_PING_S)
            except (GetTimeoutError, RayActorError):
                what = f"stopped answering (no reply to a ping within {self.REWARD_PING_S:.0f} s)"
                break
        logger.warning(
            "iteration %d: the rule-reward worker %s; it is replaced and this batch's %d samples score 0 "
            "(counted in reward/crashes)",
            self.iteration,
            what,
            len(responses),
        )
        self._kill_reward_worker()
        self._start_reward_worker()
        zeros = [0.0] * len(responses)
        metrics = {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/crashes": float(len(responses))}
        metrics.update({"reward/worker_restarts": 1.0, "timing/rule_reward": time.perf_counter() - t0})
        metrics.update({f"reward/{name}/mean": 0.0 for name in self.verifier_names})
        return {
            "rewards": zeros,
            "per_verifier": [None] * len(responses),
            "texts": self.tokenizer.batch_decode(responses, skip_special_tokens=True),
            "labels": self.tokenizer.batch_decode(labels, skip_special_tokens=True),
            "metrics": metrics,
        }

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
        for k in ("reward/timeouts", "reward/errors", "reward/crashes", "reward/worker_restarts"):
            metrics[k] = float(scored["metrics"].get(k, 0.0))
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
        group.call("save", None, it_dir, optim, rng)

    def _write_reference(self, ref_dir: str) -> None:
        self.actor.call("save_reference", None, ref_dir)

    def _trainer_state(self) -> TrainerState:
        return TrainerState(
            iteration=self.iteration,
            loader=self.loader.state_dict(),
            kl_ctrl=self.kl_ctrl.state_dict(),
            skipped_in_a_row=self.skipped_in_a_row,
            save_failures=self.save_failures,
            reference_saved=self.sync_ref,
            config_name=self.cfg.config_name,
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
        logger.info("resumed from %s at iteration %d", resume.actor_dir, self.iteration)

    def shutdown(self) -> None:
        import ray

        for group in getattr(self, "groups", []):
            if group.name == "actor" and group.actors:
                try:  # engines remove their shared-memory segments
                    ray.get([a.shutdown.remote() for a in group.actors], timeout=60)
                except Exception as e:
                    logger.warning("engine shutdown: %s", e)
            group.shutdown()
        from mindrl.rollout.vllm_engine import remove_shm_segments

        for ident in getattr(self, "shm_idents", ()):  # those of engines whose process was killed (this host's)
            remove_shm_segments(ident)
        if getattr(self, "shm_idents", None) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.run_dir, SHM_RECORD))
        if getattr(self, "reward", None) is not None:
            from ray.exceptions import RayActorError

            exiting = False
            try:
                ray.get(self.reward.shutdown.remote(), timeout=30)
            except RayActorError:  # the call ends with the actor's exit
                exiting = True
            except Exception:
                pass
            self._kill_reward_worker(exiting)
            self.reward = None
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
        if getattr(self, "remote", None) is not None:  # the rollout servers' HTTP connections
            self.remote.close()
        if getattr(self, "started_ray", False):
            from mindrl.workers.group import stop_ray

            stop_ray()
            self.started_ray = False


def train(cfg) -> tuple[str, list[IterationResult]]:
    """Run `cfg` to the end; returns (run dir, per-iteration results)."""
    trainer = PPOTrainer(cfg)
    try:
        results = trainer.fit()
    finally:
        trainer.shutdown()
    return trainer.run_dir, results
