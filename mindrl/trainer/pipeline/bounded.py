"""rl_config.async_mode bounded, a schedule whose engines are samplers outside the trainer: the batches come from
samplers over ZeroMQ or from sampler actors on the Ray transport (`Intake`), the actor's weights are published every
weight_sync_interval updates, and the prompt ledger goes into the checkpoint."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mindrl.data.prompt_dataset import PromptDataset
from mindrl.data.prompt_ledger import PromptLedger
from mindrl.serving.transport import TrainerEnd, TransportTimeout, ZmqTrainerEnd
from mindrl.trainer import experience
from mindrl.trainer.pipeline.intake import Intake, to_generated
from mindrl.trainer.pipeline.schedule import Generated, Schedule, refuse_pending

logger = logging.getLogger(__name__)


@dataclass
class Bounded(Schedule):
    """async_mode bounded as a schedule: each generation batch is the next `intake.groups` groups the samplers
    delivered (no older than max_staleness versions); the actor's weights are published every `sync_interval`
    updates."""

    end: TrainerEnd
    intake: Intake
    sync_interval: int
    dataset: PromptDataset
    n: int
    export: Callable[[], object] | None = None
    """The actor's current weights (set once its workers are up)."""
    published: int | None = None
    """The newest weight version published (None: none yet; samplers wait for one)."""
    actors: list = field(default_factory=list)
    """The sampler actors (rl_config.async_samplers; none on the ZeroMQ transport)."""
    actors_pg: object = None
    """The sampler actors' placement group (async_sampler_cpus / async_sampler_devices; None: they claim nothing)."""

    def next(self, iteration: int, gen_batch: int, timing: dict[str, float]) -> Generated:
        """The groups for the update of weight version iteration - 1, their prompts checked against the dataset's rows
        (whose labels they take), with the batch's async/* metrics."""
        try:
            groups, metrics = self.intake.take(iteration - 1)
        except TransportTimeout as e:
            raise TransportTimeout(f"{e}{self._actor_errors()}") from None
        rows = [g[0].prompt_index for g in groups]
        prompts = self.dataset.batch(rows)
        for g, p in zip(groups, prompts.prompts):
            if g[0].prompt_ids.astype("int64").tolist() != p.tolist():
                raise ValueError(
                    f"sampler {g[0].sampler_id!r} sent prompt_index {g[0].prompt_index} whose prompt differs from "
                    "that row of megatron_training.data_path: samplers and trainer must read the same dataset with "
                    "the same max_prompt_length"
                )
        out = to_generated(groups, experience.row_labels(prompts.extras, self.n, len(groups) * self.n))
        out.metrics.update(metrics)
        return out

    def after_update(self, iteration: int, timing: dict[str, float]) -> None:
        """Publish the weights (version = updates done) when due: every sync_interval updates, and the first time."""
        if self.published is None or iteration % self.sync_interval == 0:
            t0 = time.perf_counter()
            self.end.publish_weights(iteration, self.export())
            self.published = iteration
            timing["timing/publish_weights"] = time.perf_counter() - t0

    def state_dict(self) -> dict:
        return {"async_rollout": {"bounded": {"ledger": self.end.ledger_state()}}}

    def load_state_dict(self, state, iteration: int) -> None:
        """The ledger of a checkpoint (one from another mode has none: the ledger starts at epoch 0); the previous
        run's samplers are declared dead, so the prompts they held are re-issued (a group they deliver late still
        counts once)."""
        refuse_pending(state)
        saved = (state.async_rollout or {}).get("bounded")
        if saved is not None:
            self.end.restore_ledger(saved["ledger"])

    def _actor_errors(self) -> str:
        """The errors that ended sampler actors, for a batch that did not fill."""
        if not self.actors:
            return ""
        import ray

        try:
            states = ray.get([a.status.remote() for a in self.actors], timeout=30)
        except Exception as e:  # noqa: BLE001 (a dead actor: its error is the answer)
            return f"; sampler actors: {e}"
        errors = [f"{s['sampler_id']}: {s['error']}" for s in states if s["error"]]
        return "; sampler actors failed: " + "; ".join(errors) if errors else ""

    def close(self) -> None:
        if self.actors:
            import ray

            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=60)
            except Exception as e:  # noqa: BLE001 (killed below in any case)
                logger.warning("bounded: sampler actors did not stop cleanly: %s", e)
            for a in self.actors:
                ray.kill(a)
            self.actors = []
        if self.actors_pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.actors_pg)
            self.actors_pg = None
        self.end.close()


