"""Checks run in a fresh interpreter (`tests.procs.check_in_fresh_process`): a bf16 model's forward and backward with
mindrl's bf16 kernels against the same weights in fp64, beside the plain-torch bf16 model (kernels off); on this
CPU, or held to AVX2 (torch, oneDNN and the kernels' build), as an AVX2-only CPU runs it."""

from __future__ import annotations

import os
import time

import torch

HF_DIR_ENV = "MINDRL_TEST_HF_DIR"
EXPECT_AVX2_ENV = "MINDRL_TEST_EXPECT_AVX2"


def _run(model, ids, mask, dtype):
    from mindrl.models.forward import attention_inputs

    model.zero_grad(set_to_none=True)
    pos, m = attention_inputs(ids, mask)
    start = time.process_time()
    logits = model(ids, pos, m)
    logits.double().pow(2).mean().backward()
    seconds = time.process_time() - start
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    return logits.detach().double(), grads, seconds


def bf16_model_gap() -> None:
    from mindrl.kernels import cpu_kernels, current_kernels
    from mindrl.launch import free_port, init_model_parallel, join_world
    from mindrl.models.builder import build_model
    from mindrl.models.hf_config import ModelSpec

    join_world(0, 1, "127.0.0.1", free_port(), timeout_s=60)
    init_model_parallel(1, 1)
    spec = ModelSpec.from_hf_dir(os.environ[HF_DIR_ENV])
    if os.environ.get(EXPECT_AVX2_ENV) == "1":  # the holding took effect: torch's kernels and the kernels' build
        assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
        avx2_build = cpu_kernels.build(cpu_kernels.cache_dir(), march="x86-64-v3")
        assert current_kernels().elementwise_kernels().path == avx2_build
    bf16 = build_model(spec, dtype="bfloat16")
    fp64 = build_model(spec, dtype="float64")
    fp64.load_state_dict(
        {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in bf16.state_dict().items()}
    )
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, spec.vocab_size, (4, 33), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    valid = mask.bool()
    truth, truth_grads, _ = _run(fp64, ids, mask, torch.float64)
    gaps = {}
    for kernels in ("1", "0", "1", "0"):  # each twice: the second, warm, is kept (its CPU seconds are printed)
        os.environ["MINDRL_CPU_KERNELS"] = kernels
        logits, grads, seconds = _run(bf16, ids, mask, torch.bfloat16)
        gaps[kernels] = (
            (logits - truth)[valid].abs().mean().item(),
            ((grads - truth_grads).abs().mean() / truth_grads.abs().mean()).item(),
            seconds,
        )
    print(f"bf16 vs fp64, mean |logits| gap / mean relative grad gap / CPU s: kernels {gaps['1']}, torch {gaps['0']}")
    (logit_k, grad_k, _), (logit_t, grad_t, _) = gaps["1"], gaps["0"]
    # Both runs round the same bf16 GEMMs, which make most of the gap to fp64; the kernels change only how the
    # elementwise ops round (once, from fp32), so their gap is torch's own to within its size (here they agreed to
    # 4 digits). A kernel that computed something else would be off by the values' own size, orders beyond this.
    assert 0 < logit_k <= 2 * logit_t and 0 < grad_k <= 2 * grad_t, gaps
    print("bf16_model_gap: ok")
