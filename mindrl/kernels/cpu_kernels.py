"""mindrl's C kernels for work on a CPU (sources in cpu_kernels.c): one-pass elementwise ops for training (fp32, and
bf16 in and out with fp32 arithmetic), the rollout's sampling step and GEMM (fp32); built once per machine and source,
loaded by `load()`."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform as _platform
import subprocess
import warnings

import torch

from mindrl.kernels.native_build import c_compiler, cache_dir, compile_library, failure_detail, read_source
from mindrl.platform import env_switch, in_host_memory

ENV = "MINDRL_CPU_KERNELS"
MARCH_ENV = "MINDRL_CPU_KERNELS_MARCH"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
# -z defs: a compiler whose OpenMP calls another runtime (clang's __kmpc_*) fails to link, instead of at load
LINK = ("-lm", "-Wl,-z,defs")

SOURCE_FILE = "cpu_kernels.c"

_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "mindrl_swiglu_fwd": ([_P, _P, _I, _I, _INT], None),
    "mindrl_swiglu_bwd": ([_P, _P, _P, _I, _I, _INT], None),
    "mindrl_rms_norm_fwd": ([_P, _P, _P, _P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_rms_norm_bwd": ([_P, _P, _P, _P, _P, _P, _I, _I, _INT], _INT),
    "mindrl_rope": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _INT, _INT], None),
    "mindrl_masked_softmax_fwd": ([_P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_softmax_bwd": ([_P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_softmax_stats": ([_P, _I, _P, _P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_softmax_grad": ([_P, _I, _P, _P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_sample_rows": ([_P, _P, _P, _P, _I, _I, _INT], None),
    "mindrl_count_at_least": ([_P, _I, _P, _P, _I, _I, _INT], None),
    "mindrl_swiglu_fwd_bf16": ([_P, _P, _I, _I, _INT], None),
    "mindrl_swiglu_bwd_bf16": ([_P, _P, _P, _I, _I, _INT], None),
    "mindrl_rms_norm_fwd_bf16": ([_P, _P, _P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_rms_norm_bwd_bf16": ([_P, _P, _P, _P, _P, _P, _I, _I, _INT], _INT),
    "mindrl_rope_bf16": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _INT, _INT], None),
    "mindrl_softmax_stats_bf16": ([_P, _I, _P, _P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_softmax_grad_bf16": ([_P, _I, _P, _P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_gemm_panel": ([], _INT),
    "mindrl_gemm_pack": ([_P, _P, _I, _I, _INT], None),
    "mindrl_gemm": ([_P, _I, _P, _P, _P, _I, _I, _I, _I, _INT], None),
}


def enabled() -> bool:
    """Whether the kernels may be used (MINDRL_CPU_KERNELS, `env_switch`)."""
    return env_switch(ENV)


def torch_openmp_runtime() -> str | None:
    """The path of the OpenMP runtime (libgomp) this process loaded for torch, None where torch has none."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return None
    own = [p for p in paths if p.startswith(os.path.dirname(torch.__file__))]
    found = own or sorted(paths)
    return found[0] if found else None


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    keep = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    keep.append(line.strip())
                if len(keep) == 2:
                    break
    except OSError:
        pass
    return "\n".join(keep) or _platform.processor()


