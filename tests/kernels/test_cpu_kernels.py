"""mindrl's fused CPU kernels (mindrl.kernels.cpu_kernels) against torch: SwiGLU and RMSNorm, forward and backward,
as close to the fp64 values as torch's ops, RoPE bit-identical to the torch-op form, for odd sizes, strided
inputs and pass-through channels; built for this CPU and for plain AVX2 (x86-64-v3); off, or without a compiler,
None with the reason."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from mindrl.kernels import cpu_kernels

HAS_COMPILER = cpu_kernels.c_compiler() is not None


def _marches() -> list[str]:
    """This CPU's build, and the AVX2 one where this CPU runs it (what an AVX2-only machine gets)."""
    out = ["native"]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    if {"avx2", "fma", "bmi2", "movbe"} <= set(flags):
        out.append("x86-64-v3")
    return out


@pytest.fixture(params=_marches())
def kernels(request, tmp_path_factory):
    if not HAS_COMPILER:
        pytest.skip("no C compiler: the torch-op forms run (test_without_a_compiler_the_torch_forms_run)")
    path = cpu_kernels.build(str(tmp_path_factory.getbasetemp() / "kernels"), march=request.param)
    assert path is not None
    return cpu_kernels.Kernels(path)


def _close(got: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, ulps: int = 4) -> None:
    """got no further from the fp64 truth than torch's ref, or within `ulps` fp32 ulps of its largest value."""
    err, ref_err = ((t.double() - truth).abs().max().item() for t in (got, ref))
    assert err <= max(ref_err, ulps * torch.finfo(torch.float32).eps * truth.abs().max().item()), (err, ref_err)


def test_kernels_load_where_a_compiler_is(monkeypatch):
    monkeypatch.setenv("MINDRL_CPU_KERNELS", "1")
    if HAS_COMPILER and torch.backends.openmp.is_available():
        k = cpu_kernels.load()
        assert k is not None and k.path.startswith(cpu_kernels.cache_dir())
        assert cpu_kernels.torch_openmp_runtime() is not None  # the library runs on torch's own OpenMP runtime
    monkeypatch.setenv("MINDRL_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None
    monkeypatch.setenv("MINDRL_CPU_KERNELS", "yes")
    with pytest.raises(ValueError, match="MINDRL_CPU_KERNELS='yes' must be 0 or 1"):
        cpu_kernels.load()


def test_without_a_compiler_the_torch_forms_run(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "c_compiler", lambda: None)
    with pytest.warns(UserWarning, match="no C compiler"):
        assert cpu_kernels.build(str(tmp_path)) is None
    monkeypatch.setattr(cpu_kernels, "c_compiler", lambda: shutil.which("false"))
    if shutil.which("false"):
        with pytest.warns(UserWarning, match="could not build the CPU kernels"):
            assert cpu_kernels.build(str(tmp_path / "b")) is None
    not_a_library = tmp_path / "libbroken.so"
    not_a_library.write_text("not ELF")
    monkeypatch.setattr(cpu_kernels, "build", lambda directory, march: str(not_a_library))
    with pytest.warns(UserWarning, match="could not load the CPU kernels"):
        assert cpu_kernels._load("not-a-library") is None  # its own cache entry: the real kernels' stays


@pytest.mark.parametrize("rows,half", [(1, 1), (7, 24), (94, 1408)])
def test_swiglu(kernels, rows, half):
    gen = torch.Generator().manual_seed(rows + half)
    x = torch.randn(rows, 2 * half, generator=gen) * 4
    x[0, :2] = torch.tensor([-100.0, 95.0])[: 2 * half]  # beyond exp's clamps: e^-100 is 0, e^95 overflows
    g = torch.randn(rows, 2, half, generator=gen)[:, 1]  # a strided gradient
    x64 = x.double().requires_grad_()
    y64 = F.silu(x64[:, :half]) * x64[:, half:]
    y64.backward(g.double())
    ref_x = x.clone().requires_grad_()
    ref = F.silu(ref_x[:, :half]) * ref_x[:, half:]
    ref.backward(g)
    _close(kernels.swiglu_forward(x), ref.detach(), y64.detach())
    _close(kernels.swiglu_backward(x, g), ref_x.grad, x64.grad)


def test_swiglu_propagates_nan(kernels):
    x = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]])
    assert kernels.swiglu_forward(x)[0, 0].isnan()
    assert kernels.swiglu_backward(x, torch.ones(1, 2))[0, 0].isnan()


