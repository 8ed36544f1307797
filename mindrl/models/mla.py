"""Multi-latent attention (DeepSeek-V3) on megatron-core's `MLASelfAttention`, with the shared rope key's gradient
summed over the tensor-parallel ranks.

megatron's local layer spec computes the key/value down projection column-parallel and all-gathers its output; the
rope key split from it is used by every rank's own heads, so each rank's gradient of it is a partial sum, and the
gather's backward (a split) keeps one rank's partial sum of each column: at TP2 the down projection's gradient was
6.7e-3 off the TP1 one (fp32 gap 1.1e-7). `MLASelfAttentionTP` gathers that output with a backward that all-reduces
the rope columns' gradient first (the latent's columns are complete on every rank already: its up projection reduces
them)."""

from __future__ import annotations

import sys

import torch
from megatron.core.tensor_parallel.mappings import (
    _gather_along_last_dim,
    _split_along_last_dim,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class _GatherLatentAndRopeKey(torch.autograd.Function):
    """Forward: megatron's all-gather along the last dim. Backward: the last `rope` columns' gradient summed over the
    group, then this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rope: int, group) -> torch.Tensor:
        ctx.rope, ctx.group = rope, group
        return _gather_along_last_dim(x, group=group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        rope_part = grad[..., -ctx.rope :].contiguous()
        torch.distributed.all_reduce(rope_part, group=ctx.group)
        grad[..., -ctx.rope :] = rope_part
        return _split_along_last_dim(grad, group=ctx.group), None, None


class MLASelfAttentionTP(MLASelfAttention):
    """megatron's MLASelfAttention whose key/value down projection's gather sums the rope key's gradient over TP."""

    def get_query_key_value_tensors(self, *args, **kwargs):
        tp = self.tp_group.size() if self.tp_group is not None else 1
        if tp == 1:
            return super().get_query_key_value_tensors(*args, **kwargs)
        module = sys.modules[MLASelfAttention.__module__]
        kv_width = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        calls = []

        def gather(t, *a, **k):
            # the query latent's gather comes first (with q_lora_rank), then the key/value latent's
            calls.append(t)
            is_kv = len(calls) == (2 if self.config.q_lora_rank else 1)
            if is_kv and t.size(-1) * tp == kv_width:
                return _GatherLatentAndRopeKey.apply(t, self.config.qk_pos_emb_head_dim, self.tp_group)
            return gather_from_tensor_model_parallel_region(t, *a, **k)

        module.gather_from_tensor_model_parallel_region = gather
        try:
            return super().get_query_key_value_tensors(*args, **kwargs)
        finally:
            module.gather_from_tensor_model_parallel_region = gather_from_tensor_model_parallel_region
