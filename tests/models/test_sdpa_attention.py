"""mindrl's fused layers equal megatron's reference ones on a tiny GQA model with left-padded rows, at TP1 and TP2,
the same loaded model run both ways (fp32 logits and grads): SDPA core attention (torch's kernel, and the batched-GEMM
path short sequences take on CPU) vs DotProductAttention, and the one-pass RoPE (mindrl.models.fused) vs megatron's
unfused RoPE (bit-identical)."""

from __future__ import annotations

import pytest
import torch

from mindrl.checkpoint import convert


def _parity_rank(load_dir: str, tp: int, ids: torch.Tensor, mask: torch.Tensor, gemm_max_len: int):
    import os
    from unittest import mock

    # read at every forward; the shared rank's own setting comes back afterwards
    with mock.patch.dict(os.environ, {"MINDRL_GEMM_ATTENTION_MAX_LEN": str(gemm_max_len)}):
        return _parity(load_dir, tp, ids, mask)


def _parity(load_dir: str, tp: int, ids: torch.Tensor, mask: torch.Tensor):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mindrl.checkpoint import loading
    from mindrl.models.attention import SDPAttention
    from mindrl.models.forward import attention_inputs, forward_outputs

    _, _, model = loading.build_and_load(load_dir, tp, 1, "float32")
    cores = [m for m in model.modules() if isinstance(m, SDPAttention)]
    assert cores, "the layer spec must use SDPAttention"

    def run():
        logits = forward_outputs(model, ids, mask)
        model.zero_grad(set_to_none=True)
        pos, m = attention_inputs(ids, mask)
        model(ids, pos, m).float().pow(2).mean().backward()
        return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    new_logits, new_grads = run()
    for core in cores:
        core.__class__ = DotProductAttention
    old_logits, old_grads = run()
    if ps.get_tensor_model_parallel_rank() or ps.get_data_parallel_rank():
        return None
    valid = mask.bool()
    logit_diff = (new_logits - old_logits)[valid].abs().max().item()
    grad_diff = max(
        ((new_grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in old_grads.items()
    )
    return logit_diff, grad_diff, old_logits[valid].abs().max().item()


@pytest.fixture(scope="module")
def tiny_tp2(tmp_path_factory) -> str:
    import tests.conftest as conftest
    from mindrl.launch import RankPool
    from tools.make_tiny_model import make_tiny_model

    if conftest._POOL is None or conftest._POOL.closed:
        conftest._POOL = RankPool(4, timeout_s=600)
    root = tmp_path_factory.mktemp("sdpa")
    hf = make_tiny_model(str(root / "hf"), arch="llama", num_layers=2, seed=31)
    convert.hf2mcore(hf, str(root / "mcore"), 2, 1, pool=conftest._POOL)
    return str(root / "mcore")


@pytest.mark.parametrize("path", ["sdpa", "gemm"])
@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_matches_dot_product_attention(pool, tiny_tp2, tp, path):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (4, 40), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 5, 17, 39)):  # left padding, down to a single real token
        mask[row, :pad] = 0
    gemm_max_len = 40 if path == "gemm" else 0
    results = [r for r in pool.run(_parity_rank, tiny_tp2, tp, ids, mask, gemm_max_len) if r is not None]
    logit_diff, grad_diff, scale = results[0]
    print(f"tp{tp} {path}: max |ours - dpa| logits {logit_diff:.3g} (|logits| {scale:.3g}), grads rel {grad_diff:.3g}")
    assert scale > 0.1
    assert logit_diff < 1e-5
    assert grad_diff < 1e-4


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["kernels", "torch-ops"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "left-padded"])
def test_gemm_attention_matches_sdpa_in_fp64(monkeypatch, masked, kernels):
    """GemmAttention (grouped heads read in place, the batch in chunks: here 1 to 3 rows, so the last chunk is short)
    against torch's SDPA with repeated K/V heads, both fp32, measured against SDPA in fp64: outputs and the grads of
    q, k and v within 1e-6 of the largest true value, as torch's kernel is (printed)."""
    from mindrl.models import attention
    from mindrl.models.forward import attention_inputs

    monkeypatch.setenv("MINDRL_CPU_KERNELS", kernels)  # fp32: the masked softmax and its backward fused, or not
    gen = torch.Generator().manual_seed(7)
    s, b, heads, kv, d = 37, 5, 6, 2, 16
    q, k, v = (torch.randn(s, b, n, d, generator=gen, dtype=torch.float64) for n in (heads, kv, kv))
    grad = torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64)
    valid = torch.ones(b, s, dtype=torch.long)
    if masked:
        for row, pad in enumerate((0, 3, 11, 36, 20)):
            valid[row, :pad] = 0
    _, mask = attention_inputs(valid, valid)
    scale = d**-0.5

    def sdpa(q, k, v):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=scale)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [out.detach().double()] + [t.grad.double() for t in leaves]

    truth = run(sdpa, torch.float64)
    for chunk_rows in (1, 2, 3):
        monkeypatch.setattr(attention, "SCORE_CHUNK_BYTES", chunk_rows * heads * s * s * 4)
        ours = run(lambda q, k, v: attention.gemm_attention(q, k, v, mask, scale), torch.float32)
        kernel = run(sdpa, torch.float32)
        for name, o, r, t in zip(("out", "dq", "dk", "dv"), ours, kernel, truth):
            size = t.abs().max().item()
            err, kernel_err = (o - t).abs().max().item() / size, (r - t).abs().max().item() / size
            print(f"{chunk_rows} row(s) per chunk, {name}: relative error {err:.2g} (torch's kernel {kernel_err:.2g})")
            assert err < 1e-6, (chunk_rows, name, err, kernel_err)
    assert truth[0].abs().max() > 0.1


