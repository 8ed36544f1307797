"""IntegratedWorker: one Ray actor per device holding the actor (megatron TP x PP x DP + optimizer), the reference model
and the rollout engine (through `HybridEngine`), each on the device in the phases its `ResidencySchedule` says."""

from __future__ import annotations

import time

import torch

from mindrl.batch import Batch
from mindrl.resharding.residency import TERMS
from mindrl.workers.dispatch import Dispatch, register
from mindrl.workers.rank import MegatronRank, RankInfo
from mindrl.workers.results import LogProbs, UpdateResult
from mindrl.workers.settings import IntegratedSettings


class IntegratedWorker(MegatronRank):
    def setup(self, s: IntegratedSettings) -> RankInfo:
        from mindrl.checkpoint.loading import build_and_load
        from mindrl.resharding import OffloadConfig, TrainStateOffloader
        from mindrl.rollout import VllmEngine
        from mindrl.workers.hybrid_engine import HybridEngine

        a = s.actor
        info, self.actor = self._setup_trained(s, a)
        self.ref = self.ref_offloader = None
        if s.ref_load is not None:
            # Built at the actor's TP/PP/CP and dtype: each rank's reference shard pairs with its actor shard (sync).
            self.ref_spec, _, self.ref = build_and_load(
                s.ref_load, a.tp, a.pp, a.dtype, cp=a.cp, ep=a.ep, layers_per_stage=a.layers_per_stage
            )
            self.ref.eval()
            # Off the device except while scoring; on CPU a host-to-host copy each way that frees nothing, kept so
            # that the schedule and its ledger run there too.
            self.ref_offloader = TrainStateOffloader([self.ref], None, OffloadConfig(offload_train_param=True))
            self.ref_offloader.place(s.residency.on_entry("reference", "rollout"))
        self.hybrid, self.held_awake = None, False
        if s.remote_rollout:  # the rollout servers hold the engines: only the weight stream lives here
            from mindrl.resharding import WeightStreamer

            self.streamer = WeightStreamer(self.actor, self.spec, s.bucket_size_mb)
            self.actor_offloader = TrainStateOffloader([self.actor], self.optimizer, s.residency.actor_offload)
            return info
        engine = VllmEngine(s.rollout)
        offload = s.residency.actor_offload
        self.hybrid = HybridEngine(self.actor, self.spec, self.optimizer, engine, offload, s.bucket_size_mb)
        self.actor_offloader = self.hybrid.manager.offloader  # one record of what is offloaded
        # Engine replicas: consecutive groups of infer-TP ranks; their first rank receives the prompts.
        itp = s.rollout.infer_tensor_parallel_size
        world = torch.distributed.get_world_size()
        self.replica_groups = [torch.distributed.new_group(list(range(r, r + itp))) for r in range(0, world, itp)]
        self.replica = self.rank // itp
        return info

    @register(Dispatch.PER_RANK)
    def generate(self, prompts, seeds, sampling) -> tuple[list | None, dict]:
        """This engine replica's prompts (given to its first rank): reshard_to_infer -> rollout -> reshard_to_train,
        or only the rollout while `wake_engine` holds the engine awake. Returns (samples on the replica's first rank
        else None, timings)."""
        itp = self.settings.rollout.infer_tensor_parallel_size
        if itp > 1:
            box = [(prompts, seeds)]
            group = self.replica_groups[self.replica]
            torch.distributed.broadcast_object_list(box, src=self.replica * itp, group=group)
            prompts, seeds = box[0]
        with self.profiler.stage("actor_generate"):
            timing = {} if self.hybrid.awake else self.wake_engine()
            samples, timing["timing/rollout"] = self.hybrid.sample(prompts, sampling, seeds)
            if not self.held_awake:
                timing.update(self.sleep_engine())
        return (samples if self.rank % itp == 0 else None), timing

    @register(Dispatch.ALL)
    def wake_engine(self, hold: bool = False) -> dict:
        """reshard_to_infer: the engine holds the actor's weights; with `hold` until `sleep_engine`, across
        several `generate` calls (an agent loop's turns load the weights once). Collective over all ranks."""
        reshard_s, _, device_bytes = self.hybrid.wake()
        self.held_awake = hold
        held = self._held()
        held["actor"] = {TERMS[k]: v for k, v in device_bytes.items()}  # while the engine runs
        self.ledger["rollout"] = held
        return {"timing/reshard_to_infer": reshard_s, "rollout/weight_loads": 1.0}

    @register(Dispatch.ALL)
    def sleep_engine(self) -> dict:
        """reshard_to_train: the engine sleeps and what scoring needs comes back (scoring follows a rollout)."""
        self.held_awake = False
        return {"timing/reshard_to_train": self.hybrid.rest(self.settings.residency.on_device("actor", "score"))}

    @register(Dispatch.PER_RANK)
    def push_weights(
        self,
        version: int,
        urls: list[str],
        token: str | None,
        bucket_bytes: int,
        timeout: float,
        transfer: str = "http",
    ) -> list:
        """Rollout-server mode, collective over all ranks: stream the actor's weights in the inference layout (full HF
        tensors on every rank) and push them as `version` to `urls`, this rank's share of the servers (possibly
        none: the rank still takes part in the stream), by `transfer` ("http", "dist", or "auto": this platform's
        choice). One `PushOutcome` per url; a failing server does not fail the call (the driver decides)."""
        from mindrl.platform import current_platform
        from mindrl.serving.client import RolloutClient, push_to_servers

        if transfer == "auto":
            transfer = current_platform().weight_transfer
        clients = [RolloutClient(u, token, timeout) for u in urls]
        try:
            return push_to_servers(clients, version, self.streamer.stream(), bucket_bytes, transfer)
        finally:
            for c in clients:
                c.close()

    @register(Dispatch.PER_RANK)
    def join_weights(self, addr: str, port: int, group_rank: int, group_size: int, timeout_s: float) -> None:
        """Separate placement with rollout_resource: join the actor-to-engines weight group (`weight_sync`)."""
        from mindrl.workers.weight_sync import join

        self.weights = join(addr, port, group_rank, group_size, timeout_s)

    @register(Dispatch.ALL)
    def send_weights(self, version: int) -> tuple[float, int]:
        """Collective over the actor's ranks and the engines' (their `receive_weights`): stream the actor's weights
        in the inference layout (full HF tensors) over the weight group as `version`, in buckets of
        bucket_size_mb. Returns (seconds, bytes sent)."""
        t0 = time.perf_counter()
        with self.actor_offloader.holding(["param"], read_only=True):
            bucket = int(self.settings.bucket_size_mb * 1024 * 1024)
            _, nbytes = self.weights.send(version, self.streamer.stream(), bucket)
        return time.perf_counter() - t0, nbytes

    @register(Dispatch.ALL)
    def export_weights(self) -> dict | None:
        """async_mode bounded, collective over all ranks: the actor's full weights in HF layout, copied, on rank 0
        (the others None), for the driver to publish to the samplers."""
        full = {name: t.detach().to("cpu", copy=True) for name, t in self.streamer.stream()}
        return full if self.rank == 0 else None

    @register(Dispatch.DP_ROWS)
    def compute_log_prob(self, shard: Batch | None, reference: bool = False) -> LogProbs | None:
        """This DP shard's response logprobs under the actor (old_log_prob) or the reference model."""
        from mindrl.workers.rl_model import response_logprobs

        shard = self.receive(shard)
        t0 = time.perf_counter()
        s = self.settings
        if reference and self.ref is None and not s.share_backbone:
            raise RuntimeError("reference logprobs were requested but no reference model was configured")
        with self.profiler.stage("reference_compute_log_prob" if reference else "actor_compute_log_prob"):
            if reference and s.share_backbone:  # the actor's own weights, adapters off: no second copy
                from mindrl.models.lora import adapters_disabled

                with self.actor_offloader.holding(["param"], read_only=True), adapters_disabled(self.actor):
                    lp = response_logprobs(self.actor, shard, s.ref_micro_batching(), s.loss.temperature)
                    self._note_held()
            elif reference:
                with self.ref_offloader.holding(["param"], read_only=True):
                    lp = response_logprobs(self.ref, shard, s.ref_micro_batching(), s.loss.temperature)
                    self._note_held()
            else:
                with self.actor_offloader.holding(["param"], read_only=True):
                    lp = response_logprobs(self.actor, shard, s.actor.micro_batching(True), s.loss.temperature,
                                           record_routing=s.router_replay)  # fmt: skip
                    self._note_held()
        routed = None
        if isinstance(lp, tuple):
            lp, routed = lp
        return self.output(LogProbs(lp, time.perf_counter() - t0, routed))

    @register(Dispatch.DP_OUTPUT)
    def update_actor(self, shard: Batch | None, num_mini_batches: int, epochs: int) -> UpdateResult | None:
        shard = self.receive(shard)
        on = self.settings.residency.on_device("actor", "train")  # swap_optimizer: not the optimizer state
        with self.profiler.stage("actor_update"), self.actor_offloader.holding(on):
            result = self._ppo_update(self.actor, shard, "actor", self.settings.actor, num_mini_batches, epochs)
            self._note_held()
        return self.output(result)

    def _step_context(self, role: str):
        """swap_optimizer: each of the actor's optimizer steps brings its optimizer state to the device and sends it
        back after, recorded in the ledger's "step" phase."""
        if role != "actor" or not self.settings.residency.swap_optimizer:
            return None
        import contextlib

        from mindrl.resharding.residency import STEP

        @contextlib.contextmanager
        def step():
            with self.actor_offloader.stepping():
                yield
                self._note_held(STEP)

        return step

    @register(Dispatch.ALL)
    def sync_reference(self, alpha: float) -> float:
        """TR-DPO's reference update on this rank's shard: reference <- alpha * actor + (1 - alpha) * reference.
        Collective only in spirit (no communication: every rank mixes its own shard). Returns the seconds taken."""
        if self.ref is None:
            raise RuntimeError("sync_reference was called but no reference model was configured")
        t0 = time.perf_counter()
        with self.ref_offloader.holding(), self.actor_offloader.holding(["param"]):
            mix_into(self.ref, self.actor, alpha)
        return time.perf_counter() - t0

    @register(Dispatch.ALL)
    def save_reference(self, root: str) -> None:
        """Collective: the (synced) reference model as a weights-only checkpoint at root (an iteration's ref/)."""
        from mindrl.checkpoint.train_state import save_weights_only

        if self.ref is None:
            raise RuntimeError("save_reference was called but no reference model was configured")
        with self.ref_offloader.holding():
            save_weights_only(self.ref, self.ref_spec, "actor", self.settings.actor, root)

    @register(Dispatch.ALL)
    def save(self, it_dir: str, optim: bool, rng: bool) -> None:
        from mindrl.checkpoint.train_state import save_train_state

        a = self.settings.actor
        with self.actor_offloader.holding():
            save_train_state(self.actor, self.optimizer, self.scheduler, self.spec, "actor", a, it_dir, optim, rng)

    def _offloaders(self) -> dict:
        return {"actor": self.actor_offloader, **({"reference": self.ref_offloader} if self.ref is not None else {})}

    @register(Dispatch.ALL)
    def shm_names(self) -> list[str]:
        """The rollout engine's shared-memory names, for the driver to clean up if this process gets killed."""
        engine = self.hybrid.engine if self.hybrid is not None else None
        names = [getattr(engine, "shm_ident", None), *getattr(engine, "shm_segments", ())]
        return [n for n in names if n]

    def shutdown(self) -> None:
        """Before the group kills this process: the engine releases what would outlive it (its shared memory)."""
        if getattr(self, "hybrid", None) is not None:
            self.hybrid.engine.release_for_exit()


