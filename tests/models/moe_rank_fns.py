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
