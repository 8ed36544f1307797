"""Module-level functions the PPO-update tests run on pool ranks: one `ppo_update` on this rank's DP shard of a
global batch, then the model's gradients (megatron DDP's main_grad) and weights as full HF-named tensors."""

from __future__ import annotations

from dataclasses import astuple

import torch

from mindrl.batch import Batch, shard_rows
from mindrl.workers.results import UpdateResult
from mindrl.workers.rl_model import PPOLossSettings, ppo_update
from mindrl.workers.train_setup import OptimSettings, build_model_and_optimizer


def flat(result: UpdateResult) -> dict:
    """An update's result as one dict for the tests' comparisons: its metrics, "_tokens" (computed, real,
    untrimmed, shared) and "_logprob_diff" (sum, count, max; actor only)."""
    out = dict(result.metrics)
    out["_tokens"] = astuple(result.tokens)
    if result.logprob_diff is not None:
        out["_logprob_diff"] = astuple(result.logprob_diff)
    return out


def full_hf_tensors(model, spec, grads: bool, local_of=None) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters (or their main_grad, or `local_of(param)`: any tensor of the param's
    TP-local shape, e.g. an Adam moment) as full TP=1 tensors under their HF names; buffers (the router's expert bias)
    with the parameters only.

    Gathers over TP with the weight map's own layout rules; works for the critic too (which the rollout
    weight streamer refuses). Collective over the tensor-parallel group."""
    from megatron.core import parallel_state as ps

    from mindrl.models.weight_map import full_to_hf, local_to_full, param_mapping
    from mindrl.resharding.stream import local_params

    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in local_params(model, spec).items():  # the same order on every TP rank
        if (grads or local_of is not None) and not isinstance(p, torch.nn.Parameter):
            continue  # a buffer the engine reads (the router's expert bias): no gradient, no optimizer state
        local = local_of(p) if local_of is not None else (p.main_grad if grads else p)
        local = local.detach().float().contiguous()
        shards = [local]
        if tp > 1:
            shards = [torch.empty_like(local) for _ in range(tp)]
            torch.distributed.all_gather(shards, local, group=ps.get_tensor_model_parallel_group())
        mapping = param_mapping(spec, name)
        for hf_name, t in full_to_hf(spec, mapping, local_to_full(mapping, shards)):
            out[hf_name] = t.clone()
    return out


def ppo_update_rank(
    load_dir: str,
    tp: int,
    pp: int,
    batch: Batch,
    role: str,
    loss: PPOLossSettings,
    optim: OptimSettings,
    micro_batch_size: int,
    num_mini_batches: int = 1,
    weights: bool = False,
) -> dict:
    """One epoch of `ppo_update` (role "actor" or "critic") on this rank's `shard_rows` shard of the global
    batch, as the driver sends it. Returns the metrics on every rank; the HF-named gradients of the last
    mini-batch (and the weights after the update when `weights`) on the DP-0, TP-0 rank of each pipeline
    stage (the test merges the stages), None elsewhere."""
    from megatron.core import parallel_state as ps

    spec, ddp, optimizer, scheduler = build_model_and_optimizer(load_dir, tp, pp, optim, total_steps=num_mini_batches)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    shard = batch.index(shard_rows(len(batch), dp, num_mini_batches)[dp_rank])
    metrics = flat(ppo_update(ddp, optimizer, scheduler, shard, role, loss, micro_batch_size, num_mini_batches, 1))
    grads = full_hf_tensors(ddp, spec, grads=True)
    after = full_hf_tensors(ddp, spec, grads=False) if weights else None
    keep = dp_rank == 0 and ps.get_tensor_model_parallel_rank() == 0
    return {
        "metrics": metrics,
        "dp": dp,
        "grads": grads if keep else None,
        "weights": after if keep else None,
    }


def savings_vs_plain_rank(
    load_dir: str,
    tp: int,
    pp: int,
    batch: Batch,
    role: str,
    loss: PPOLossSettings,
    micro_batch_size: int,
    sequence_parallel: bool = False,
) -> dict:
    """The same forward pass (logprobs or values) and one `ppo_update` from the same loaded weights, on the plain
    path (`rl_model.SAVINGS` off: micro-batches at the batch's widths, output layer on every position, entropy
    graph always) and on the saving one. Returns {"plain" | "savings": {"forward", "metrics", "grads", "weights"}}
    with full tensors on the DP-0, TP-0 rank of each pipeline stage (forward: this DP rank's rows on the last
    stage), None elsewhere."""
    from megatron.core import parallel_state as ps

    from mindrl.workers import rl_model

    # A large adam_eps: Adam's first step is ~sign(g), which rounding flips where g is near 0.
    optim = OptimSettings(lr=1e-3, clip_grad=1e9, adam_eps=1e-6)
    out = {}
    try:
        for name, savings in (("plain", False), ("savings", True)):
            rl_model.SAVINGS = savings
            spec, ddp, optimizer, scheduler = build_model_and_optimizer(
                load_dir, tp, pp, optim, total_steps=1, sequence_parallel=sequence_parallel
            )
            shard, fwd = dp_forward(ddp, batch, role, micro_batch_size, loss.temperature)
            metrics = flat(ppo_update(ddp, optimizer, scheduler, shard, role, loss, micro_batch_size, 1, 1))
            grads = full_hf_tensors(ddp, spec, grads=True)
            weights = full_hf_tensors(ddp, spec, grads=False)
            keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
            out[name] = {
                "forward": fwd if keep else None,
                "metrics": metrics,
                "grads": grads if keep else None,
                "weights": weights if keep else None,
            }
    finally:
        rl_model.SAVINGS = True
    return out


def wgrad_fusion_rank(load_dir: str, tp: int, batch: Batch, loss: PPOLossSettings, micro_batch_size: int) -> dict:
    """One actor ppo_update (lr 0: the weights stay) with the linear layers' weight grads added straight into
    main_grad (as built), then one with that off; the HF-named main_grads of both, and how many weight-grad GEMMs
    the first one added into main_grad, on the TP-0 rank (None elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers

    spec, ddp, optimizer, scheduler = build_model_and_optimizer(
        load_dir, tp, 1, OptimSettings(lr=0.0, clip_grad=1e9), total_steps=2
    )
    linear = [m for m in ddp.modules() if isinstance(m, (layers.ColumnParallelLinear, layers.RowParallelLinear))]
    assert linear and all(m.gradient_accumulation_fusion for m in linear)
    kernel = layers.fused_weight_gradient_mlp_cuda
    calls = []
    original = kernel.wgrad_gemm_accum_fp32
    kernel.wgrad_gemm_accum_fp32 = lambda *args: (calls.append(1), original(*args))[1]
    try:
        ppo_update(ddp, optimizer, scheduler, batch, "actor", loss, micro_batch_size, 1, 1)
    finally:
        kernel.wgrad_gemm_accum_fp32 = original
    fused = full_hf_tensors(ddp, spec, grads=True)
    for m in linear:
        m.gradient_accumulation_fusion = False
    ppo_update(ddp, optimizer, scheduler, batch, "actor", loss, micro_batch_size, 1, 1)
    plain = full_hf_tensors(ddp, spec, grads=True)
    if ps.get_tensor_model_parallel_rank():
        return None
    return {"fused": fused, "plain": plain, "calls": len(calls), "linear": len(linear)}


def micro_batching_rank(
    load_dir: str,
    tp: int,
    pp: int,
    batch: Batch,
    role: str,
    loss: PPOLossSettings,
    variants: dict,
    sequence_parallel: bool = False,
) -> dict:
    """The forward pass (logprobs or values) and one `ppo_update` at lr 0 (the weights stay, so one model serves
    every variant) for each named `MicroBatching` in `variants`, on this rank's DP shard. Returns {name: {"forward",
    "metrics", "grads", "row_attention"}} with the full tensors on the DP-0, TP-0 rank of each pipeline stage
    (forward: this DP rank's rows on the last stage), None elsewhere; row_attention: how many core attentions ran
    packed rows row by row (`SDPAttention._packed_rows`)."""
    from megatron.core import parallel_state as ps

    from mindrl.models.attention import SDPAttention

    spec, ddp, optimizer, scheduler = build_model_and_optimizer(
        load_dir, tp, pp, OptimSettings(lr=0.0, clip_grad=1e9), total_steps=len(variants),
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    out = {}
    calls = []
    original = SDPAttention._packed_rows
    SDPAttention._packed_rows = lambda *args: (calls.append(1), original(*args))[1]
    try:
        for name, micro in variants.items():
            calls.clear()
            shard, fwd = dp_forward(ddp, batch, role, micro, loss.temperature)
            metrics = flat(ppo_update(ddp, optimizer, scheduler, shard, role, loss, micro, 1, 1))
            grads = full_hf_tensors(ddp, spec, grads=True)
            out[name] = {"forward": fwd if keep else None, "metrics": metrics, "grads": grads if keep else None,
                         "row_attention": len(calls)}  # fmt: skip
    finally:
        SDPAttention._packed_rows = original
    return out


def dp_forward(ddp, batch: Batch, role: str, micro, temperature: float) -> tuple[Batch, object]:
    """(this DP rank's shard of `batch`, its forward: the actor's response logprobs or the critic's values) with
    `micro` (a micro-batch size or a MicroBatching)."""
    from megatron.core import parallel_state as ps

    from mindrl.workers import rl_model

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    shard = batch.index(shard_rows(len(batch), dp, 1)[dp_rank])
    if role == "actor":
        return shard, rl_model.response_logprobs(ddp, shard, micro, temperature)
    return shard, rl_model.response_values(ddp, shard, micro)
