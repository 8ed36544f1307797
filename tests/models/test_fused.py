"""mindrl.models.fused against megatron's unfused ops: the SwiGLU activation module and the RoPE hook's dispatch, op by
op (bit-identical) and in a whole tiny model at TP1 and TP2 (both fusions on vs off, fp32 logits and grads); the
fused RMSNorm against torch's decomposed one (forward bit-identical, backward as close to fp64 as autograd's). With the
platform's kernels (mindrl.kernels.cpu_kernels, fp32 and bf16) the SiLU and the norm's sums are computed there: as
close to the fp64 values as torch's ops, not bit-identical to them (in bf16: rounded once, where torch rounds at each
op)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def _native(dtype) -> bool:
    """Whether mindrl's fused elementwise kernels run for this dtype here (fp32 and bf16 where the platform has them)."""
    from mindrl.kernels import current_kernels

    return dtype in (torch.float32, torch.bfloat16) and current_kernels().elementwise_kernels() is not None


def _no_further_from_truth(got, ref, truth, dtype, ulps: int = 4) -> None:
    """got is as close to the fp64 truth as ref (the unfused torch ops), or within `ulps` of its largest value."""
    err, ref_err = ((t.double() - truth).abs().max().item() for t in (got, ref))
    assert err <= max(ref_err, ulps * torch.finfo(dtype).eps * truth.abs().max().item()), (err, ref_err)


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["kernels", "torch-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_matches_megatrons_unfused_glu(dtype, kernels, monkeypatch):
    """Output and input grad bit-identical to the MLP's unfused glu (chunk, silu, mul), on fc1's [s, b, 2F] output,
    through the torch ops; through the platform's kernels (fp32, bf16) as close to the fp64 values as the unfused glu."""
    from mindrl.models.fused import swiglu

    monkeypatch.setenv("MINDRL_CPU_KERNELS", kernels)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 2, 2 * 24, generator=gen) * 4).to(dtype).requires_grad_()
    x.data[0, 0, :6] = torch.tensor([-200.0, -88.5, -30.0, 0.0, 30.0, 200.0])  # exp's clamps and the tails
    grad = torch.randn(9, 2, 24, generator=gen).to(dtype)
    outs = []
    for fn in (lambda t: F.silu(torch.chunk(t, 2, dim=-1)[0]) * torch.chunk(t, 2, dim=-1)[1], swiglu):
        x.grad = None
        y = fn(x)
        y.backward(grad)
        outs.append((y.detach(), x.grad.clone()))
    (y_ref, g_ref), (y, g) = outs
    assert y.dtype == dtype and g.dtype == dtype
    if kernels == "1" and _native(dtype):
        x64 = x.detach().double().requires_grad_()
        y64 = F.silu(x64[..., :24]) * x64[..., 24:]
        y64.backward(grad.double())
        _no_further_from_truth(y, y_ref, y64.detach(), dtype)
        _no_further_from_truth(g, g_ref, x64.grad, dtype)
    else:
        assert torch.equal(y, y_ref) and torch.equal(g, g_ref)
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(torch.zeros(2, 5))


def test_swiglu_module_refuses_what_it_does_not_cover():
    from types import SimpleNamespace

    from mindrl.models.fused import SwiGLU

    ok = dict(activation_func=F.silu, gated_linear_unit=True, glu_linear_offset=0.0, activation_func_clamp_value=None)
    SwiGLU(SimpleNamespace(**ok))
    with pytest.raises(ValueError, match="activation_func=silu"):
        SwiGLU(SimpleNamespace(**{**ok, "activation_func": F.gelu}))
    with pytest.raises(ValueError, match="clamp"):
        SwiGLU(SimpleNamespace(**{**ok, "activation_func_clamp_value": 7.0}))