def build(directory: str, march: str = "native") -> str | None:
    """The kernels' shared library in `directory`, compiled there unless this source, flags, compiler and CPU have
    one already (the name carries their hash, so a cache shared by other machines never runs another CPU's build);
    None (with a warning) where there is no compiler, no OpenMP runtime in torch, or the build fails. It links
    against the OpenMP runtime torch loaded, so the kernels use torch's thread pool and thread count. `march` other
    than "native" (e.g. "x86-64-v3", AVX2) builds for that target, for tests."""
    gomp = torch_openmp_runtime()
    compiler = c_compiler()
    if gomp is None or compiler is None:
        why = "torch has no OpenMP runtime loaded" if gomp is None else "no C compiler ($CC, cc or gcc)"
        warnings.warn(f"mindrl: CPU kernels not built ({why}): the torch-op forms run instead", stacklevel=2)
        return None
    flags = [f if f != "-march=native" else f"-march={march}" for f in FLAGS]
    source = read_source(SOURCE_FILE)
    key = hashlib.sha256("\n".join([source, *flags, *LINK, os.path.realpath(compiler), gomp, _cpu_identity()]).encode())
    path = os.path.join(directory, f"libmindrl_cpu_kernels_{key.hexdigest()[:16]}.so")
    if os.path.isfile(path):
        return path
    try:
        compile_library(compiler, source, path, flags, [gomp, *LINK, f"-Wl,-rpath,{os.path.dirname(gomp)}"])
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(
            f"mindrl: could not build the CPU kernels into {path} with {compiler}: {e} {failure_detail(e)}; the "
            f"torch-op forms run instead ({ENV}=0 silences this)",
            stacklevel=2,
        )
        return None
    return path