@pytest.mark.parametrize("path", ["gemm", "sdpa"])
def test_prefix_groups_attend_as_their_rows(monkeypatch, path):
    """Packed prefix groups (two prompts, one left-padded, with 3 samples each, responses right-padded), attended
    the decomposed way (the prompt once, each response over [prompt, itself]) and through the packed layout's full
    mask, equal each row attended on its own with its usual mask: fp32 within 1e-6 of the largest fp64 value, at
    every real query; their gradients (the prompt's keys and values summed over the samples) within 1e-6 of the
    full mask's in fp64."""
    from types import SimpleNamespace

    from mindrl.models.attention import SDPAttention, prefix_groups_of
    from mindrl.models.forward import attention_inputs, prefix_group_inputs

    monkeypatch.setenv("MINDRL_GEMM_ATTENTION_MAX_LEN", "320" if path == "gemm" else "0")
    gen = torch.Generator().manual_seed(11)
    groups, n, p, r, heads, kv, d = 2, 3, 5, 4, 4, 2, 8
    prompt_mask = torch.tensor([[1] * p, [0, 0] + [1] * (p - 2)])
    response_mask = torch.tensor([[1] * r, [1, 1, 0, 0], [1] * 3 + [0]] * groups)
    prompt_ids = torch.randint(1, 50, (groups, p), generator=gen) * prompt_mask
    response_ids = torch.randint(1, 50, (groups * n, r), generator=gen) * response_mask
    _, _, mask, layout = prefix_group_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    s = layout.width
    q, k, v = (torch.randn(s, groups, h, d, generator=gen, dtype=torch.float64) for h in (heads, kv, kv))
    core = SDPAttention.__new__(SDPAttention)  # the attention maths only: no megatron module state is read
    torch.nn.Module.__init__(core)
    core.softmax_scale, core.num_attention_heads_per_partition, core.num_query_groups_per_partition = d**-0.5, heads, kv
    core.hidden_size_per_partition, core.config = heads * d, SimpleNamespace(sequence_parallel=False)

    def row_truth(i, j):  # row j of prompt i on its own: [p + r, heads * d]
        cols = torch.cat([torch.arange(p), p + j * r + torch.arange(r)])
        valid = torch.cat([prompt_mask[i], response_mask[i * n + j]]).view(1, -1)
        _, row_mask = attention_inputs(valid, valid)
        t = [x[cols, i : i + 1] for x in (q, k, v)]
        return core._context(core._attend(*t, row_mask, 0.0))[:, 0]

    size = max(row_truth(i, j).abs().max().item() for i in range(groups) for j in range(n))
    grad = torch.randn(s, groups, heads * d, generator=gen, dtype=torch.float64)

    def run(name, dtype):  # (context, grads of q, k, v) in the packed layout
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        if name == "decomposed":
            out = core._prefix_groups(*leaves, *prefix_groups_of(mask), 0.0)
        else:  # a copy of the mask carries no layout: the full [s, s] mask
            out = core._context(core._attend(*leaves, mask.clone(), 0.0))
        out.backward(grad.to(dtype))
        return [out.detach().double()] + [x.grad.double() for x in leaves]

    truth = run("full mask", torch.float64)
    for name in ("decomposed", "full mask"):
        out, *grads = run(name, torch.float32)
        for i in range(groups):
            for j in range(n):
                want = row_truth(i, j)
                got = torch.cat([out[:p, i], out[p + j * r : p + (j + 1) * r, i]])
                real = torch.cat([prompt_mask[i], response_mask[i * n + j]]).bool()
                err = (got - want)[real].abs().max().item() / size
                assert err < 1e-6, (name, i, j, err)
        for what, got, want in zip(("dq", "dk", "dv"), grads, truth[1:]):
            err = (got - want).abs().max().item() / want.abs().max().item()
            assert err < 1e-6, (name, what, err)


