"""Module-level functions the context-parallel tests run on pool ranks: one forward and one `ppo_update` at a given
TP x CP x PP layout, with the full HF-named gradients and weights."""

from __future__ import annotations

import torch

from mindrl.batch import Batch, shard_rows
from mindrl.workers.rl_model import PPOLossSettings, ppo_update, response_logprobs, response_values
from mindrl.workers.settings import MicroBatching
from mindrl.workers.train_setup import OptimSettings, build_model_and_optimizer
from tests.workers.ppo_rank_fns import flat, full_hf_tensors


def layout_rank(
    load_dir: str,
    tp: int,
    pp: int,
    cp: int,
    batch: Batch,
    role: str,
    loss: PPOLossSettings,
    micro: MicroBatching,
    sequence_parallel: bool = False,
) -> dict:
    """This DP rank's forward (logprobs or values), one update's metrics, and the gradients and weights after it,
    kept on the DP-0, TP-0, CP-0 rank of each pipeline stage (None elsewhere)."""
    from megatron.core import parallel_state as ps

    optim = OptimSettings(lr=1e-3, clip_grad=1e9, adam_eps=1e-6)
    spec, ddp, optimizer, scheduler = build_model_and_optimizer(
        load_dir, tp, pp, optim, total_steps=1, sequence_parallel=sequence_parallel, cp=cp
    )
    assert ps.get_context_parallel_world_size() == cp
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    shard = batch.index(shard_rows(len(batch), dp, 1)[dp_rank])
    if role == "actor":
        fwd = response_logprobs(ddp, shard, micro, loss.temperature)
    else:
        fwd = response_values(ddp, shard, micro)
    metrics = flat(ppo_update(ddp, optimizer, scheduler, shard, role, loss, micro, 1, 1))
    grads = full_hf_tensors(ddp, spec, grads=True)
    weights = full_hf_tensors(ddp, spec, grads=False)
    keep = dp_rank == 0 and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    rows = shard_rows(len(batch), dp, 1)[dp_rank]
    return {
        "forward": (rows, fwd) if fwd is not None and ps.get_tensor_model_parallel_rank() == 0 else None,
        "metrics": metrics,
        "grads": grads if keep else None,
        "weights": weights if keep else None,
    }


def attention_rank(cp: int, seed: int) -> dict:
    """`SDPAttention`-level check without a model: CP ranks' K/V gather and local masks give this rank's rows of
    full causal attention, forward and input gradients, for a padded batch (fp64)."""
    from megatron.core import parallel_state as ps

    from mindrl.launch import init_model_parallel
    from mindrl.models.context_parallel import CPSplit, gather_along

    init_model_parallel(1, 1, cp=cp)
    g = torch.Generator().manual_seed(seed)
    s, b, h, d = 16, 2, 4, 8
    q, k, v = (torch.randn(s, b, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s).clone()
    mask[0, :, :, :3] = True  # left padding on row 0
    mask[0] &= ~torch.eye(s, dtype=torch.bool)
    split = CPSplit(s, cp, ps.get_context_parallel_rank())
    lq, lk, lv = (split.local(t, 0).requires_grad_() for t in (q, k, v))
    kk, vv = gather_along(lk, 0), gather_along(lv, 0)
    scores = torch.einsum("qbhd,kbhd->bhqk", lq, kk).masked_fill(split.local_mask(mask), float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), vv)
    full = split.full(out, 0)
    full.pow(2).sum().backward()
    return {"out": full.detach(), "dq": lq.grad, "dk": lk.grad, "dv": lv.grad, "cols": split.columns()}