def mix_into(target: torch.nn.Module, source: torch.nn.Module, alpha: float) -> None:
    """target <- alpha * source + (1 - alpha) * target, parameter by parameter, in place (TR-DPO / TRL's reference
    update, in TRL's operation order: target * (1 - alpha) + alpha * source). Both are this rank's shards of the
    same network at the same TP/PP (wrappers such as DDP are looked through). Half-precision weights are mixed in
    fp32 and rounded once; alpha 1 copies source exactly and alpha 0 leaves target untouched."""
    from mindrl.resharding.stream import unwrap

    tgt, src = dict(unwrap(target).named_parameters()), dict(unwrap(source).named_parameters())
    if tgt.keys() != src.keys():
        only_t, only_s = sorted(tgt.keys() - src.keys()), sorted(src.keys() - tgt.keys())
        raise ValueError(
            f"the reference and the actor are different networks (reference only: {only_t[:3]}, actor only: "
            f"{only_s[:3]}): rl_config.sync_ref_model needs ref_model_load_path to hold the actor's architecture"
        )
    bad = [f"{n}: {tuple(t.shape)} vs {tuple(src[n].shape)}" for n, t in tgt.items() if t.shape != src[n].shape]
    if bad:
        raise ValueError(f"reference and actor parameter shapes differ ({'; '.join(bad[:3])}): rl_config."
                         "sync_ref_model needs ref_model_load_path to hold the actor's architecture")  # fmt: skip
    if alpha == 0.0:
        return
    with torch.no_grad():
        for name, t in tgt.items():
            s = src[name].detach()
            if alpha == 1.0:
                t.copy_(s)
            elif t.dtype == torch.float32 and s.dtype == torch.float32:
                t.mul_(1.0 - alpha).add_(s, alpha=alpha)
            else:
                t.copy_(t.float().mul_(1.0 - alpha).add_(s.float(), alpha=alpha))