def bounded(cfg, dataset: PromptDataset) -> Bounded:
    """The trainer's end of `cfg`'s bounded mode (async_transport ray: starts async_samplers sampler actors on the
    Ray transport; zmq: binds the ports external samplers connect to) over the prompts of `dataset`."""
    mt, rl = cfg.megatron_training, cfg.rl_config
    num_prompts = len(dataset)
    ahead = mt.global_batch_size * max(1, rl.max_staleness)
    if rl.async_transport == "ray":
        from mindrl.serving.transport import RayTrainerEnd

        end = RayTrainerEnd({"num_prompts": num_prompts, "seed": mt.seed, "shuffle": not mt.no_shuffle}, maxsize=ahead)
    else:
        ledger = PromptLedger(num_prompts, seed=mt.seed, shuffle=not mt.no_shuffle)
        end = ZmqTrainerEnd(ledger, rl.async_host, rl.async_data_port, rl.async_sync_port)
        logger.info("bounded: samplers connect to data %s, sync %s", end.data_address, end.sync_address)
    # samplers run at most max_staleness batches ahead of what the trainer has received (one at max_staleness 0)
    end.set_max_in_flight(ahead)
    intake = Intake(end, mt.global_batch_size, rl.max_staleness, timeout_s=rl.async_timeout_s)
    b = Bounded(end, intake, rl.weight_sync_interval, dataset, rl.n_samples_per_prompt)
    if rl.async_transport == "ray":
        from mindrl.serving import sampler_actor

        try:
            cpus, devices = rl.async_sampler_cpus, rl.async_sampler_devices
            b.actors_pg = sampler_actor.reserve(rl.async_samplers, cpus, devices, rl.async_timeout_s)
            b.actors = sampler_actor.spawn(rl.async_samplers, end.hub, sampler_spec(cfg), pg=b.actors_pg,
                                           threads=sampler_actor.threads_of(cpus, devices))  # fmt: skip
        except BaseException:
            b.close()
            raise
        logger.info("bounded: %d sampler actors (%s%s) on the Ray transport", len(b.actors), rl.async_sampler_engine,
                    f", each on a bundle of {sampler_actor.bundle(cpus, devices)}" if b.actors_pg else "")  # fmt: skip
    return b


def sampler_spec(cfg):
    """The sampler actors' `SamplerSpec`: the run's dataset, model dir and sampling, paths made absolute
    (actors may start in another directory)."""
    from mindrl.serving.sampler_actor import SamplerSpec

    mt, rl, gen = cfg.megatron_training, cfg.rl_config, cfg.generate_config
    s = gen.sampling_config
    return SamplerSpec(
        model=os.path.abspath(gen.tokenizer_name_or_path or mt.tokenizer_name_or_path),
        data_path=os.path.abspath(mt.data_path),
        max_prompt_length=rl.max_prompt_length,
        n=rl.n_samples_per_prompt,
        max_tokens=s.max_tokens,
        engine=rl.async_sampler_engine,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=mt.seed,
        # each actor generates its share of a trainer batch's prompts in one engine call
        lease_size=-(-mt.global_batch_size // max(1, rl.async_samplers or 1)),
        timeout_s=rl.async_timeout_s,
        ref_model=reference_dir(cfg) if rl.async_sampler_ref else None,
    )


def reference_dir(cfg) -> str:
    """async_sampler_ref: the HF dir the samplers load the reference model from (absolute)."""
    mt, rl, gen = cfg.megatron_training, cfg.rl_config, cfg.generate_config
    return os.path.abspath(rl.async_sampler_ref_model or gen.tokenizer_name_or_path or mt.tokenizer_name_or_path)