def test_rope_hook_is_what_megatron_calls_and_mscale_keeps_the_unfused_path():
    """With apply_rope_fusion megatron's `apply_rotary_pos_emb` calls mindrl's function (bit-identical to its unfused
    one); with mscale != 1 (YaRN) megatron itself keeps its unfused form, which scales cos / sin."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    from mindrl.models.fused import fused_apply_rotary_pos_emb, install_fused_rope

    assert install_fused_rope() and install_fused_rope()  # idempotent
    assert rope_utils.fused_apply_rotary_pos_emb is fused_apply_rotary_pos_emb
    cfg = dict(rotary_interleaved=False, multi_latent_attention=False, mrope_section=None)
    fused_cfg, unfused_cfg = (
        SimpleNamespace(apply_rope_fusion=True, **cfg),
        SimpleNamespace(apply_rope_fusion=False, **cfg),
    )
    gen = torch.Generator().manual_seed(4)
    t = torch.randn(5, 2, 3, 8, generator=gen)
    f = torch.randn(5, 1, 1, 4, generator=gen)
    freqs = torch.cat([f, f], dim=-1)
    group = object()  # bshd never reads the context-parallel group
    fused = rope_utils.apply_rotary_pos_emb(t, freqs, fused_cfg, cp_group=group)
    assert torch.equal(fused, rope_utils.apply_rotary_pos_emb(t, freqs, unfused_cfg, cp_group=group))
    with pytest.warns(UserWarning, match="mscale"):
        scaled = rope_utils.apply_rotary_pos_emb(t, freqs, fused_cfg, mscale=1.5, cp_group=group)
    assert torch.equal(scaled, rope_utils.apply_rotary_pos_emb(t, freqs, unfused_cfg, mscale=1.5, cp_group=group))
    assert not torch.equal(scaled, fused)


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["kernels", "torch-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_matches_the_decomposed_norm(dtype, kernels, monkeypatch):
    """Forward bit-identical to weight * rms_norm(x.float()).to(dtype) (the module's unfused form) and to HF's
    pow / mean / rsqrt formula; the grads of x and of the weight no further from the fp64 truth than autograd's."""
    from mindrl.models.fused import rms_norm

    monkeypatch.setenv("MINDRL_CPU_KERNELS", kernels)
    hidden, eps = 64, 1e-6
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(37, 3, hidden, generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    grad = torch.randn(37, 3, hidden, generator=gen).to(dtype)

    def unfused(t, w):
        return w * F.rms_norm(t.float(), (hidden,), eps=eps).to(t.dtype)

    def run(fn, t, w):
        t, w = t.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(t, w)
        out.backward(grad.to(t.dtype))
        return out.detach(), t.grad, w.grad

    out, dx, dw = run(lambda t, w: rms_norm(t, w, eps), x, weight)
    ref_out, ref_dx, ref_dw = run(unfused, x, weight)
    assert out.dtype == dx.dtype == dw.dtype == dtype
    xf = x.float()
    hf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if kernels == "1" and _native(dtype):  # the kernel's sum of squares: as close to the fp64 norm as torch's
        hf = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)  # y, the weight grad's truth
        _no_further_from_truth(out, ref_out, weight.double() * hf, dtype)
    else:
        assert torch.equal(out, ref_out)
        assert torch.equal(out, weight * hf.to(dtype))
    # the truth: the same function in fp64, with the weight applied to y as rounded to dtype (what forward multiplies)
    x64 = x.double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    (weight.double() * y64).backward(grad.double())
    native = kernels == "1" and _native(dtype)  # the kernels apply the weight to y unrounded (fp32)
    true_dw = (grad.double() * (hf if native else hf.to(dtype)).double()).sum((0, 1))
    ulp = torch.finfo(dtype).eps
    for got, ref, truth in ((dx, ref_dx, x64.grad), (dw, ref_dw, true_dw)):
        err, ref_err = ((g.double() - truth).abs().max().item() for g in (got, ref))
        assert err <= max(ref_err, 4 * ulp * truth.abs().max().item()), (err, ref_err)
    with pytest.raises(ValueError, match="does not match"):
        rms_norm(x, weight[:-1], eps)


def _fusion_parity_rank(hf_dir: str, tp: int, ids: torch.Tensor, mask: torch.Tensor, kernels: str):
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"MINDRL_CPU_KERNELS": kernels}):  # the rank is shared: put it back after
        return _fusion_parity(hf_dir, tp, ids, mask)