def test_gemm_attention_takes_short_sequences_on_cpu_only(monkeypatch):
    from mindrl.platform import CpuPlatform, CudaPlatform

    cpu, cuda = CpuPlatform(), CudaPlatform()
    monkeypatch.delenv("MINDRL_GEMM_ATTENTION_MAX_LEN", raising=False)
    assert (cpu.gemm_attention_max_len(), cpu.gemm_attention_max_len(training=False)) == (320, 160)
    assert cuda.gemm_attention_max_len() == cuda.gemm_attention_max_len(training=False) == 0
    monkeypatch.setenv("MINDRL_GEMM_ATTENTION_MAX_LEN", "0")
    assert cpu.gemm_attention_max_len() == cpu.gemm_attention_max_len(training=False) == 0
    monkeypatch.setenv("MINDRL_GEMM_ATTENTION_MAX_LEN", "many")
    with pytest.raises(ValueError, match="MINDRL_GEMM_ATTENTION_MAX_LEN='many' is not an integer"):
        cpu.gemm_attention_max_len()


def _dropout_rank(load_dir: str, ids: torch.Tensor, mask: torch.Tensor):
    from megatron.core import tensor_parallel

    from mindrl.checkpoint import loading
    from mindrl.models.attention import SDPAttention
    from mindrl.models.forward import attention_inputs

    _, _, model = loading.build_and_load(load_dir, 2, 1, "float32")
    for core in (m for m in model.modules() if isinstance(m, SDPAttention)):
        core.attention_dropout.p = 0.5
    model.train()
    pos, m = attention_inputs(ids, mask)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved, default = tracker.get_states(), torch.get_rng_state()
    first = model(ids, pos, m).detach()
    default_untouched = torch.equal(default, torch.get_rng_state())
    tracker.set_states(saved)
    again = model(ids, pos, m).detach()
    model.eval()
    plain = model(ids, pos, m).detach()
    return default_untouched, torch.equal(first, again), (first - plain).abs().max().item()