@pytest.mark.parametrize("rows,hidden", [(1, 3), (37, 64), (300, 512)])
def test_rms_norm_forward(kernels, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2, hidden, generator=gen)[:, 0] * 3  # strided rows
    w = 1 + 0.1 * torch.randn(hidden, generator=gen)
    out, y, rstd = kernels.rms_norm_forward(x, w, 1e-6)
    ref_y, ref_rstd = torch.ops.aten._fused_rms_norm(x, [hidden], None, 1e-6)
    assert rstd.shape == ref_rstd.shape and y.shape == out.shape == x.shape
    x64 = x.double()
    rstd64 = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    _close(rstd, ref_rstd, rstd64)
    _close(y, ref_y, x64 * rstd64)
    _close(out, w * ref_y, w.double() * x64 * rstd64)


@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)], ids=["both", "dx", "dw"])
@pytest.mark.parametrize("rows,hidden", [(1, 3), (37, 64), (300, 512)])
def test_rms_norm_backward(kernels, rows, hidden, need):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen) * 3
    w = 1 + 0.1 * torch.randn(hidden, generator=gen)
    g = torch.randn(rows, hidden, generator=gen)
    y, rstd = torch.ops.aten._fused_rms_norm(x, [hidden], None, 1e-6)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))).backward(g.double())
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (wr * F.rms_norm(xr, (hidden,), eps=1e-6)).backward(g)
    dx, dw = kernels.rms_norm_backward(g, y, rstd, w, *need)
    assert (dx is not None, dw is not None) == need
    if dx is not None:
        _close(dx, xr.grad, x64.grad)
    if dw is not None:
        _close(dw, wr.grad, (g.double() * y.double()).sum(0), ulps=8)