def _fusion_parity(hf_dir: str, tp: int, ids: torch.Tensor, mask: torch.Tensor):
    from megatron.core import parallel_state as ps

    from mindrl.launch import init_model_parallel
    from mindrl.models.builder import RMSNorm, build_model
    from mindrl.models.forward import attention_inputs, forward_outputs
    from mindrl.models.fused import SwiGLU
    from mindrl.models.hf_config import ModelSpec

    init_model_parallel(tp, 1)
    torch.manual_seed(0)
    model = build_model(ModelSpec.from_hf_dir(hf_dir), dtype="float32")
    config = model.config  # one config object, shared by every layer
    assert config.apply_rope_fusion and config.use_te_activation_func and not config.bias_activation_fusion
    assert any(isinstance(m, SwiGLU) for m in model.modules())
    assert not any("activation_func" in k for k in [*model.state_dict(), *model.sharded_state_dict()])

    def run():
        logits = forward_outputs(model, ids, mask)
        model.zero_grad(set_to_none=True)
        pos, m = attention_inputs(ids, mask)
        model(ids, pos, m).float().pow(2).mean().backward()
        return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused_logits, fused_grads = run()
    config.apply_rope_fusion = config.use_te_activation_func = False  # megatron's unfused RoPE and glu
    ref_logits, ref_grads = run()
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * config.num_layers + 1 and all(m.fused for m in norms)
    for m in norms:
        m.fused = False  # torch's rms_norm, decomposed under autograd
    norm_logits, norm_grads = run()
    if ps.get_tensor_model_parallel_rank() or ps.get_data_parallel_rank():
        return None
    valid = mask.bool()
    norm_logit_diff = (norm_logits - ref_logits)[valid].abs().max().item()
    grad_diff = max(((fused_grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items())
    norm_grad_rel = max(((norm_grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items())
    return (
        (fused_logits - ref_logits)[valid].abs().max().item(),
        grad_diff,
        ref_logits[valid].abs().max().item(),
        norm_logit_diff,
        norm_grad_rel,
    )


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["kernels", "torch-ops"])
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_model_matches_the_unfused_model(pool, tiny_models, tp, kernels):
    """The fused functions against megatron's unfused RoPE and glu: bit-identical through the torch ops; through the
    platform's kernels (SiLU's exp computed there) within fp32 rounding."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1000, (3, 21), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    results = [r for r in pool.run(_fusion_parity_rank, tiny_models["untied"], tp, ids, mask, kernels) if r]
    logit_diff, grad_diff, scale, norm_logit_diff, norm_grad_rel = results[0]
    print(f"tp{tp}: max |fused - unfused| logits {logit_diff:.3g} (|logits| {scale:.3g}), grads {grad_diff:.3g} "
          "relative; "
          f"RMSNorm fused vs torch's: logits {norm_logit_diff:.3g}, grads {norm_grad_rel:.3g} relative")  # fmt: skip
    assert scale > 0.01
    if kernels == "1" and _native(torch.float32):
        assert logit_diff <= 1e-6 * scale and grad_diff < 1e-5, (logit_diff, grad_diff)
        assert norm_logit_diff <= 1e-6 * scale  # the kernel's norm: its sums in another order
    else:
        assert logit_diff == 0 and grad_diff == 0  # bit-identical
        assert norm_logit_diff == 0  # the fused RMSNorm's forward: the very values of torch's
    # the fused RMSNorm's backward, summed in another order: fp32 rounding only
    assert norm_grad_rel < 1e-5


def test_bf16_model_held_to_avx2(tiny_models):
    """An AVX2-only CPU's bf16 run, on this one: torch's kernels (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA)
    and mindrl's kernels (MINDRL_CPU_KERNELS_MARCH=x86-64-v3) held to AVX2, in a fresh process. The bf16 model's
    forward and backward run through the kernels' bf16 forms, and their logits and grads are as close to the fp64
    model's (same weights) as the plain-torch bf16 model's (`tests.models.bf16_checks`). vLLM's AVX2 kernels are
    forced in tests/rollout/test_vllm_tp.py."""
    from tests.kernels.test_cpu_kernels import _marches
    from tests.models.bf16_checks import EXPECT_AVX2_ENV, HF_DIR_ENV
    from tests.procs import check_in_fresh_process

    if "x86-64-v3" not in _marches():
        pytest.skip("needs an x86-64 CPU with AVX2 (to run as an AVX2-only one)")
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MINDRL_CPU_KERNELS_MARCH": "x86-64-v3"}
    check_in_fresh_process(
        "tests.models.bf16_checks", "bf16_model_gap", **env, **{HF_DIR_ENV: tiny_models["untied"], EXPECT_AVX2_ENV: "1"}
    )
