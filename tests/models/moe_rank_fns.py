"""Module-level functions the Qwen3-MoE training tests run on pool ranks."""

from __future__ import annotations

from mindrl.batch import Batch, shard_rows
from mindrl.workers.rl_model import PPOLossSettings, ppo_update
from mindrl.workers.train_setup import OptimSettings, build_model_and_optimizer
from tests.workers.ppo_rank_fns import flat, full_hf_tensors


def moe_update_grads_rank(
    load_dir: str, tp: int, ep: int, batch: Batch, loss: PPOLossSettings, dtype: str, moe: dict,
    layers_per_stage: tuple[int, ...] | None = None,
) -> dict:  # fmt: skip
    """One actor `ppo_update` at TP x EP, or at PP = len(layers_per_stage) with those layers per stage (sequence
    parallel under TP; DP = world / TP / PP) on this rank's shard of `batch`, without the optimizer step. Returns the
    metrics (the load-balancing loss among them), and on TP rank 0 the HF-named gradients this rank holds (its
    stage's dense ones; its EP rank's experts)."""
    from megatron.core import parallel_state as ps

    spec, ddp, optimizer, scheduler = build_model_and_optimizer(
        load_dir, tp, len(layers_per_stage or (1,)), OptimSettings(lr=1e-3, clip_grad=1e9), total_steps=1, dtype=dtype,
        ep=ep, moe=moe, layers_per_stage=layers_per_stage,
        sequence_parallel=tp > 1,  # megatron trains MoE layers under TP only with sequence parallelism
    )  # fmt: skip
    optimizer.step = lambda: (True, 0.0, None)  # the gradients are the result (an fp64 model has fp32 main_grads)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    shard = batch.index(shard_rows(len(batch), dp, 1)[dp_rank])
    metrics = flat(ppo_update(ddp, optimizer, scheduler, shard, "actor", loss, 1, 1, 1))
    grads = full_hf_tensors(ddp, spec, grads=True)
    return {"metrics": metrics, "grads": grads if ps.get_tensor_model_parallel_rank() == 0 else None}


def moe_replay_rank(
    load_dir: str, tp: int, ep: int, batch: Batch, loss: PPOLossSettings, moe: dict, packed: bool, shift: int = 0
) -> dict:
    """Routing replay (R2) at TP x EP: the old-logprob pass records the routers' choices (micro-batches of 2 rows,
    packed or padded), then one actor update (micro-batches of 1 row, no optimizer step) replays them, each expert
    index moved by `shift` (0: the recorded choices). Returns this rank's rows, their recorded choices, the
    update's metrics, and on TP rank 0 the HF-named gradients."""
    from megatron.core import parallel_state as ps

    from mindrl.workers.rl_model import ROUTED_EXPERTS, response_logprobs
    from mindrl.workers.settings import MicroBatching

    spec, ddp, optimizer, scheduler = build_model_and_optimizer(
        load_dir, tp, 1, OptimSettings(lr=1e-3, clip_grad=1e9), total_steps=1, dtype="float32", ep=ep, moe=moe,
        sequence_parallel=tp > 1,
    )  # fmt: skip
    optimizer.step = lambda: (True, 0.0, None)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = shard_rows(len(batch), dp, 1)[dp_rank]
    shard = batch.index(rows)
    _, routed = response_logprobs(ddp, shard, MicroBatching(rows=2, packed=packed), 1.0, record_routing=True)
    shard[ROUTED_EXPERTS] = ((routed.long() + shift) % spec.num_experts).to(routed.dtype)
    metrics = flat(ppo_update(ddp, optimizer, scheduler, shard, "actor", loss, 1, 1, 1))
    grads = full_hf_tensors(ddp, spec, grads=True)
    return {"rows": rows, "routed": routed, "metrics": metrics,
            "grads": grads if ps.get_tensor_model_parallel_rank() == 0 else None}  # fmt: skip
