"""Log-probabilities and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary, (..., vocab / TP). The softmax
statistics are summed over TP with megatron's reduce (all-reduce forward, identity backward), which is the
exact gradient: every TP rank computes the same loss from the reduced sums.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


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
    (without it, a metric: computed without building its graph over the vocabulary)."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    tp = ps.get_tensor_model_parallel_world_size()
    local_vocab = x.shape[-1]
    with torch.no_grad():
        shift = x.max(dim=-1).values
        if tp > 1:
            torch.distributed.all_reduce(
                shift, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group()
            )
    z = x - shift.unsqueeze(-1)
    exp = z.exp()
    start = ps.get_tensor_model_parallel_rank() * local_vocab
    in_slice = (labels >= start) & (labels < start + local_vocab)
    local_idx = (labels - start).clamp(0, local_vocab - 1)
    picked = z.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * in_slice
    sum_exp = exp.sum(dim=-1)
    weighted = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            weighted = (exp * z).sum(dim=-1)
    if tp > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        picked = reduce_from_tensor_model_parallel_region(picked)
        if with_entropy:
            weighted = reduce_from_tensor_model_parallel_region(weighted)
    log_z = sum_exp.log()
    logprobs = picked - log_z
    entropy = None
    if with_entropy:
        entropy = log_z - weighted / sum_exp if entropy_grad else log_z.detach() - weighted / sum_exp.detach()
    return logprobs, entropy
