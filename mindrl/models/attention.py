"""Core attention through torch's scaled_dot_product_attention (`SDPAttention`, a drop-in for megatron's
DotProductAttention), batched-GEMM attention for short sequences, and packed prompt groups (`PrefixGroups`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention

from mindrl.models.context_parallel import cp_size, gather_along
from mindrl.models.fused import kernels_for
from mindrl.models.packing import RowAttention, packed_rows_of
from mindrl.platform.detect import current_platform

SCORE_CHUNK_BYTES = 4 << 20
"""GemmAttention works through the batch in chunks of rows whose fp32 scores take at most this many bytes, so that
each chunk's scores, softmax and their backward stay in a CPU's cache (one row at a time when one row is larger)."""


@dataclass(frozen=True)
class PrefixGroups:
    """The packed layout of `samples` rows that share one prompt: the prompt's `prompt` columns once, then each
    sample's `response` columns in turn (s = prompt + samples * response). A response column takes the position it
    has in its own row (prompt + t), so RoPE sees every row as it is unpacked; the prompt's last column predicts
    every sample's first response token."""

    prompt: int
    samples: int
    response: int

    @property
    def width(self) -> int:
        return self.prompt + self.samples * self.response

    def positions(self, device=None) -> torch.Tensor:
        """[s] each packed column's position in its own row."""
        p, r = self.prompt, self.response
        return torch.cat([torch.arange(p), torch.arange(p, p + r).repeat(self.samples)]).to(device)

    def segments(self, device=None) -> torch.Tensor:
        """[s] -1 on the prompt's columns, j on sample j's."""
        return torch.cat(
            [torch.full((self.prompt,), -1), torch.arange(self.samples).repeat_interleave(self.response)]
        ).to(device)

    def response_sources(self, device=None) -> torch.Tensor:
        """[samples * response] the packed columns whose outputs predict each sample's response tokens in turn:
        the prompt's last column, then the sample's own columns but its last."""
        p, r = self.prompt, self.response
        own = p + torch.arange(self.samples).view(-1, 1) * r + torch.arange(r - 1).view(1, -1)
        return torch.cat([torch.full((self.samples, 1), p - 1), own], 1).flatten().to(device)


_GROUPS_ATTR = "_mindrl_prefix_groups"


def mark_prefix_groups(mask: torch.Tensor, layout: PrefixGroups) -> torch.Tensor:
    """Mark the full mask [b, 1, s, s] of packed prefix groups with their layout (and the two masks `SDPAttention`
    attends with, cut once per micro-batch): the prompt's own [b, 1, P, P] and the responses' [b * samples, 1, R,
    P + R], rows in (prompt, sample) order. Returns the mask."""
    b, p, g, r = mask.shape[0], layout.prompt, layout.samples, layout.response
    if tuple(mask.shape) != (b, 1, layout.width, layout.width):
        raise ValueError(f"a mask of shape {tuple(mask.shape)} for prefix groups of width {layout.width}")
    rows = mask[:, :, p:].reshape(b, 1, g, r, layout.width)
    own = torch.diagonal(rows[..., p:].reshape(b, 1, g, r, g, r), dim1=2, dim2=4).permute(0, 1, 4, 2, 3)
    response = torch.cat([rows[..., :p], own], -1).transpose(1, 2).reshape(b * g, 1, r, p + r)
    marked = (layout, mask[:, :, :p, :p].contiguous(), response)
    setattr(mask, _GROUPS_ATTR, marked)
    # Activation recomputation (megatron's checkpoint) runs core attention again on `mask.detach()`: a new tensor
    # without the attribute, on the same storage, whose Python object torch keeps alive with it.
    setattr(mask.untyped_storage(), _GROUPS_ATTR, (_view(mask), marked))
    return mask