@pytest.mark.parametrize("sign", [1, -1], ids=["forward", "transpose"])
@pytest.mark.parametrize("rot,dim", [(64, 64), (32, 48)], ids=["full", "partial-rotary"])
def test_rope_bit_identical_to_the_torch_form(kernels, monkeypatch, sign, rot, dim):
    from mindrl.models import fused

    gen = torch.Generator().manual_seed(dim)
    s, b, heads = 11, 3, 4
    qkv = torch.randn(s, b, heads, 3 * dim, generator=gen)
    t = qkv[..., dim : 2 * dim]  # strided, as megatron's query / key views of the fused QKV output
    freqs = torch.randn(s, 1, 1, rot // 2, generator=gen)
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    monkeypatch.setenv("MINDRL_CPU_KERNELS", "0")
    ref = fused._rotate(t, cos, sin, sign=float(sign))
    got = kernels.rope(t, cos, sin, sign)
    assert got is not None and got.is_contiguous()
    assert torch.equal(got, ref)
    assert kernels.rope(t[:, :, :, None], cos, sin, sign) is None  # not the [s, b, heads, dim] layout


def test_kernels_use_torchs_thread_count(kernels):
    x = torch.randn(64, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.swiglu_forward(x)
        torch.set_num_threads(2)
        two = kernels.swiglu_forward(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # rows are independent: the split between threads changes no value


@pytest.mark.parametrize("shared_mask", [True, False], ids=["causal-shared", "per-row-padding"])
@pytest.mark.parametrize("n,per_b,s", [(1, 1, 1), (3, 4, 37), (2, 8, 94)])
def test_masked_softmax(kernels, n, per_b, s, shared_mask):
    """Attention's scale + mask + softmax in place, against torch's masked_fill + softmax (fp64 as the truth); masked
    keys get exactly 0, a row with every key masked NaN (as torch's softmax of -inf)."""
    gen = torch.Generator().manual_seed(n * per_b + s)
    scores = torch.randn(n, per_b, s, s, generator=gen) * 6
    causal = torch.ones(s, s, dtype=torch.bool).triu_(1)
    if shared_mask:
        mask = causal.expand(n, 1, s, s)  # stride 0 over the batch, as gemm_attention's default
    else:
        mask = causal.repeat(n, 1, 1, 1)
        for row in range(n):
            mask[row, 0, :, : row * 5] = True  # left padding
        if s > 1:
            mask[0, 0, 0, :] = True  # a row with nothing to attend to
        mask = mask.view(n, 1, s, s)
    scale = 0.125

    def reference(x):
        return torch.softmax(x.mul(scale).masked_fill(mask, float("-inf")), dim=-1)

    got = kernels.masked_softmax_(scores.clone(), mask, scale)
    assert got is not None
    ref, truth = reference(scores), reference(scores.double())
    finite = ~truth.isnan()
    assert torch.equal(got.isnan(), truth.isnan())
    assert torch.all(got[finite & mask.expand_as(got)] == 0)
    _close(got[finite], ref[finite], truth[finite])
    assert kernels.masked_softmax_(scores.clone(), mask.float(), scale) is None  # not a boolean mask


@pytest.mark.parametrize("rows,s", [(1, 1), (56, 94), (9, 300)])
def test_softmax_backward(kernels, rows, s):
    gen = torch.Generator().manual_seed(rows + s)
    p = torch.softmax(torch.randn(rows, s, generator=gen) * 3, dim=-1)
    dp = torch.randn(rows, s, generator=gen)
    ref = torch._softmax_backward_data(dp, p, -1, p.dtype).mul_(0.125)
    truth = torch._softmax_backward_data(dp.double(), p.double(), -1, torch.float64).mul_(0.125)
    got = kernels.softmax_backward_(p, dp.clone(), 0.125)
    _close(got, ref, truth)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows,v", [(1, 1), (13, 64), (40, 8192)])
def test_softmax_stats_and_grad(kernels, rows, v, temperature):
    """The blocked log-probs' statistics (sum exp(z), sum exp(z) z) and gradient (exp(z - log Z) times a per-row
    factor) on logit rows with a row stride (a column slice, as a TP rank's vocabulary slice of wider logits)."""
    gen = torch.Generator().manual_seed(rows + v)
    wide = torch.randn(rows, v + 3, generator=gen) * 8
    x = wide[:, 1 : v + 1]
    shift = x.amax(dim=-1).div(temperature)
    x64 = x.double()
    t32 = torch.tensor(temperature, dtype=torch.float32).item()  # the temperature both fp32 forms divide by
    z64 = x64 / t32 - shift.double().unsqueeze(1)
    s0, s2 = kernels.softmax_stats(x, shift, temperature, with_entropy=True)
    # sum exp(z): each term carries the rounding of z = x / T - shift (relative to |x / T| and |z|) and of exp; torch's
    # fp32 form rounds z the same way, so "no further from fp64 than torch" is a coin toss at this size (an Intel
    # Xeon's torch came out 2.42e-6 from fp64 where the kernel was 2.46e-6): bounded like s2 below
    err0 = (s0.double() - z64.exp().sum(-1)).abs()
    size0 = (z64.exp() * (1 + z64.abs() + x64.abs() / t32)).sum(-1)
    assert torch.all(err0 <= 4 * torch.finfo(torch.float32).eps * size0), (err0 / size0).max()
    # sum exp(z) z adds terms of both signs: bounded by the terms' sizes, each carrying the rounding of z = x / T - shift
    # (relative to |x / T|) and of exp (relative to 1)
    err = (s2.double() - (z64.exp() * z64).sum(-1)).abs()
    size = (z64.exp() * (1 + z64.abs()) * (1 + x64.abs() / t32)).sum(-1)
    assert torch.all(err <= 4 * torch.finfo(torch.float32).eps * size), (err / size).max()
    only, none = kernels.softmax_stats(x, shift, temperature, with_entropy=False)
    assert none is None and torch.equal(only, s0)
    lse = shift + s0.log()
    ng = torch.randn(rows, generator=gen)
    grad = kernels.softmax_grad(x, lse, ng, temperature)
    assert grad.shape == (rows, v) and grad.is_contiguous()
    ref = (x / temperature - lse.unsqueeze(1)).exp() * ng.unsqueeze(1)
    truth = (x64 / t32 - lse.double().unsqueeze(1)).exp() * ng.double().unsqueeze(1)
    _close(grad, ref, truth)


def _inverse_cdf(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's token by inverse CDF in fp64, from the same fp32 exponentials the kernel sums (so that the two
    differ only in the order of the fp64 sums): the first index whose cumulative mass exceeds u times the total."""
    e = (x - x.amax(-1, keepdim=True)).exp().double()
    c = e.cumsum(-1)
    return torch.searchsorted(c, (u * c[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp(max=x.shape[1] - 1)


@pytest.mark.parametrize("rows,v", [(1, 1), (300, 1000), (64, 8192)])
def test_sample_rows_draws_by_inverse_cdf(kernels, rows, v):
    """The rollout sampler's kernel: each row's token is the inverse CDF of softmax(x) at its uniform (blocks of 64,
    then the tail, as v = 1000 has), the log-softmax as close to fp64 as torch's; a token at -inf (excluded by a
    logits processor) is never drawn, even at the end of the cumulative mass; a row that cannot be sampled is
    named."""
    gen = torch.Generator().manual_seed(rows + v)
    x = torch.randn(rows, v, generator=gen) * 3
    x[:, ::7] = float("-inf")  # excluded tokens, the first and the last among them where v allows
    x[:, 0] = 0.5 if v == 1 else float("-inf")
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    u[0] = 1.0 - 2**-53  # the end of the mass: the last token with mass, never an excluded one after it
    ids, lp = kernels.sample_rows(x, u)
    assert ids.dtype == torch.int64 and lp.shape == x.shape
    ref = _inverse_cdf(x, u)
    assert torch.equal(ids, ref), (ids != ref).nonzero()[:5]
    assert torch.isfinite(x.gather(1, ids.unsqueeze(1))).all()
    finite = x.isfinite()
    _close(lp[finite], torch.log_softmax(x, -1)[finite], torch.log_softmax(x.double(), -1)[finite])
    assert torch.equal(lp.isinf(), x.isinf())
    bad, half = torch.zeros(3, v), torch.full((3,), 0.5, dtype=torch.float64)
    bad[1] = float("-inf")
    with pytest.raises(ValueError, match="cannot sample row 1 of 3: its logits have no finite probability mass"):
        kernels.sample_rows(bad, half)
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match="row 1 of 3.*NaNs 1"):
        kernels.sample_rows(bad, half)


def test_sample_rows_follows_the_distribution(kernels):
    """Drawn with uniform noise, the tokens' frequencies match softmax(x) (a chi-square test at 1e-6), and they
    move with the temperature the caller divided the logits by."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 70, generator=gen) * 2
    draws = 200_000
    for temperature in (1.0, 0.5):
        x = (logits / temperature).expand(draws, -1)
        ids, _ = kernels.sample_rows(x, torch.rand(draws, dtype=torch.float64, generator=gen))
        counts = torch.bincount(ids, minlength=70).double()
        expected = torch.softmax(x[0].double(), -1) * draws
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 150, chi2  # 69 degrees of freedom: P(chi2 > 150) < 1e-6


def test_count_at_least(kernels):
    """A sampled token's rank as vLLM counts it, (x >= value).sum(-1), exactly, on strided rows with ties."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(33, 8200, generator=gen).round(decimals=1)  # ties
    x = wide[:, 3:8195]
    values = x[:, 17:18].clone()
    assert torch.equal(kernels.count_at_least(x, values), (x >= values).sum(-1))
    assert torch.equal(kernels.count_at_least(x, values.squeeze(1)), (x >= values).sum(-1))


@pytest.mark.parametrize(
    "m,n,k",
    [(1, 8192, 64), (7, 100, 33), (64, 1024, 512), (65, 96, 1408), (300, 70, 512), (3, 1, 5)],
    ids=["one-row", "odd", "decode", "long-k", "row-blocks", "one-output"],
)
def test_gemm(kernels, m, n, k):
    """The rollout's GEMM (vllm_ops.PackedLinear): x @ w^T + bias within the bound of a k-term fp32 dot product
    (|error| <= k eps sum |x||w|, plus the bias' rounding) of the fp64 value, for a partial last panel, a tail of
    rows, several row blocks; strided and 3-D inputs; the same values with 1 thread as with 2."""
    gen = torch.Generator().manual_seed(m * 7 + n)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = kernels.gemm_pack(w)
    eps = torch.finfo(torch.float32).eps
    exact = x.double() @ w.double().t()
    bound = (k + 1) * eps * (x.double().abs() @ w.double().abs().t() + b.double().abs())
    for bias in (b, None):
        got = kernels.gemm(x, packed, n, bias)
        truth = exact + (b.double() if bias is not None else 0.0)
        assert got.shape == (m, n) and bool(((got.double() - truth).abs() <= bound).all())
    wide = torch.zeros(m, k + 9)
    wide[:, 4 : 4 + k] = x
    assert torch.equal(kernels.gemm(wide[:, 4 : 4 + k], packed, n, b), kernels.gemm(x, packed, n, b))  # row stride
    assert torch.equal(kernels.gemm(x.reshape(1, m, k), packed, n, b), kernels.gemm(x, packed, n, b).reshape(1, m, n))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.gemm(x, packed, n, b)
        torch.set_num_threads(2)
        two = kernels.gemm(x, packed, n, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is one thread's sum, in one order


def test_gemm_rejects_a_mismatched_weight_or_bias(kernels):
    packed = kernels.gemm_pack(torch.randn(40, 16))
    with pytest.raises(ValueError, match="packed weight of .* is not one of \\[40, 17\\]"):
        kernels.gemm(torch.randn(3, 17), packed, 40)
    with pytest.raises(ValueError, match="bias of 39 floats for 40 outputs"):
        kernels.gemm(torch.randn(3, 16), packed, 40, torch.randn(39))


def test_gemm_without_avx(tmp_path_factory):
    """The GEMM's portable form (GCC vectors, what a CPU without AVX2 + FMA or a non-x86 one compiles), built for
    baseline x86-64: the same bound as the intrinsics' forms."""
    if not HAS_COMPILER:
        pytest.skip("no C compiler")
    path = cpu_kernels.build(str(tmp_path_factory.getbasetemp() / "kernels"), march="x86-64")
    assert path is not None
    kernels = cpu_kernels.Kernels(path)
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(13, 70, generator=gen), torch.randn(37, 70, generator=gen), torch.randn(37, generator=gen)
    got = kernels.gemm(x, kernels.gemm_pack(w), 37, b).double()
    bound = 71 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t() + b.double().abs())
    assert bool(((got - (x.double() @ w.double().t() + b.double())).abs() <= bound).all())


# ---- bf16: the kernels' bf16 forms (bf16 in and out, fp32 inside) against the fp64 values of the same bf16 inputs,
# no further from them than the plain-torch bf16 form (measured here), or within a few fp32 ulps of the largest value.
# Both builds (this CPU's and x86-64-v3, an AVX2-only CPU's) run them: no bf16 instruction is needed.
def _bf16_close(got: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor) -> None:
    assert got.dtype == ref.dtype == torch.bfloat16, (got.dtype, ref.dtype)
    _close(got, ref, truth)
    # and on average too: the mean error is no larger than torch's (one rounding against its several)
    err, ref_err = ((t.double() - truth).abs().mean().item() for t in (got, ref))
    assert err <= ref_err * 1.001 + 1e-30, (err, ref_err)


@pytest.mark.parametrize("rows,half", [(1, 1), (7, 24), (94, 1408)])
def test_swiglu_bf16(kernels, rows, half):
    gen = torch.Generator().manual_seed(rows + half)
    x = (torch.randn(rows, 2 * half, generator=gen) * 4).bfloat16()
    g = torch.randn(rows, 2, half, generator=gen)[:, 1].bfloat16()  # a strided gradient
    x64 = x.double().requires_grad_()
    (F.silu(x64[:, :half]) * x64[:, half:]).backward(g.double())
    ref_x = x.clone().requires_grad_()
    ref = F.silu(ref_x[:, :half]) * ref_x[:, half:]
    ref.backward(g)
    truth = (F.silu(x64[:, :half]) * x64[:, half:]).detach()
    _bf16_close(kernels.swiglu_forward(x), ref.detach(), truth)
    _bf16_close(kernels.swiglu_backward(x, g), ref_x.grad, x64.grad)


def _torch_rms_norm_bf16(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama / Qwen2's RMSNorm in bf16: statistics in fp32, the weight applied in bf16."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("rows,hidden", [(1, 3), (37, 64), (300, 512)])
def test_rms_norm_bf16(kernels, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2, hidden, generator=gen)[:, 0] * 3).bfloat16()  # strided rows
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
    g = torch.randn(rows, hidden, generator=gen).bfloat16()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    rstd64 = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    out64 = w64 * (x64 * rstd64)
    out64.backward(g.double())
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = _torch_rms_norm_bf16(xr, wr, 1e-6)
    ref.backward(g)
    out, rstd = kernels.rms_norm_forward_bf16(x, w, 1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == (rows, 1)
    assert (rstd.double() - rstd64.detach()).abs().max() <= 4 * torch.finfo(torch.float32).eps * rstd64.max()
    _bf16_close(out, ref.detach(), out64.detach())
    for need in [(True, True), (True, False), (False, True)]:
        dx, dw = kernels.rms_norm_backward_bf16(g, x, rstd, w, *need)
        assert (dx is not None, dw is not None) == need
        if dx is not None:
            _bf16_close(dx, xr.grad, x64.grad)
        if dw is not None:  # fp32, the sum over rows: against torch's bf16 weight grad
            assert dw.dtype == torch.float32
            _close(dw, wr.grad, w64.grad)


@pytest.mark.parametrize("sign", [1, -1], ids=["forward", "transpose"])
@pytest.mark.parametrize("rot,dim", [(64, 64), (32, 48)], ids=["full", "partial-rotary"])
def test_rope_bf16(kernels, monkeypatch, sign, rot, dim):
    from mindrl.models import fused

    gen = torch.Generator().manual_seed(dim)
    s, b, heads = 11, 3, 4
    qkv = (torch.randn(s, b, heads, 3 * dim, generator=gen) * 2).bfloat16()
    t = qkv[..., dim : 2 * dim]  # strided, as megatron's query / key views of the fused QKV output
    freqs = torch.randn(s, 1, 1, rot // 2, generator=gen)
    cos, sin = torch.cos(freqs).bfloat16(), torch.sin(freqs).bfloat16()  # as megatron: cast to the activations'
    monkeypatch.setenv("MINDRL_CPU_KERNELS", "0")
    ref = fused._rotate(t, cos, sin, sign=float(sign))
    truth = fused._rotate(t.double(), cos.double(), sin.double(), sign=float(sign))
    got = kernels.rope(t, cos, sin, sign)
    assert got is not None and got.is_contiguous()
    _bf16_close(got, ref, truth)
    assert torch.equal(got[..., rot:], t[..., rot:])  # pass-through channels exactly


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows,v", [(1, 1), (13, 64), (40, 8192)])
def test_softmax_stats_and_grad_bf16(kernels, rows, v, temperature):
    """bf16 logit rows: each value widens exactly to fp32, so the statistics are the fp32 kernel's on the widened
    rows (the double sums in another order: within an fp32 ulp) and the gradient is the fp32 one rounded to bf16,
    which is torch's bf16 form (fp32 scratch, then a copy into the bf16 gradient)."""
    gen = torch.Generator().manual_seed(rows + v)
    x = (torch.randn(rows, v + 3, generator=gen) * 8).bfloat16()[:, 1 : v + 1]
    x32 = x.float()
    shift = x32.amax(dim=-1).div(temperature)
    s0, s2 = kernels.softmax_stats(x, shift, temperature, with_entropy=True)
    r0, r2 = kernels.softmax_stats(x32, shift, temperature, with_entropy=True)
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(s0, r0, rtol=2 * eps, atol=0) and torch.allclose(s2, r2, rtol=2 * eps, atol=2 * eps)
    lse = shift + s0.log()
    ng = torch.randn(rows, generator=gen)
    grad = kernels.softmax_grad(x, lse, ng, temperature)
    assert grad.dtype == torch.bfloat16 and grad.shape == (rows, v)
    assert torch.equal(grad, kernels.softmax_grad(x32, lse, ng, temperature).bfloat16())
    truth = (x.double() / temperature - lse.double().unsqueeze(1)).exp() * ng.double().unsqueeze(1)
    ref = ((x32 / temperature - lse.unsqueeze(1)).exp() * ng.unsqueeze(1)).bfloat16()
    _bf16_close(grad, ref, truth)


def test_bf16_kernels_need_no_bf16_instructions(tmp_path_factory):
    """The x86-64-v3 build (what an AVX2-only CPU compiles) holds no AVX-512 instruction, bf16 ones included: its bf16
    forms are integer widening and rounding in AVX2 registers."""
    objdump = shutil.which("objdump")
    if not HAS_COMPILER or objdump is None or "x86-64-v3" not in _marches():
        pytest.skip("needs a compiler, objdump and an x86-64 CPU with AVX2")
    import subprocess

    path = cpu_kernels.build(str(tmp_path_factory.getbasetemp() / "kernels"), march="x86-64-v3")
    text = subprocess.run([objdump, "-d", path], capture_output=True, text=True, check=True).stdout
    assert "mindrl_rms_norm_fwd_bf16" in text
    assert "zmm" not in text and "bf16" not in text.replace("_bf16", ""), "AVX-512 or bf16 instructions in AVX2 build"
