"""What every megatron worker rank does inside its Ray actor: join its model's torch.distributed world, set up
megatron's parallel state, take its input at the model-parallel source rank (tp 0, pp 0) and return its output."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from mindrl.platform import current_platform
from mindrl.workers.dispatch import Dispatch, register
from mindrl.workers.profiling import StageProfiler
from mindrl.workers.results import DeviceLedger

TRAINING_PHASES = ("train", "critic_train")
"""Phases that start with the platform's cache emptied (`Platform.empty_cache`): their updates are a step's peak."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    dp_rank: int
    dp_size: int
    is_source: bool  # receives the DP shard from the driver (tp 0, first pipeline stage)
    is_output: bool  # returns the DP shard's results (tp 0, last pipeline stage)


def node_address() -> tuple[str, int]:
    """(this node's address as Ray knows it, a free port) for rank 0 to host the world's rendezvous: loopback on a
    private local Ray, the node's cluster address on a multi-node cluster."""
    import ray

    from mindrl.launch import free_port

    return ray.util.get_node_ip_address(), free_port()


class MegatronRank:
    """Base of the Ray worker classes. Methods run in the worker process."""

    def node_address(self) -> tuple[str, int]:
        return node_address()

    def init_world(
        self, rank: int, world_size: int, master_addr: str, master_port: int, threads: int = 1
    ) -> tuple[int, bool]:
        """Join the model's world; returns (this process's pid, whether it computes deterministically)."""
        from mindrl.launch import join_world

        join_world(rank, world_size, master_addr, master_port, timeout_s=1800, threads=threads)
        self.rank = rank
        self.profiler = StageProfiler(None, rank)  # setup() configures it from the settings' `profile`
        self.ledger: dict[str, dict[str, dict[str, int]]] = {}  # phase -> model -> term -> bytes (memory_ledger)
        self.phase: str | None = None  # the phase of the iteration (enter_phase); None before the first
        return os.getpid(), torch.are_deterministic_algorithms_enabled()

    def init_layout(self, tp: int, pp: int, seed: int, cp: int = 1, ep: int = 1) -> RankInfo:
        from megatron.core import parallel_state as ps

        from mindrl.launch import init_model_parallel

        init_model_parallel(tp, pp, seed, cp=cp, ep=ep)
        first_cp = ps.get_context_parallel_rank() == 0  # the CP ranks of a DP rank compute the same outputs
        self.info = RankInfo(
            rank=self.rank,
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            is_source=ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_first_stage(),
            is_output=ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage() and first_cp,
        )
        return self.info

    def _setup_trained(self, s: Any, m: Any) -> tuple[RankInfo, Any]:
        """The start of setup() on a rank that trains `m` (settings `s`, their ModelSettings `m`): keep `s`, profile
        per s.profile, lay out TP x PP, build the model with self.spec, self.optimizer and self.scheduler from
        m.load, and restore their train state from m.resume_dir if set. Returns (this rank's RankInfo, the model)."""
        from mindrl.checkpoint.train_state import load_train_state
        from mindrl.workers.train_setup import build_model_and_optimizer

        self.settings = s
        self.profiler = StageProfiler(s.profile, self.rank)
        info = self.init_layout(m.tp, m.pp, m.seed, m.cp, m.ep)
        self.spec, model, self.optimizer, self.scheduler = build_model_and_optimizer(
            m.load,
            m.tp,
            m.pp,
            m.optim,
            m.total_steps,
            m.dtype,
            m.sequence_parallel,
            m.load_iteration,
            m.recompute,
            cp=m.cp,
            lora=m.lora,
            seed=m.seed,
            ep=m.ep,
            moe=m.moe,
            layers_per_stage=m.layers_per_stage,
        )
        if m.resume_dir is not None:
            load_train_state(model, self.optimizer, self.scheduler, m.resume_dir, m.load_optim, m.load_rng)
        return info, model

    def _ppo_update(self, model, shard, role: str, m: Any, num_mini_batches: int, epochs: int):
        """`rl_model.ppo_update` of `model` (the actor or the critic, per `role`; its ModelSettings `m`) with this
        rank's optimizer and scheduler and the settings' loss."""
        from mindrl.workers.rl_model import ppo_update

        return ppo_update(
            model,
            self.optimizer,
            self.scheduler,
            shard,
            role,
            self.settings.loss,
            m.micro_batching(False),
            num_mini_batches,
            epochs,
            step_context=self._step_context(role),
        )

    def _step_context(self, role: str):
        """A context around each optimizer step of `role`'s update; None: nothing around it."""
        return None

    @register(Dispatch.ALL)
    def profile_iteration(self, iteration: int | None) -> list[str]:
        """The iteration about to run (None: none is profiled any more), sent by the driver while profiling is on.
        Returns the traces this worker has written so far."""
        self.profiler.set_iteration(iteration)
        return list(self.profiler.written)

    # ------------------------------------------------------------------------------------ residency
    def _offloaders(self) -> dict[str, Any]:
        """model name (actor, reference, critic) -> the TrainStateOffloader of its state on this rank."""
        return {}

    def _held(self) -> dict[str, dict[str, int]]:
        """model -> term -> bytes its storages hold on the device now."""
        from mindrl.resharding.residency import TERMS

        return {m: {TERMS[k]: v for k, v in off.device_bytes().items()} for m, off in self._offloaders().items()}

    @register(Dispatch.ALL)
    def enter_phase(self, phase: str) -> None:
        """Put this rank's models where the settings' `ResidencySchedule` has them when `phase` begins, and record
        what they hold then in the ledger (no communication: each rank moves its own shards)."""
        for model, offloader in self._offloaders().items():
            offloader.place(self.settings.residency.on_entry(model, phase))
        if phase in TRAINING_PHASES:  # the peak phases: what the phases before freed goes back (CPU: glibc's free
            current_platform().empty_cache()  # pages); elsewhere the freed memory is reused (no page faults)
        self.phase = phase
        self.ledger[phase] = self._held()

    def _note_held(self, phase: str | None = None) -> None:
        """Fold what the models hold now into the ledger of `phase` (default: the current one), which keeps the most
        each term held during it (called as a computation of the phase ends: an update's first step creates Adam's
        state)."""
        phase = phase or self.phase
        if phase is None:
            return
        entry = self.ledger.setdefault(phase, {})
        for model, terms in self._held().items():
            for term, n in terms.items():
                entry.setdefault(model, {})[term] = max(entry.get(model, {}).get(term, 0), n)

    @register(Dispatch.ALL)
    def memory_ledger(self) -> DeviceLedger:
        """The phases recorded since the last call (`enter_phase`, and the rollout's own), then forgotten."""
        out = DeviceLedger(self.ledger)
        self.ledger = {}
        return out

    def receive(self, obj: Any) -> Any:
        """The source rank's `obj`, on every rank of this model-parallel group."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        if torch.distributed.get_world_size(group) == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=torch.distributed.get_global_rank(group, 0), group=group)
        return box[0]

    def output(self, value: Any) -> Any:
        return value if self.info.is_output else None