def _view(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset()


def prefix_groups_of(mask: torch.Tensor | None):
    """(layout, prompt mask, response mask) marked on `mask` (or on the mask it is a detached copy of) by
    `mark_prefix_groups`, else None."""
    if mask is None:
        return None
    marked = getattr(mask, _GROUPS_ATTR, None)
    if marked is None:
        view, marked = getattr(mask.untyped_storage(), _GROUPS_ATTR, (None, None))
        return marked if view == _view(mask) else None
    return marked


class GemmAttention(torch.autograd.Function):
    """softmax(scale * q k^T, masked) v as batched GEMMs, with grouped-query heads read in place (no repeated K/V).

    q: [b, kv, g * sq, d] (the g query heads of KV head j, one after another), k, v: [b, kv, s, d]; mask: bool
    [b, 1, sq, s], True = masked, every row keeping at least one key. The probabilities of each chunk of rows are
    kept for backward (b kv g s^2 values), which then needs no second pass over the scores. With the platform's fused
    kernels (`KernelSet.elementwise_kernels`, fp32) the scale, mask and softmax are one pass over each row, as is the
    softmax's backward with the scale."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float):
        b, kv, gs, d = q.shape
        sq, s = mask.shape[2], k.shape[2]
        g = gs // sq
        dv = v.shape[-1]  # MLA: values narrower than queries / keys
        chunk = max(1, SCORE_CHUNK_BYTES // (kv * gs * s * q.element_size()))
        out = q.new_empty(b, kv, gs, dv)
        probs = []
        for i in range(0, b, chunk):
            j = min(b, i + chunk)
            n = j - i
            scores = torch.bmm(q[i:j].reshape(n * kv, gs, d), k[i:j].reshape(n * kv, s, d).transpose(1, 2))
            kernels = kernels_for(scores)
            if (
                kernels is not None
                and kernels.masked_softmax_(scores.view(n, kv * g, sq, s), mask[i:j], scale) is not None
            ):
                p = scores  # scaled, masked and normalised in place, one pass per row
            else:
                scores.mul_(scale).view(n, kv, g, sq, s).masked_fill_(mask[i:j].unsqueeze(2), float("-inf"))
                p = torch.softmax(scores, dim=-1)
            torch.bmm(p, v[i:j].reshape(n * kv, s, dv), out=out[i:j].view(n * kv, gs, dv))
            probs.append(p)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *probs = ctx.saved_tensors
        b, kv, gs, d = q.shape
        s, d_v = k.shape[2], v.shape[-1]
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for c, p in enumerate(probs):
            i = c * ctx.chunk
            n = p.shape[0] // kv
            j = i + n
            do = grad_out[i:j].view(n * kv, gs, d_v)
            torch.bmm(p.transpose(1, 2), do, out=dv[i:j].view(n * kv, s, d_v))
            dp = torch.bmm(do, v[i:j].reshape(n * kv, s, d_v).transpose(1, 2))
            kernels = kernels_for(dp, p)
            if kernels is not None:
                ds = kernels.softmax_backward_(p, dp, ctx.scale)
            else:
                ds = torch._softmax_backward_data(dp, p, -1, p.dtype).mul_(ctx.scale)
            torch.bmm(ds, k[i:j].reshape(n * kv, s, d), out=dq[i:j].view(n * kv, gs, d))
            torch.bmm(ds.transpose(1, 2), q[i:j].reshape(n * kv, gs, d), out=dk[i:j].view(n * kv, s, d))
        return dq, dk, dv, None, None


def gemm_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Megatron-layout attention through `GemmAttention`: q [sq, b, heads, d], k/v [s, b, kv heads, d], mask bool
    [b, 1, sq, s] (True = masked; None: causal, the queries being the last sq positions). Returns the context [b,
    heads, sq, d]."""
    sq, b, heads, d = query.shape
    s, kv = key.shape[0], key.shape[2]
    if mask is None:
        mask = torch.ones(sq, s, dtype=torch.bool, device=query.device).triu_(s - sq + 1).expand(b, 1, sq, s)
    q = query.permute(1, 2, 0, 3).reshape(b, kv, heads // kv * sq, d)
    k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (key, value))
    return GemmAttention.apply(q, k, v, mask, scale).view(b, heads, sq, value.shape[-1])


class _PackedContext(torch.autograd.Function):
    """The prompt's context [b, heads, p, d] and the samples' [b * g, kv, hg * r, d] (GemmAttention's layouts) written
    into one packed context [p + g * r, b, heads, d]; backward lays each part's gradient out of it in one copy (no
    zero-filled full-size gradients, as slicing and copying into slices would make)."""

    @staticmethod
    def forward(ctx, prompt, samples, g: int, kv: int):
        b, heads, p, d = prompt.shape
        hg = heads // kv
        r = samples.shape[2] // hg
        out = prompt.new_empty(p + g * r, b, heads, d)
        out[:p].copy_(prompt.permute(2, 0, 1, 3))
        out[p:].view(g, r, b, kv, hg, d).copy_(samples.view(b, g, kv, hg, r, d).permute(1, 4, 0, 2, 3, 5))
        ctx.dims = (b, p, d, g, kv, hg, r)
        return out

    @staticmethod
    def backward(ctx, grad):
        b, p, d, g, kv, hg, r = ctx.dims
        prompt = grad[:p].permute(1, 2, 0, 3).contiguous()
        samples = grad[p:].reshape(g, r, b, kv, hg, d).permute(2, 0, 3, 4, 1, 5).reshape(b * g, kv, hg * r, d)
        return prompt, samples, None, None


def prefix_gemm_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: PrefixGroups,
    prompt_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Packed prefix groups through `GemmAttention`, each operand laid out in one copy: q [s, b, heads, d], k/v [s,
    b, kv heads, d] in the packed layout, the masks of `mark_prefix_groups`. The prompt attends to itself; each
    sample's queries to [the prompt's keys, its own], the prompt's keys and values broadcast to the samples by the
    one copy that lays them out (their gradients sum there). Returns the context [s, b, heads, d]."""
    s, b, heads, d = query.shape
    kv = key.shape[2]
    hg, p, g, r = heads // kv, layout.prompt, layout.samples, layout.response
    # split, not slices: its backward joins the parts' gradients in one copy
    (qp, qr), (kp, kr), (vp, vr) = (t.split([p, s - p]) for t in (query, key, value))
    prompt = gemm_attention(qp, kp, vp, prompt_mask, scale)  # [b, heads, p, d]
    # [g * r, b, kv * hg, d] -> [b * g, kv, hg * r, d]
    q = qr.reshape(g, r, b, kv, hg, d).permute(2, 0, 3, 4, 1, 5).reshape(b * g, kv, hg * r, d)

    def keys(shared, own):  # -> [b * g, kv, p + r, width]: the prompt's rows, then the sample's own
        w = shared.shape[-1]  # MLA: values narrower than keys
        shared = shared.permute(1, 2, 0, 3).unsqueeze(1).expand(b, g, kv, p, w)
        own = own.reshape(g, r, b, kv, w).permute(2, 0, 3, 1, 4)
        return torch.cat([shared, own], 3).view(b * g, kv, p + r, w)

    samples = GemmAttention.apply(q, keys(kp, kr), keys(vp, vr), sample_mask, scale)
    return _PackedContext.apply(prompt, samples, g, kv)


class SDPAttention(DotProductAttention):
    """DotProductAttention whose scores, masked softmax and context run as one SDPA call (forward and backward),
    instead of baddbmm + a separate masked softmax over a materialised [b, heads, s, s] tensor.

    Same inputs ([s, b, heads, dim] q/k/v of this TP rank, megatron's boolean mask with True = masked). Short
    sequences on platforms that ask for it (`Platform.gemm_attention_max_len`) run `GemmAttention` instead. Packed
    prefix groups (`PrefixGroups`) carry the full [b, 1, s, s] mask, so any core attention is right on them; this
    one reads the layout marked on it (`mark_prefix_groups`) and attends the prompt once and each response over
    [prompt, itself], computing no score a mask would hide. Rows packed into one (`PackedRows`) likewise: it reads
    their `RowAttention` and attends row by row."""

    def __init__(self, config, *args, **kwargs):
        # DotProductAttention refuses context parallelism (megatron leaves it to Transformer Engine); this one
        # attends this rank's query chunks over the K/V all-gathered from the CP group (`forward`).
        cp = config.context_parallel_size
        config.context_parallel_size = 1
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp
        self.config = config

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
        dropout = self.attention_dropout.p if self.training else 0.0
        # attention_softmax_in_fp32 (mindrl always sets it, as megatron's default): a 16-bit model's scores and
        # softmax in fp32, as DotProductAttention does; fused 16-bit SDPA drifted bf16 grad norms 4% from fp32's
        # on CPU. A device kernel that keeps its softmax in fp32 inside takes the 16-bit operands as they are.
        dtype = query.dtype
        upcast = current_platform().attention_operands == "fp32"
        if self.config.attention_softmax_in_fp32 and dtype.itemsize < 4 and upcast:  # 16-bit only, fp64 stays
            query, key, value = query.float(), key.float(), value.float()
        if getattr(self.config, "context_parallel_size", 1) > 1 and cp_size() > 1:
            # Context parallelism: this rank's queries (its two chunks) over every rank's keys and values, gathered
            # (backward: their gradients reduce-scattered back); the mask is [b, 1, s / CP, s] with the keys in the
            # gather's order (`CPSplit.local_mask`). Exact causal attention over the whole row.
            if attention_mask is None:
                raise ValueError("context-parallel attention needs the explicit mask of the rank's queries")
            key, value = gather_along(key, 0), gather_along(value, 0)
            return self._context(self._attend(query, key, value, attention_mask, dropout).to(dtype))
        groups = prefix_groups_of(attention_mask)
        if groups is not None:
            return self._prefix_groups(query, key, value, *groups, dropout).to(dtype)
        rows = packed_rows_of(attention_mask)
        if rows is not None:
            return self._packed_rows(query, key, value, rows, dropout).to(dtype)
        return self._context(self._attend(query, key, value, attention_mask, dropout).to(dtype))

    def _attend(self, query, key, value, attention_mask: torch.Tensor | None, dropout: float) -> torch.Tensor:
        """q [sq, b, heads, d], k/v [s, b, kv heads, d] -> the context [b, heads, sq, d]."""
        if self._gemm(query.shape[0], key.shape[0], query.dtype, dropout):
            return gemm_attention(query, key, value, attention_mask, self.softmax_scale)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # As DotProductAttention: the dropout mask comes from the TP rank's own RNG stream (its heads differ from the
        # other ranks'), not from the default generator that megatron seeds alike on every TP rank.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout and not self.config.sequence_parallel else None
        with rng or contextlib.nullcontext():
            return current_platform().core_attention(q, k, v, attention_mask, self.softmax_scale, dropout)

    def _prefix_groups(self, query, key, value, layout: PrefixGroups, prompt_mask, sample_mask, dropout: float):
        """Packed prefix groups (see `PrefixGroups`): the prompt attends to itself once; each sample's response
        attends to [prompt, itself], the prompt's keys and values shared by the samples (their gradients sum
        there). Returns the context [s, b, heads * d] in the packed layout."""
        p, g, r = layout.prompt, layout.samples, layout.response
        b = query.shape[1]
        if self._gemm(r, p + r, query.dtype, dropout):  # the largest of its attentions: a response over p + r keys
            return prefix_gemm_attention(query, key, value, layout, prompt_mask, sample_mask, self.softmax_scale).view(
                -1, b, self.hidden_size_per_partition
            )

        def samples(t):  # the responses' columns [g * r, b, n, d] -> [r, b * g, n, d], rows in (prompt, sample) order
            return t[p:].reshape(g, r, b, *t.shape[2:]).permute(1, 2, 0, 3, 4).reshape(r, b * g, *t.shape[2:])

        def shared(t):  # the prompt's columns [p, b, n, d], once per sample: [p, b * g, n, d]
            return t[:p].unsqueeze(2).expand(p, b, g, *t.shape[2:]).reshape(p, b * g, *t.shape[2:])

        prompt = self._context(self._attend(query[:p], key[:p], value[:p], prompt_mask, dropout))
        k, v = (torch.cat([shared(t), samples(t)]) for t in (key, value))
        out = self._attend(samples(query), k, v, sample_mask, dropout)  # [b * g, n, r, d]
        n, d = out.shape[1], out.shape[3]
        responses = out.reshape(b, g, n, r, d).permute(1, 3, 0, 2, 4).reshape(g * r, b, n * d)
        return torch.cat([prompt, responses])

    def _packed_rows(self, query, key, value, rows: RowAttention, dropout: float) -> torch.Tensor:
        """Rows packed into one row (q/k/v [s, 1, n, d]), each attending to itself only: each group of rows of similar
        length (`RowAttention`) laid out as padded rows [length, rows, n, d] by one gather per operand and attended,
        and the context gathered back to the packed columns. Returns the context [s, 1, heads * d]."""
        parts = []
        for group in rows.groups:

            def unpack(t, group=group):
                return t[:, 0].index_select(0, group.gather).view(group.length, group.rows, *t.shape[2:])

            out = self._attend(unpack(query), unpack(key), unpack(value), group.mask, dropout)  # [rows, n, length, d]
            parts.append(out.permute(2, 0, 1, 3).reshape(group.length * group.rows, self.hidden_size_per_partition))
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat.index_select(0, rows.scatter).unsqueeze(1)

    @staticmethod
    def _gemm(queries: int, keys: int, dtype: torch.dtype, dropout: float) -> bool:
        """Whether attention of this size runs as `GemmAttention` (see `Platform.gemm_attention_max_len`)."""
        short = max(queries, keys) <= current_platform().gemm_attention_max_len(torch.is_grad_enabled())
        return short and not dropout and dtype == torch.float32

    def _context(self, out: torch.Tensor) -> torch.Tensor:
        """[b, n, s, d] -> [s, b, n*d]."""
        s, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


class MLASDPAttention(SDPAttention):
    """SDPAttention as megatron's multi-latent attention builds its core attention: query / key heads of k_channels
    (nope + rope parts), values of v_channels (the config's kv_channels, which sizes the output), the YaRN softmax scale
    given by the caller."""

    def __init__(self, config, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(
                f"MLA core attention: v_channels={v_channels} but the config's kv_channels={config.kv_channels}"
            )
        super().__init__(config, *args, **kwargs)
