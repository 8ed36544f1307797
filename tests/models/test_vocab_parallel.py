"""mindrl.models.vocab_parallel: the blocked log-prob function against torch's log_softmax over the gathered vocabulary
(and the composite form), at TP1, TP2 and TP4 on real gloo ranks: log-probs, the entropy metric and the logits' grad,
fp32 and bf16, with temperature, blocks smaller than the batch (a partial last block) and labels in every slice."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F


def _case(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(3, 7, 64, generator=gen) * 5).to(dtype)
    labels = torch.randint(0, 64, (3, 7), generator=gen)
    labels[0, :4] = torch.tensor([0, 15, 16, 63])  # both ends of the first and of later slices
    grad = torch.randn(3, 7, generator=gen)
    return logits, labels, grad


def _reference(logits, labels, grad, temperature):
    """Full vocabulary, autograd: (logprobs, entropy, d(sum grad * logprobs) / d logits)."""
    x = logits.detach().float().requires_grad_()
    logp = F.log_softmax(x / temperature, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (lp * grad).sum().backward()
    entropy = -(logp.exp() * logp).sum(-1)
    return lp.detach(), entropy.detach(), x.grad


def _vocab_parallel_rank(tp: int, dtype: torch.dtype, temperature: float, block_rows: int, kernels: str):
    with mock.patch.dict(os.environ, {"MINDRL_CPU_KERNELS": kernels}):  # the rank is shared: put it back after
        return _vocab_parallel_case(tp, dtype, temperature, block_rows)


def _vocab_parallel_case(tp: int, dtype: torch.dtype, temperature: float, block_rows: int):
    from megatron.core import parallel_state as ps

    from mindrl.launch import init_model_parallel
    from mindrl.models import vocab_parallel

    init_model_parallel(tp, 1)
    logits, labels, grad = _case(dtype)
    width = logits.shape[-1] // tp
    vocab_parallel.BLOCK_ELEMENTS = block_rows * width
    start = ps.get_tensor_model_parallel_rank() * width
    local = logits[..., start : start + width]
    out = {}
    for name, fn in {
        "blocked": lambda x: vocab_parallel.vocab_parallel_logprobs(
            x, labels, temperature, with_entropy=True, entropy_grad=False
        ),
        "composite": lambda x: vocab_parallel._composite(x, labels, temperature),
    }.items():
        x = local.clone().requires_grad_()
        lp, entropy = fn(x)
        assert lp.dtype == torch.float32 and lp.shape == labels.shape and entropy.shape == labels.shape
        (lp * grad).sum().backward()
        assert x.grad.dtype == dtype
        out[name] = (lp.detach(), entropy.detach(), x.grad.float())
    # forward only, no graph: the same numbers
    with torch.no_grad():
        lp, none = vocab_parallel.vocab_parallel_logprobs(local, labels, temperature)
    assert none is None and torch.equal(lp, out["blocked"][0])
    ref_lp, ref_ent, ref_grad = _reference(logits, labels, grad, temperature)
    out["reference"] = (ref_lp, ref_ent, ref_grad[..., start : start + width])
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "dtype,temperature,block_rows,kernels",
    [
        (torch.float32, 1.0, 21, "0"),
        (torch.float32, 0.7, 5, "0"),
        (torch.float32, 1.0, 5, "1"),
        (torch.float32, 0.7, 5, "1"),
        (torch.bfloat16, 0.7, 4, "1"),
        (torch.bfloat16, 1.0, 4, "1"),
    ],
    ids=[
        "fp32-one-block",
        "fp32-T0.7-blocks-of-5-rows",
        "fp32-T1-kernels",
        "fp32-T0.7-kernels",
        "bf16-T0.7-blocks-of-4-rows",
        "bf16-T1-blocks-of-4-rows",
    ],
)
def test_blocked_logprobs_match_log_softmax(pool, tp, dtype, temperature, block_rows, kernels):
    """21 rows of 64 logits: one block, or blocks of 5 / 4 rows whose last one is partial; fp32 also through the
    platform's fused kernels where it has them (one pass over each row, no blocks)."""
    results = pool.run(_vocab_parallel_rank, tp, dtype, temperature, block_rows, kernels)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for rank, out in enumerate(results):
        ref_lp, ref_ent, ref_grad = out["reference"]
        for name in ("blocked", "composite"):
            lp, ent, grad = out[name]
            # bf16 logits are exact in fp32, and both forms compute in fp32: only the grad's rounding to bf16 differs
            assert torch.allclose(lp, ref_lp, atol=1e-5, rtol=0), (rank, name, (lp - ref_lp).abs().max())
            assert torch.allclose(ent, ref_ent, atol=1e-5, rtol=0), (rank, name, (ent - ref_ent).abs().max())
            assert torch.allclose(grad, ref_grad, atol=tol, rtol=tol), (rank, name, (grad - ref_grad).abs().max())
    # every TP rank holds the same log-probs and entropy
    for out in results[1:]:
        assert torch.equal(out["blocked"][0], results[0]["blocked"][0])
