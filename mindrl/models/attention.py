"""Core attention through torch's scaled_dot_product_attention, a drop-in for megatron's DotProductAttention.

Same inputs ([s, b, heads, dim] q/k/v of this TP rank, megatron's boolean mask with True = masked), one fused op.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SDPAttention(DotProductAttention):
    """DotProductAttention whose scores, masked softmax and context run as one SDPA call (forward and backward),
    instead of baddbmm + a separate masked softmax over a materialised [b, heads, s, s] tensor."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes neither packed sequences nor an attention bias")
        if self.softmax_offset is not None or self.config.window_size is not None:
            raise ValueError("SDPAttention supports only vanilla full-window softmax")
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        dropout = self.attention_dropout.p if self.training else 0.0
        # As DotProductAttention: the dropout mask comes from the TP rank's own RNG stream (its heads differ from the
        # other ranks'), not from the default generator that megatron seeds alike on every TP rank.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout and not self.config.sequence_parallel else None
        # attention_softmax_in_fp32 (mindrl always sets it, as megatron's default): a 16-bit model's scores and
        # softmax in fp32, as DotProductAttention does; fused 16-bit SDPA drifted bf16 grad norms 4% from fp32's.
        dtype = q.dtype
        if self.config.attention_softmax_in_fp32 and dtype != torch.float32:
            q, k, v = q.float(), k.float(), v.float()
        with rng or contextlib.nullcontext():
            out = self._sdpa(q, k, v, attention_mask, dropout).to(dtype)
        # [b, n, s, d] -> [s, b, n*d]
        s, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _sdpa(self, q, k, v, attention_mask: torch.Tensor | None, dropout: float) -> torch.Tensor:
        if attention_mask is None:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale
            )
        # megatron's mask marks what is hidden; SDPA's boolean mask marks what is seen.
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask, dropout_p=dropout, scale=self.softmax_scale
        )