def test_attention_dropout_draws_from_the_tp_ranks_own_stream(pool, tiny_tp2):
    """As in DotProductAttention, dropout masks come from megatron's model-parallel RNG tracker (each TP rank its own
    stream), so the default generator, seeded alike on every TP rank, is left untouched; replaying the tracker
    replays the masks."""
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    for default_untouched, replayed, dropout_effect in pool.run(_dropout_rank, tiny_tp2, ids, mask)[:2]:
        assert default_untouched and replayed
        assert dropout_effect > 1e-3


def _rope_rank(load_dir: str, tp: int, ids: torch.Tensor, mask: torch.Tensor):
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings import rope_utils

    from mindrl.checkpoint import loading
    from mindrl.models.forward import attention_inputs, forward_outputs
    from mindrl.models.fused import fused_apply_rotary_pos_emb

    _, _, model = loading.build_and_load(load_dir, tp, 1, "float32")
    assert model.config.apply_rope_fusion and rope_utils.fused_apply_rotary_pos_emb is fused_apply_rotary_pos_emb

    def run():
        logits = forward_outputs(model, ids, mask)
        model.zero_grad(set_to_none=True)
        pos, m = attention_inputs(ids, mask)
        model(ids, pos, m).float().pow(2).mean().backward()
        return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused_logits, fused_grads = run()
    model.config.apply_rope_fusion = False  # one config object, shared by every layer
    ref_logits, ref_grads = run()
    if ps.get_tensor_model_parallel_rank() or ps.get_data_parallel_rank():
        return None
    valid = mask.bool()
    grad_diff = max(
        ((fused_grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in ref_grads.items()
    )
    return (fused_logits - ref_logits)[valid].abs().max().item(), grad_diff, ref_logits[valid].abs().max().item()


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_rope_matches_megatrons_unfused_rope_in_the_model(pool, tiny_tp2, tp):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1000, (3, 33), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    results = [r for r in pool.run(_rope_rank, tiny_tp2, tp, ids, mask) if r is not None]
    logit_diff, grad_diff, scale = results[0]
    print(
        f"tp{tp}: max |fused - unfused RoPE| logits {logit_diff:.3g} (|logits| {scale:.3g}), grads rel {grad_diff:.3g}"
    )
    assert scale > 0.1
    assert logit_diff == 0 and grad_diff == 0  # bit-identical


@pytest.mark.parametrize(
    "dtype, rot_dim",
    [(torch.float32, 16), (torch.float32, 8), (torch.bfloat16, 16)],
    ids=["fp32", "fp32-partial-rotary", "bf16"],
)
def test_fused_rope_op_matches_megatrons_unfused_op(dtype, rot_dim):
    """Output and input grad are bit-identical to megatron's `_apply_rotary_pos_emb_bshd` in fp32, for q as the fused
    QKV projection's strided view, with every channel rotated or only the first rot_dim (the rest passed through). In
    bf16 the fused op computes in fp32 and rounds once, megatron's rounds each step: there the fused op is at least as
    close to the fp64 result (megatron's op on the same bf16 inputs in fp64) as megatron's bf16 op is."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from mindrl.models.fused import fused_apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(6)
    s, b, heads, dim = 11, 3, 4, 16
    qkv = torch.randn(s, b, heads, 3 * dim, generator=gen).to(dtype).requires_grad_()
    f = torch.randn(s, 1, 1, rot_dim // 2, generator=gen) * 3
    freqs = torch.cat([f, f], dim=-1)
    grad = torch.randn(s, b, heads, dim, generator=gen).to(dtype)
    outs = []
    for fn in (_apply_rotary_pos_emb_bshd, fused_apply_rotary_pos_emb):
        qkv.grad = None
        y = fn(qkv[..., :dim], freqs)
        y.backward(grad)
        outs.append((y.detach().float(), qkv.grad.float()))
    (y_ref, g_ref), (y, g) = outs
    if dtype == torch.float32:
        assert torch.equal(y, y_ref) and torch.equal(g, g_ref)
    else:
        q64 = qkv.detach().double().requires_grad_()
        y64 = _apply_rotary_pos_emb_bshd(q64[..., :dim], freqs.double())
        y64.backward(grad.double())
        for fused, unfused, exact in ((y, y_ref, y64.detach()), (g, g_ref, q64.grad)):
            assert (fused.double() - exact).abs().max() <= (unfused.double() - exact).abs().max()
            assert (fused.double() - exact).abs().mean() <= (unfused.double() - exact).abs().mean()
    assert not torch.equal(y[..., :rot_dim], qkv[..., :rot_dim].detach().float())  # it did rotate


def test_fused_rope_refuses_what_it_does_not_cover():
    from mindrl.models.fused import fused_apply_rotary_pos_emb

    t = torch.randn(2, 1, 1, 8)
    with pytest.raises(NotImplementedError, match="rotate-half"):
        fused_apply_rotary_pos_emb(t, torch.zeros(2, 1, 1, 8), interleaved=True)
    with pytest.raises(ValueError, match="width 10 do not fit heads of width 8"):
        fused_apply_rotary_pos_emb(t, torch.zeros(2, 1, 1, 10))


class FakeTorchNpu:
    """A named fake of `torch_npu` for a CPU host (there is no NPU here): `npu_fusion_attention` and `npu_rms_norm`
    with the documented signatures and conventions (BNSD layout, grouped K/V heads read in place, a bool atten_mask
    with True = hidden; outputs as tuples), computed in fp32 with torch, recording each call's operands."""

    def __init__(self):
        self.calls = []

    def npu_fusion_attention(self, q, k, v, head_num, input_layout, atten_mask=None, scale=1.0, keep_prob=1.0):
        self.calls.append(("attention", q.dtype, tuple(q.shape), tuple(k.shape), head_num, input_layout))
        assert input_layout == "BNSD" and head_num == q.shape[1] and keep_prob == 1.0
        return _FakeFusionAttention.apply(q, k, v, atten_mask, scale), None, None, None, 0, 0, 0

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self.calls.append(("rms_norm", x.dtype))
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd).to(x.dtype) * gamma, rstd


class _FakeFusionAttention(torch.autograd.Function):
    """The fake kernel keeps what a fused kernel keeps for backward (its 16-bit operands), recomputing in fp32."""

    @staticmethod
    def _maths(q, k, v, mask, scale):
        groups = q.shape[1] // k.shape[1]
        k, v = (t.float().repeat_interleave(groups, dim=1) for t in (k, v))
        scores = (q.float() @ k.transpose(-1, -2)).mul(scale).masked_fill(mask, float("-inf"))
        return (torch.softmax(scores, -1) @ v).to(q.dtype)

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return _FakeFusionAttention._maths(q, k, v, mask, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = _FakeFusionAttention._maths(*leaves, mask, ctx.scale)
            return (*torch.autograd.grad(out, leaves, grad), None, None)


def _bare_core(heads: int, kv: int, d: int, fp32_softmax: bool = True):
    from types import SimpleNamespace

    from mindrl.models.attention import SDPAttention

    core = SDPAttention.__new__(SDPAttention)  # the attention maths only: no megatron module state is read
    torch.nn.Module.__init__(core)
    core.softmax_scale, core.num_attention_heads_per_partition, core.num_query_groups_per_partition = d**-0.5, heads, kv
    core.hidden_size_per_partition = heads * d
    core.softmax_offset, core.attention_dropout = None, torch.nn.Dropout(0.0)
    core.config = SimpleNamespace(sequence_parallel=False, attention_softmax_in_fp32=fp32_softmax, window_size=None)
    return core


@pytest.mark.parametrize("platform", ["cpu", "cuda", "npu"])
def test_device_attention_keeps_no_fp32_copy_of_bf16_operands(monkeypatch, platform):
    """A bf16 model's core attention on each platform's path, on left-padded GQA rows: on CPU q, k and v are cast to
    fp32 for the softmax and those copies kept for backward (what the planner counts there); on CUDA (torch's SDPA
    kernel, which keeps its softmax in fp32 inside) and on an NPU (npu_fusion_attention, through a named fake:
    there is no NPU here) the kernel gets the bf16 operands and no fp32 tensor as large as q is saved. Every path's
    context is within twice the CPU path's own error of the fp64 truth (at least one bf16 step of the largest
    value), so leaving the operands in bf16 costs no more than the final cast does."""
    import sys

    from mindrl.models import attention
    from mindrl.models.forward import attention_inputs
    from mindrl.platform import CpuPlatform, CudaPlatform
    from mindrl.platform.npu import NpuPlatform

    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setenv("MINDRL_GEMM_ATTENTION_MAX_LEN", "0")
    gen = torch.Generator().manual_seed(5)
    s, b, heads, kv, d = 24, 3, 8, 2, 16
    q, k, v = (torch.randn(s, b, n, d, generator=gen, dtype=torch.float64) for n in (heads, kv, kv))
    valid = torch.ones(b, s, dtype=torch.long)
    for row, pad in enumerate((0, 4, 15)):
        valid[row, :pad] = 0
    _, mask = attention_inputs(valid, valid)
    core = _bare_core(heads, kv, d)

    def run(plat):
        monkeypatch.setattr(attention, "current_platform", lambda: plat)
        leaves = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        saved = []

        def pack(t):
            saved.append((t.dtype, t.numel()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = core.forward(*leaves, mask)
        out.float().pow(2).sum().backward()
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
        return out.detach().double(), saved

    monkeypatch.setattr(attention, "current_platform", lambda: CpuPlatform())
    bf16 = [t.to(torch.bfloat16).double() for t in (q, k, v)]
    truth = core.forward(*bf16, mask).detach()  # fp64 maths on the same bf16 values
    real = valid.bool().t()  # [s, b]: the real queries
    size = truth[real].abs().max().item()
    cpu_out, cpu_saved = run(CpuPlatform())
    cpu_err = (cpu_out - truth)[real].abs().max().item()
    bound = max(2 * cpu_err, size * 2**-8)
    largest_fp32 = {
        name: max((n for dtype, n in saved if dtype == torch.float32), default=0)
        for name, saved in [("cpu", cpu_saved)]
    }
    assert largest_fp32["cpu"] >= q.numel(), "the CPU path keeps fp32 copies of the operands"
    if platform == "cpu":
        return
    plat = CudaPlatform() if platform == "cuda" else NpuPlatform()
    out, saved = run(plat)
    err = (out - truth)[real].abs().max().item()
    print(f"{platform}: error {err:.3g}, CPU path {cpu_err:.3g}, largest value {size:.3g}")
    assert err <= bound, (err, cpu_err)
    assert max((n for dtype, n in saved if dtype == torch.float32), default=0) < q.numel(), saved
    if platform == "npu":
        (call,) = [c for c in fake.calls if c[0] == "attention"]
        assert call[1] == torch.bfloat16 and call[3][1] == kv, call  # bf16 operands, grouped K/V not expanded


def test_device_rms_norm_goes_through_the_platform(monkeypatch):
    """On a platform with a device RMSNorm kernel (NPU: npu_rms_norm, through a named fake here) mindrl's RMSNorm
    calls it on the hidden states as they are; its values equal the HF-exact norm's within one bf16 step."""
    import sys
    from types import SimpleNamespace

    from mindrl.models import builder
    from mindrl.platform import CpuPlatform
    from mindrl.platform.npu import NpuPlatform

    config = SimpleNamespace(params_dtype=torch.bfloat16, sequence_parallel=False)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    monkeypatch.setattr(builder, "current_platform", lambda: CpuPlatform())
    want = builder.RMSNorm(config, 32)(x)
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(builder, "current_platform", lambda: NpuPlatform())
    norm = builder.RMSNorm(config, 32)
    got = norm(x)
    assert fake.calls == [("rms_norm", torch.bfloat16)]
    assert (got.float() - want.float()).abs().max().item() <= want.float().abs().max().item() * 2**-7
