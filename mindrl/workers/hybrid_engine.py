"""The hybrid engine: a megatron actor (train layout) and a rollout engine (infer layout) in one process per device;
`generate` reshards to inference, samples, reshards back, and checks the engine's logprobs against the actor's."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps

from mindrl.models.forward import forward_outputs
from mindrl.models.hf_config import ModelSpec
from mindrl.platform.detect import current_platform
from mindrl.resharding import OffloadConfig, ShardingManager, TrainStateOffloader, WeightStreamer
from mindrl.resharding.stream import unwrap
from mindrl.rollout.base import RolloutEngine, RolloutSample, SamplingConfig, processed_logprobs
from mindrl.workers.results import logprob_diff_summary

logger = logging.getLogger("mindrl.hybrid_engine")


@dataclass
class RolloutStats:
    """Timings of one generate() round trip (this rank)."""

    reshard_s: float  # offload + stream the weights into the engine
    peak_extra_bytes: int  # the stream's peak of live gathered bytes
    rollout_s: float  # engine.generate
    onload_s: float  # reshard_to_train
    generated_tokens: int  # by this rank's engine replica
    device_bytes: dict[str, int]  # the actor's params / grads / optimizer on the device while the engine ran

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.rollout_s if self.rollout_s > 0 else 0.0


class HybridEngine:
    """One rank's actor + rollout engine. Every method is collective over all ranks of the world."""

    def __init__(
        self,
        actor,  # megatron DDP (or bare GPTModel) of this rank's pipeline stage
        spec: ModelSpec,
        optimizer,
        engine: RolloutEngine,
        offload: OffloadConfig | None = None,
        bucket_size_mb: float = 512,
        logprob_diff_warn: float = 0.05,
    ):
        self.actor = actor
        self.spec = spec
        self.engine = engine
        self.logprob_diff_warn = logprob_diff_warn
        offload = offload or OffloadConfig(True, True, False)
        self.manager = ShardingManager(
            WeightStreamer(actor, spec, bucket_size_mb), TrainStateOffloader([actor], optimizer, offload)
        )
        self.awake = False
        if engine.supports_sleep:
            engine.sleep()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seeds: Sequence[int] | None = None,
        onload: Iterable[str] | None = None,
    ) -> tuple[list[list[RolloutSample]], RolloutStats]:
        """reshard_to_infer -> rollout (n samples per prompt) -> reshard_to_train, which brings back the offloaded
        kinds in `onload` (default: all of them)."""
        reshard_s, peak, held = self.wake()
        samples, rollout_s = self.sample(prompts, sampling, seeds)
        onload_s = self.rest(onload)
        tokens = sum(len(s.token_ids) for group in samples for s in group)
        return samples, RolloutStats(reshard_s, peak, rollout_s, onload_s, tokens, held)

    def wake(self) -> tuple[float, int, dict[str, int]]:
        """reshard_to_infer: the engine holds the actor's current weights and its KV cache until `rest`, so that
        several `sample` calls (an agent loop's turns) share one weight load. Returns (seconds, the stream's peak of
        live gathered bytes, the actor's bytes left on the device)."""
        if self.awake:
            raise RuntimeError("HybridEngine.wake: the engine is already awake (rest() first)")
        t0 = time.perf_counter()
        if self.engine.supports_sleep:
            self.engine.wake(["weights"])
        to_infer = self.manager.reshard_to_infer(self.engine.load_weights)
        held = (to_infer.offload_after or to_infer.offload_before).device_bytes_after
        if self.engine.supports_sleep:
            self.engine.wake(["kv_cache"])
        self.awake = True
        return time.perf_counter() - t0, to_infer.reshard.peak_extra_bytes, held

    def sample(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int] | None = None
    ) -> tuple[list[list[RolloutSample]], float]:
        """n samples per prompt from the weights the last `wake` loaded; (samples, seconds)."""
        if not self.awake:
            raise RuntimeError("HybridEngine.sample: the engine is asleep (wake() loads the actor's weights first)")
        t0 = time.perf_counter()
        samples = self.engine.generate([list(p) for p in prompts], sampling, seeds)
        return samples, time.perf_counter() - t0

    def rest(self, onload: Iterable[str] | None = None) -> float:
        """reshard_to_train: the engine sleeps and the offloaded kinds in `onload` (default: all) come back; seconds."""
        t0 = time.perf_counter()
        if self.engine.supports_sleep:
            self.engine.sleep()
        self.manager.reshard_to_train(onload)
        self.awake = False
        return time.perf_counter() - t0

    @torch.no_grad()
    def actor_logprobs(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[torch.Tensor] | None:
        """The actor's logprob of every response token under the sampling distribution (the trainer's
        old-logprob); on the last pipeline stage, None elsewhere. prompts[i] pairs with responses[i]."""
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        logits = forward_outputs(unwrap(self.actor), ids, mask)
        if logits is None:
            return None
        token_lp = processed_logprobs(logits[:, :-1], sampling).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return [token_lp[i, len(p) - 1 : len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))]

    def logprob_diff_metrics(
        self, prompts: Sequence[Sequence[int]], samples: list[list[RolloutSample]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """`rollout/logprob_diff_mean` and `_max` of |engine - actor| over every sampled token of every engine
        replica in the world (the same numbers on all ranks). Warns when the mean exceeds logprob_diff_warn."""
        flat_prompts, flat = _all_replica_samples(prompts, samples, getattr(self.engine, "tp_rank", 0))
        actor = self.actor_logprobs(flat_prompts, [s.token_ids for s in flat], sampling)
        stats = torch.zeros(3, dtype=torch.float64)  # sum |diff|, count, max |diff|
        if actor is not None and ps.get_tensor_model_parallel_rank() == 0:
            for lp, s in zip(actor, flat):
                d = (lp.double() - torch.tensor(s.logprobs, dtype=torch.float64)).abs()
                stats += torch.tensor([d.sum().item(), d.numel(), d.max().item() if d.numel() else 0.0])
        stats = stats.to(current_platform().device())  # the collectives' backend may need the device (nccl, hccl)
        maxes = stats[2:].clone()
        torch.distributed.all_reduce(stats[:2])
        torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX)
        return logprob_diff_summary(stats[0].item(), stats[1].item(), maxes.item(), self.logprob_diff_warn)


def _all_replica_samples(prompts, samples, engine_tp_rank: int):
    """Every engine replica's samples, on every rank (TP peers of a replica hold identical samples: only
    their first rank contributes). Returns (prompt per sample, sample) flat lists in a fixed order."""
    mine = [(list(p), s) for p, group in zip(prompts, samples) for s in group] if engine_tp_rank == 0 else []
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    flat = [item for part in gathered for item in part]
    return [p for p, _ in flat], [s for _, s in flat]
