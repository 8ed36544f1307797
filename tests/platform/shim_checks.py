"""Checks of the megatron CPU shim, run by test_platform.py in a fresh interpreter each (the shim stays
applied for the life of a process). Each prints "<name>: ok" when every assertion held."""

from __future__ import annotations

import torch

from mindrl.platform import current_platform


def megatron_only() -> None:
    current_platform().apply()
    current_platform().apply()  # idempotent
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.tensor_parallel import random as tp_random

    assert schedules.torch is not torch and schedules.torch.cuda.current_device() == torch.device("cpu")
    assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.cuda.current_device is not schedules.torch.cuda.current_device  # real torch untouched
    # The tensor-parallel RNG tracker runs on the CPU generator and reproduces forks exactly.
    tp_random.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = tp_random.get_cuda_rng_tracker()
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)
    tp_random.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    with tp_random.get_cuda_rng_tracker().fork():
        b = torch.rand(4)
    assert torch.equal(a, b)
    print("megatron_only: ok")


def optimizer_type_checks() -> None:
    current_platform().apply()
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 4.0)
    for fn in (megatron_optimizer.clip_grad_by_total_norm_fp32, clip_grads.clip_grad_by_total_norm_fp32):
        assert fn.__wrapped__ is not None  # the CPU-adapted wrapper, in both modules
    assert p.type() == "torch.FloatTensor"  # outside those calls, type names are untouched
    print("optimizer_type_checks: ok")