class Kernels:
    """The loaded library, with torch-level calls. Each takes fp32 host tensors (see `takes`); SwiGLU, RMSNorm, RoPE
    and the softmax statistics and gradient also take bf16 ones (`takes(..., bf16=True)`), with the same outputs in
    bf16 computed in fp32 and rounded once."""

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self._lib = lib
        self._panel = lib.mindrl_gemm_panel()  # the GEMM's packed panel width (outputs), fixed by the build

    @staticmethod
    def takes(*tensors: torch.Tensor, bf16: bool = False) -> bool:
        """Whether the kernels cover these tensors: in host memory, all fp32, or (for a call with a bf16 form, `bf16`)
        all bf16."""
        dtypes = {t.dtype for t in tensors}
        ok = dtypes == {torch.float32} or (bf16 and dtypes == {torch.bfloat16})
        return ok and in_host_memory(*tensors)

    def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
        """silu(a) * b for x = [a, b] on the last dimension."""
        x = x.contiguous()
        half = x.shape[-1] // 2
        out = torch.empty(x.shape[:-1] + (half,), dtype=x.dtype)
        fn = self._lib.mindrl_swiglu_fwd_bf16 if _bf16(x) else self._lib.mindrl_swiglu_fwd
        fn(x.data_ptr(), out.data_ptr(), x.numel() // max(1, 2 * half), half, _threads())
        return out

    def swiglu_backward(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of swiglu_forward at x, for the output's gradient `grad`."""
        x, grad = x.contiguous(), grad.contiguous()
        half = x.shape[-1] // 2
        dx = torch.empty(x.shape, dtype=x.dtype)
        rows = x.numel() // max(1, 2 * half)
        fn = self._lib.mindrl_swiglu_bwd_bf16 if _bf16(x) else self._lib.mindrl_swiglu_bwd
        fn(x.data_ptr(), grad.data_ptr(), dx.data_ptr(), rows, half, _threads())
        return dx

    def rms_norm_forward(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight * y, y, rstd) with y = x * rstd, rstd = 1 / sqrt(mean(x^2, last dim) + eps) of shape [..., 1]
        (what torch's `_fused_rms_norm` returns, the sum of squares in another order)."""
        x, weight = x.contiguous(), weight.contiguous()
        hidden = x.shape[-1]
        y, out = torch.empty(x.shape, dtype=torch.float32), torch.empty(x.shape, dtype=torch.float32)
        rstd = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32)
        self._lib.mindrl_rms_norm_fwd(
            x.data_ptr(), weight.data_ptr(), y.data_ptr(), out.data_ptr(), rstd.data_ptr(),
            x.numel() // max(1, hidden), hidden, eps, _threads(),
        )  # fmt: skip
        return out, y, rstd

    def rms_norm_backward(
        self,
        grad: torch.Tensor,
        y: torch.Tensor,
        rstd: torch.Tensor,
        weight: torch.Tensor,
        need_dx: bool,
        need_dw: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(dx, dw) of out = weight * y, y = x * rstd (rows of y's last dimension); None where not needed."""
        grad, y, rstd, weight = grad.contiguous(), y.contiguous(), rstd.contiguous(), weight.contiguous()
        hidden = y.shape[-1]
        dx = torch.empty(y.shape, dtype=torch.float32) if need_dx else None
        dw = torch.empty(hidden, dtype=torch.float32) if need_dw else None
        status = self._lib.mindrl_rms_norm_bwd(
            grad.data_ptr(), y.data_ptr(), rstd.data_ptr(), weight.data_ptr(),
            dx.data_ptr() if dx is not None else None, dw.data_ptr() if dw is not None else None,
            y.numel() // max(1, hidden), hidden, _threads(),
        )  # fmt: skip
        if status:
            raise MemoryError(f"mindrl_rms_norm_bwd could not allocate {_threads()} x {hidden} floats")
        return dx, dw

    def rms_norm_forward_bf16(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * x * rstd in bf16, rstd [..., 1] fp32) for bf16 x and weight: statistics and products in fp32,
        the output rounded once. Backward (`rms_norm_backward_bf16`) takes x itself, not an fp32 copy of y."""
        x, weight = x.contiguous(), weight.contiguous()
        hidden = x.shape[-1]
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        rstd = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32)
        self._lib.mindrl_rms_norm_fwd_bf16(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), rstd.data_ptr(), x.numel() // max(1, hidden), hidden,
            eps, _threads(),
        )  # fmt: skip
        return out, rstd

    def rms_norm_backward_bf16(
        self,
        grad: torch.Tensor,
        x: torch.Tensor,
        rstd: torch.Tensor,
        weight: torch.Tensor,
        need_dx: bool,
        need_dw: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(dx bf16, dw fp32) of `rms_norm_forward_bf16` at x for the output's gradient (bf16); None where not
        needed."""
        grad, x, rstd, weight = grad.contiguous(), x.contiguous(), rstd.contiguous(), weight.contiguous()
        hidden = x.shape[-1]
        dx = torch.empty(x.shape, dtype=torch.bfloat16) if need_dx else None
        dw = torch.empty(hidden, dtype=torch.float32) if need_dw else None
        status = self._lib.mindrl_rms_norm_bwd_bf16(
            grad.data_ptr(), x.data_ptr(), rstd.data_ptr(), weight.data_ptr(),
            dx.data_ptr() if dx is not None else None, dw.data_ptr() if dw is not None else None,
            x.numel() // max(1, hidden), hidden, _threads(),
        )  # fmt: skip
        if status:
            raise MemoryError(f"mindrl_rms_norm_bwd_bf16 could not allocate {_threads()} x {hidden} floats")
        return dx, dw

    def rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor | None:
        """RoPE (sign 1) or its transpose (sign -1) of t [s, b, heads, dim] with cos / sin [s, 1, 1, half] (see
        `mindrl.models.fused._rotate`); None where the shapes are not that layout (the caller's form runs)."""
        if t.dim() != 4 or t.stride(-1) != 1 or cos.dim() != 4:
            return None
        s, b, heads, dim = t.shape
        half = cos.shape[-1]
        if cos.shape != (s, 1, 1, half) or sin.shape != cos.shape or 2 * half > dim:
            return None
        cos, sin = cos.reshape(s, half).contiguous(), sin.reshape(s, half).contiguous()
        out = torch.empty(t.shape, dtype=t.dtype)
        fn = self._lib.mindrl_rope
        if _bf16(t):  # cos / sin as given (bf16 values), widened: the products and sums in fp32
            cos, sin, fn = cos.float(), sin.float(), self._lib.mindrl_rope_bf16
        fn(
            t.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), s, b, heads, dim, half,
            t.stride(0), t.stride(1), t.stride(2), 1 if sign > 0 else -1, _threads(),
        )  # fmt: skip
        return out

    def masked_softmax_(self, scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor | None:
        """In place: scores [n, rows_per_b, sq, s] (contiguous) become softmax(scale * scores) over the last
        dimension with the keys where mask [n, 1, sq, s] (bool, True = masked; a stride-0 batch dimension allowed)
        is set excluded; a row with every key masked becomes NaN, as torch's softmax of -inf. None where the layouts
        are not these (the caller's torch ops run)."""
        n, per_b, sq, s = scores.shape
        ok = scores.is_contiguous() and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape == (n, 1, sq, s)
        if not ok or (sq > 1 and mask.stride(2) != s) or (s > 1 and mask.stride(3) != 1):
            return None
        self._lib.mindrl_masked_softmax_fwd(
            scores.data_ptr(), mask.data_ptr(), n, per_b, sq, s, mask.stride(0) if n > 1 else 0, scale, _threads()
        )
        return scores

    def softmax_backward_(self, probs: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
        """In place: grad (the probabilities' gradient) becomes the scores' gradient, probs * (grad - sum(grad *
        probs)) * scale over the last dimension. Both contiguous, the same shape."""
        probs, s = probs.contiguous(), probs.shape[-1]
        assert grad.is_contiguous() and grad.shape == probs.shape
        self._lib.mindrl_softmax_bwd(probs.data_ptr(), grad.data_ptr(), probs.numel() // max(1, s), s, scale,
                                     _threads())  # fmt: skip
        return grad

    def softmax_stats(
        self, x: torch.Tensor, shift: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sum exp(z), sum exp(z) z or None) per row of x [rows, v] (fp32, last dimension contiguous), z = x /
        temperature - shift (one value per row), in one read of x."""
        rows, v = x.shape
        shift = shift.contiguous()
        s0 = torch.empty(rows, dtype=torch.float32)
        s2 = torch.empty(rows, dtype=torch.float32) if with_entropy else None
        fn = self._lib.mindrl_softmax_stats_bf16 if _bf16(x) else self._lib.mindrl_softmax_stats
        fn(
            x.data_ptr(), x.stride(0), shift.data_ptr(), s0.data_ptr(), s2.data_ptr() if s2 is not None else None,
            rows, v, temperature, _threads(),
        )  # fmt: skip
        return s0, s2

    def softmax_grad(
        self, x: torch.Tensor, lse: torch.Tensor, neg_grad: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """exp(x / temperature - lse) * neg_grad (lse, neg_grad: one value per row) for x [rows, v] (fp32, last
        dimension contiguous): the log-probabilities' gradient before the label's term, one read and one write."""
        rows, v = x.shape
        lse, neg_grad = lse.contiguous(), neg_grad.contiguous()
        grad = torch.empty(rows, v, dtype=x.dtype)
        fn = self._lib.mindrl_softmax_grad_bf16 if _bf16(x) else self._lib.mindrl_softmax_grad
        fn(
            x.data_ptr(), x.stride(0), lse.data_ptr(), neg_grad.data_ptr(), grad.data_ptr(), rows, v, temperature,
            _threads(),
        )  # fmt: skip
        return grad

    def sample_rows(self, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [rows] int64, log_softmax(logits)) for logit rows [rows, v] (fp32; -inf excludes a token) and one
        uniform in [0, 1) per row (fp64): each row's token drawn by inverse CDF from softmax(logits). A row with no
        finite positive probability mass (a NaN, or every entry -inf) raises ValueError naming it."""
        logits, uniforms = logits.contiguous(), uniforms.to(torch.float64).contiguous()
        rows, v = logits.shape
        assert uniforms.shape == (rows,), (uniforms.shape, rows)
        ids = torch.empty(rows, dtype=torch.int64)
        logprobs = torch.empty(rows, v, dtype=torch.float32)
        self._lib.mindrl_sample_rows(
            logits.data_ptr(), uniforms.data_ptr(), logprobs.data_ptr(), ids.data_ptr(), rows, v, _threads()
        )
        bad = (ids < 0).nonzero()
        if len(bad):
            r = int(bad[0])
            raise ValueError(
                f"cannot sample row {r} of {rows}: its logits have no finite probability mass (NaN or every token "
                f"excluded; max {logits[r].max().item()}, NaNs {int(logits[r].isnan().sum())})"
            )
        return ids, logprobs

    def count_at_least(self, x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(x >= values).sum(-1) for x [rows, v] (fp32, last dimension contiguous) and values [rows, 1] or [rows],
        int64, in one read of x without a boolean tensor."""
        rows, v = x.shape
        values = values.reshape(rows).to(torch.float32).contiguous()
        counts = torch.empty(rows, dtype=torch.int64)
        self._lib.mindrl_count_at_least(
            x.data_ptr(), x.stride(0), values.data_ptr(), counts.data_ptr(), rows, v, _threads()
        )
        return counts

    def gemm_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A linear layer's weight [n, k] (fp32) in the layout `gemm` reads: panels of the build's width of outputs,
        k steps of them each (zero past n), 64-byte aligned. A copy: later changes to the weight are not seen."""
        n, k = weight.shape
        weight = weight.contiguous()
        nr = self._panel
        packed = torch.empty((n + nr - 1) // nr * nr * k, dtype=torch.float32)
        if packed.data_ptr() % 64:  # torch's host allocations are 64-byte aligned; the kernel's panel loads rely on it
            raise RuntimeError(
                f"gemm_pack: a {packed.numel()}-float buffer at {packed.data_ptr():#x} is not 64-byte aligned"
            )
        self._lib.mindrl_gemm_pack(weight.data_ptr(), packed.data_ptr(), n, k, _threads())
        return packed

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., k] @ w^T + bias -> [..., n] (fp32) for w [n, k] packed by `gemm_pack` (so `packed` holds ceil(n /
        panel) * panel * k floats) and bias [n] or None."""
        k = x.shape[-1]
        rows = x.reshape(-1, k) if x.dim() != 2 else x
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
            rows = rows.contiguous()
        nr = self._panel
        if packed.numel() != (n + nr - 1) // nr * nr * k:
            raise ValueError(
                f"gemm: packed weight of {packed.numel()} floats is not one of [{n}, {k}] ({nr}-wide panels)"
            )
        if bias is not None:
            bias = bias.contiguous()
            if bias.numel() != n:
                raise ValueError(f"gemm: bias of {bias.numel()} floats for {n} outputs")
        m = rows.shape[0]
        out = torch.empty(m, n, dtype=torch.float32)
        self._lib.mindrl_gemm(
            rows.data_ptr(), rows.stride(0) if m > 1 else k, packed.data_ptr(),
            bias.data_ptr() if bias is not None else None, out.data_ptr(), n, m, n, k, _threads(),
        )  # fmt: skip
        return out.reshape(*x.shape[:-1], n)


def _bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16


def _threads() -> int:
    return max(1, torch.get_num_threads())


@functools.cache
def _load(march: str) -> Kernels | None:
    path = build(cache_dir(), march)
    if path is None:
        return None
    try:
        return Kernels(path)
    except (OSError, AttributeError) as e:  # a library this process cannot load, or one without every kernel
        warnings.warn(
            f"mindrl: could not load the CPU kernels {path}: {e}; the torch-op forms run instead", stacklevel=2
        )
        return None


def load(march: str | None = None) -> Kernels | None:
    """This process's kernels (built on first use), or None where they are off or cannot be built. They are built for
    `march`, else MINDRL_CPU_KERNELS_MARCH, else this CPU ("native"); e.g. x86-64-v3 gives the build of an AVX2-only
    CPU, to run this host as one."""
    if not enabled():
        return None
    return _load(march or os.environ.get(MARCH_ENV, "").strip() or "native")
