"""RolloutWorker: a vLLM engine rank alone on its own bundle (separate placement with `rl_config.rollout_resource`,
docs/placement.md): no training model; the actor's weights arrive over the weight group each iteration."""

from __future__ import annotations

import time

import torch

from mindrl.workers.dispatch import Dispatch, register
from mindrl.workers.rank import MegatronRank, RankInfo


class RolloutWorker(MegatronRank):
    def setup(self, rollout) -> RankInfo:
        """`rollout`: the engine's RolloutConfig (infer TP ranks per replica; replicas = the group's world / TP)."""
        from mindrl.rollout import VllmEngine

        self.config = rollout
        self.engine = VllmEngine(rollout)  # never sleeps: nothing else needs this device
        itp = rollout.infer_tensor_parallel_size
        world = torch.distributed.get_world_size()
        self.replica_groups = [torch.distributed.new_group(list(range(r, r + itp))) for r in range(0, world, itp)]
        self.replica = self.rank // itp
        self.version: int | None = None  # the actor's weight version the engine holds (None: dummy weights)
        self.weights = None
        self.kept: dict[str, torch.Tensor] | None = None
        self.info = RankInfo(self.rank, self.replica, world // itp, self.rank % itp == 0, self.rank % itp == 0)
        return self.info

    @register(Dispatch.PER_RANK)
    def join_weights(self, addr: str, port: int, group_rank: int, group_size: int, timeout_s: float) -> None:
        """Join the actor-to-engines weight group (`mindrl.workers.weight_sync`) as `group_rank`."""
        from mindrl.workers.weight_sync import join

        self.weights = join(addr, port, group_rank, group_size, timeout_s)

    @register(Dispatch.ALL)
    def receive_weights(self, version: int, keep: bool = False) -> float:
        """Collective with the actor's `send_weights`: load weight `version` from the weight group (newer than the
        one held). keep: also keep a copy of what arrived (`received_weights`, for tests). Returns the seconds."""
        from mindrl.workers.weight_sync import WeightSyncError

        if self.version is not None and version <= self.version:
            raise WeightSyncError(f"weight version {version} is not newer than the engine's {self.version}")
        t0 = time.perf_counter()
        kept: dict[str, torch.Tensor] = {}
        done = []

        def stream():
            for name, t in self.weights.receive(version):
                if keep:
                    kept[name] = t.detach().to("cpu", copy=True)
                yield name, t
            done.append(True)

        self.engine.load_weights(stream())
        if not done:
            raise WeightSyncError(f"weight version {version}: the engine stopped reading before the stream's end")
        self.version = version
        self.kept = kept if keep else None
        return time.perf_counter() - t0

    @register(Dispatch.ALL)
    def received_weights(self) -> dict[str, torch.Tensor] | None:
        """What the last `receive_weights(keep=True)` loaded, on rank 0 (the others None)."""
        return self.kept if self.rank == 0 else None

    @register(Dispatch.PER_RANK)
    def generate(self, prompts, seeds, sampling, version: int) -> tuple[list | None, dict]:
        """This replica's prompts (given to its first rank) with weight `version`, which the engine must hold.
        Returns (samples on the replica's first rank else None, timings)."""
        if self.version != version:
            raise RuntimeError(f"the engine holds weight version {self.version}, the rollout asked for {version}")
        itp = self.config.infer_tensor_parallel_size
        if itp > 1:
            box = [(prompts, seeds)]
            torch.distributed.broadcast_object_list(
                box, src=self.replica * itp, group=self.replica_groups[self.replica]
            )
            prompts, seeds = box[0]
        t0 = time.perf_counter()
        with self.profiler.stage("actor_generate"):
            samples = self.engine.generate([list(p) for p in prompts], sampling, seeds)
        return (samples if self.rank % itp == 0 else None), {"timing/rollout": time.perf_counter() - t0}

    @register(Dispatch.ALL)
    def shm_names(self) -> list[str]:
        """The engine's shared-memory names, for the driver to clean up if this process gets killed."""
        names = [getattr(self.engine, "shm_ident", None), *getattr(self.engine, "shm_segments", ())]
        return [n for n in names if n]

    def shutdown(self) -> None:
        """Before the group kills this process: the engine releases what would outlive it (its shared memory)."""
        if getattr(self, "engine", None) is not None:
            self.engine.release_for_exit()
