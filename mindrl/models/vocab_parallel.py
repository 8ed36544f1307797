"""Log-probabilities and entropy from vocabulary-parallel logits, without gathering the vocabulary. A differentiable
entropy (an entropy bonus) takes autograd's composite form; the rest runs blocked (`_BlockedLogprobs`)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from mindrl.models.fused import kernels_for
from mindrl.platform.detect import current_platform

BLOCK_ELEMENTS = 1 << 17
"""Elements (fp32) of one row block per compute thread: 512 KiB, within a core's L2 cache on current x86 and ARM
server parts."""
DEVICE_BLOCK_ELEMENTS = 1 << 26
"""On an accelerator, elements (fp32) of one row block: 256 MiB of scratch. Cache-sized blocks are for a CPU; a
device wants few large kernels (a micro-batch's logits in one block up to this size), and the cap bounds the scratch
for large vocabularies."""


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(labels), entropy or None) under softmax(logits / temperature) over the full vocabulary.

    logits: (..., vocab / TP) this rank's vocabulary slice (any float dtype; computed in fp32);
    labels: (...) int64 full-vocabulary ids. Differentiable w.r.t. logits; the entropy only with entropy_grad
    (without it, a metric: computed without building its graph over the vocabulary). Both outputs are fp32."""
    if with_entropy and entropy_grad and torch.is_grad_enabled() and logits.requires_grad:
        return _composite(logits, labels, temperature)
    logprobs, entropy = _BlockedLogprobs.apply(logits, labels, float(temperature), with_entropy)
    return logprobs, entropy if with_entropy else None


class _BlockedLogprobs(torch.autograd.Function):
    """log p(labels) (differentiable) and the entropy (not), computed block by block over the rows.

    Each TP rank holds logits for its slice of the vocabulary; the softmax statistics are summed over TP (one
    all-reduce), which gives the exact gradient: every TP rank computes the same loss from the reduced sums, and its
    own slice's gradient is (onehot - softmax) * grad / temperature. Row blocks stay in cache and nothing of
    vocabulary size is kept for backward beyond the logits themselves; where the platform has fused kernels for fp32
    or bf16 rows (`KernelSet.elementwise_kernels`) each row's statistics are one read of its logits and its gradient one read
    and one write."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab)
        flat_labels = labels.reshape(-1)
        tp = ps.get_tensor_model_parallel_world_size()
        in_slice, local_idx = _labels_in_slice(flat_labels, vocab)
        shift = _tp_max(x.amax(dim=-1).float().div_(temperature))  # max(logits) / T (T > 0)
        # stats rows: sum exp(z), z[label] on the rank that holds it (0 elsewhere), sum exp(z) * z
        stats = torch.zeros(3, x.shape[0], dtype=torch.float32, device=x.device)
        picked = x.gather(1, local_idx.unsqueeze(1)).squeeze(1).float().div_(temperature).sub_(shift)
        stats[1] = picked * in_slice
        kernels = _row_kernels(x)
        if kernels is not None:  # one read of the logits, no scratch
            sum_exp, weighted = kernels.softmax_stats(x, shift, temperature, with_entropy)
            stats[0] = sum_exp
            if with_entropy:
                stats[2] = weighted
        else:
            _blocked_stats(x, temperature, shift, with_entropy, stats)
        if tp > 1:
            torch.distributed.all_reduce(stats, group=ps.get_tensor_model_parallel_group())
        log_z = stats[0].log()
        logprobs = stats[1] - log_z
        entropy = log_z - stats[2] / stats[0] if with_entropy else logprobs.new_zeros(())
        ctx.mark_non_differentiable(entropy)
        # log of the full softmax's denominator in logit units: softmax = exp(x / T - lse)
        ctx.save_for_backward(logits, local_idx, in_slice, shift.add_(log_z))
        ctx.temperature = temperature
        shape = labels.shape
        return logprobs.view(shape), entropy.view(shape) if with_entropy else entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, _grad_entropy):
        logits, local_idx, in_slice, lse = ctx.saved_tensors
        t = ctx.temperature
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab)
        g = grad_logprobs.reshape(-1).float() / t
        # d log p(label) / d x = (onehot(label) - softmax) / T: the softmax term here, the label's below
        kernels = _row_kernels(x)
        grad = kernels.softmax_grad(x, lse, g.neg(), t) if kernels is not None else _blocked_grad(x, t, lse, g)
        grad.scatter_add_(1, local_idx.unsqueeze(1), (g * in_slice).to(grad.dtype).unsqueeze(1))
        return grad.view(logits.shape), None, None, None


def _blocked_stats(x: torch.Tensor, temperature: float, shift: torch.Tensor, with_entropy: bool, stats: torch.Tensor):
    """stats[0] = sum exp(z) (and stats[2] = sum exp(z) z) per row, z = x / T - shift, block by block in a scratch."""
    for rows, scratch in _blocks(x):
        z = _shifted(x[rows], temperature, shift[rows], scratch)
        if with_entropy:
            e = z.exp()
            stats[0, rows] = e.sum(dim=-1)
            stats[2, rows] = e.mul_(z).sum(dim=-1)
        else:
            stats[0, rows] = z.exp_().sum(dim=-1)


def _blocked_grad(x: torch.Tensor, temperature: float, lse: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """-softmax(x / T) * g per row (g: the log-probs' gradient / T), block by block: written straight into the
    gradient for fp32 logits, through a scratch for 16-bit ones."""
    grad = torch.empty_like(x)
    fp32 = grad.dtype == torch.float32
    for rows, scratch in _blocks(x):
        p = _shifted(x[rows], temperature, lse[rows], grad[rows] if fp32 else scratch)
        p.exp_().mul_(g[rows].neg().unsqueeze(1))
        if not fp32:
            grad[rows].copy_(p)
    return grad


def _row_kernels(x: torch.Tensor):
    """The platform's fused kernels where they take these logit rows (fp32 or bf16, each row contiguous), else None:
    then the softmax's statistics are one pass over each row, and its gradient one pass writing it (in x's dtype)."""
    kernels = kernels_for(x, bf16=True)
    return kernels if kernels is not None and x.dim() == 2 and x.stride(1) == 1 else None


def _blocks(x: torch.Tensor):
    """(row slice, fp32 scratch for one block) over x's rows, in blocks of about BLOCK_ELEMENTS elements per thread
    (DEVICE_BLOCK_ELEMENTS on an accelerator: `Platform.cache_blocked_logprobs`)."""
    cpu_sized = current_platform().cache_blocked_logprobs
    per_block = BLOCK_ELEMENTS * torch.get_num_threads() if cpu_sized else DEVICE_BLOCK_ELEMENTS
    step = max(1, per_block // max(1, x.shape[1]))
    scratch = torch.empty(min(step, x.shape[0]), x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[0], step):
        rows = slice(i, min(i + step, x.shape[0]))
        yield rows, scratch[: rows.stop - rows.start]


def _shifted(block: torch.Tensor, temperature: float, shift: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """block / temperature - shift (one value per row) in fp32, written into out. At temperature 1 one pass (the
    subtraction widens a 16-bit block exactly), else the division first, as `_scaled`."""
    if temperature == 1.0:
        return torch.sub(block, shift.unsqueeze(1), out=out)
    return _scaled(block, temperature, out).sub_(shift.unsqueeze(1))


def _scaled(block: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """block / temperature in fp32, written into out (a 16-bit block is widened before the division)."""
    if temperature != 1.0 and block.dtype == torch.float32:
        return torch.div(block, temperature, out=out)
    out.copy_(block)
    return out.div_(temperature) if temperature != 1.0 else out


def _labels_in_slice(labels: torch.Tensor, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each label falls in this TP rank's vocabulary slice, its index there, clamped into the slice)."""
    start = ps.get_tensor_model_parallel_rank() * local_vocab
    return (labels >= start) & (labels < start + local_vocab), (labels - start).clamp(0, local_vocab - 1)


def _tp_max(t: torch.Tensor) -> torch.Tensor:
    """t's elementwise maximum over the tensor-parallel ranks, in place (no graph)."""
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    return t


def _composite(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """(log-probs, entropy) through autograd's composite ops: the entropy's graph for an entropy bonus."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    with torch.no_grad():
        shift = _tp_max(x.max(dim=-1).values)
    z = x - shift.unsqueeze(-1)
    exp = z.exp()
    in_slice, local_idx = _labels_in_slice(labels, x.shape[-1])
    picked = z.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * in_slice
    sum_exp, weighted = exp.sum(dim=-1), (exp * z).sum(dim=-1)
    if ps.get_tensor_model_parallel_world_size() > 1:
        sum_exp, picked, weighted = map(reduce_from_tensor_model_parallel_region, (sum_exp, picked, weighted))
    log_z = sum_exp.log()
    return picked - log_z, log_z - weighted / sum_exp
