"""mindrl's kernels in a CPU rollout engine (vLLM): vLLM's own C norms registered first, and mindrl's GEMM, SwiGLU
and sampling step in place of vLLM's; `mindrl.kernels.KernelSet` says which are on."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

PROVIDER = "mindrl_c"
OPS = ("rms_norm", "fused_add_rms_norm")


def _weighted(x: torch.Tensor, weight: torch.Tensor | None, variance_size: int | None) -> bool:
    return variance_size is None and weight is not None and weight.dtype == x.dtype and x.is_contiguous()


def _supports_norm(x, weight, epsilon, variance_size=None) -> bool:
    return _weighted(x, weight, variance_size)


def _supports_add_norm(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return _weighted(x, weight, variance_size) and x_residual.is_contiguous() and x_residual.dtype == x.dtype


def c_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def c_fused_add_rms_norm(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as vLLM's own kernel provider: x becomes the normalised sum, x_residual the sum."""
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def c_norm_priority() -> dict[str, list[str]]:
    """Register vLLM's own C RMSNorm kernels as a provider, `mindrl_c` (once per process), and return the
    `ir_op_priority` that puts it first ({} where this vLLM has no IR ops or its `_C` library lacks the kernels: the
    engine then runs vLLM's default). vLLM 0.32 routes RMSNorm through its IR ops, each with a priority list of
    providers; on CPU that list is the torch-op form alone, which an eager engine runs op by op. The provider takes
    what the kernels compute right (a weight of the input's dtype, no variance-size override, contiguous tensors: on
    a strided view the kernel reads the wrong elements); anything else falls through to vLLM's torch-op form, which
    vLLM appends after it."""
    try:
        from vllm import ir
        from vllm.platforms import current_platform
    except ImportError:
        return {}
    current_platform.import_kernels()
    ops = [getattr(ir.ops, name, None) for name in OPS]
    if any(op is None for op in ops) or not all(hasattr(torch.ops._C, name) for name in OPS):
        return {}
    norm, add_norm = ops
    if PROVIDER not in norm.impls:
        norm.register_impl(PROVIDER, supports_args=_supports_norm)(c_rms_norm)
    if PROVIDER not in add_norm.impls:
        add_norm.register_impl(PROVIDER, supports_args=_supports_add_norm, inplace=True)(c_fused_add_rms_norm)
    return {name: [PROVIDER] for name in OPS}


GEMM_RANGE = "mindrl_c::gemm"
"""The profiler range around each `PackedLinear` call (a C call, which the profiler does not see as an op)."""


class PackedLinear:
    """A linear layer's `cpu_linear` (what vLLM-CPU's linear and LM-head methods call as `cpu_linear(x, weight,
    bias)`) on an eager CPU engine: mindrl's GEMM (`Kernels.gemm`) on the layer's fp32 weight, packed when vLLM
    processes the loaded weights (at the engine's start and at every weight reload), in place of vLLM-CPU's oneDNN
    handle. Like that handle it holds a packed copy, and the layer's own weight is emptied where vLLM empties it."""

    def __init__(self, kernels, weight: torch.Tensor) -> None:
        self.kernels = kernels
        self.n, self.k = weight.shape
        self.packed = kernels.gemm_pack(weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ok = self.kernels.takes(x) and x.shape[-1] == self.k
        if not ok or (bias is not None and not self.kernels.takes(bias)):
            raise TypeError(
                f"mindrl's packed linear [{self.n}, {self.k}] (fp32, host) got input {tuple(x.shape)} {x.dtype} on "
                f"{x.device}{'' if bias is None else f' and a {bias.dtype} bias'}"
            )
        if torch.autograd._profiler_enabled():  # a named range, so that a profile counts it among the GEMMs
            with torch.profiler.record_function(GEMM_RANGE):
                return self.kernels.gemm(x, self.packed, self.n, bias)
        return self.kernels.gemm(x, self.packed, self.n, bias)


_BUILDING: contextvars.ContextVar = contextvars.ContextVar("mindrl_c_linear_kernels", default=None)


def _dispatch_linear(original, layer: torch.nn.Module, remove_weight: bool) -> None:
    """vLLM's `dispatch_cpu_unquantized_gemm`, which sets `layer.cpu_linear` after a weight load: `PackedLinear` for
    a 2-D fp32 host weight of an engine built within `c_linears` (a reload finds its layer's PackedLinear and packs
    the new weight with the same kernels); vLLM's own dispatch for everything else."""
    previous = getattr(layer, "cpu_linear", None)
    kernels = previous.kernels if isinstance(previous, PackedLinear) else _BUILDING.get()
    weight = getattr(layer, "weight", None)
    covered = (
        kernels is not None and isinstance(weight, torch.Tensor) and not weight.is_meta and weight.dim() == 2
        and kernels.takes(weight)
    )  # fmt: skip
    if not covered:
        return original(layer, remove_weight)
    layer.cpu_linear = PackedLinear(kernels, weight.detach())
    if remove_weight:  # as vLLM's dispatch: the packed copy is what the layer computes with
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
    return None


@contextlib.contextmanager
def c_linears(kernels):
    """Within: the vLLM engines built in this thread (in-process workers) compute their fp32 linear layers with
    `kernels`' GEMM (`PackedLinear`), now and at every later weight reload. Puts the dispatch hook in vLLM's layer
    utilities once per process; layers built outside keep vLLM's dispatch. Count the layers with
    `count_c_linears`."""
    import vllm.model_executor.layers.utils as utils

    if not isinstance(utils.dispatch_cpu_unquantized_gemm, functools.partial):
        utils.dispatch_cpu_unquantized_gemm = functools.partial(_dispatch_linear, utils.dispatch_cpu_unquantized_gemm)
    token = _BUILDING.set(kernels)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def _per_model(llm, fn) -> int:
    """fn(model) on every worker's model of `llm` (a `vllm.LLM`, through `collective_rpc`): the smallest of the
    counts it returns (0 where a worker has no model runner of that form)."""

    def call(worker) -> int:
        model = getattr(getattr(worker, "model_runner", None), "model", None)
        return 0 if model is None else fn(model)

    return min(llm.collective_rpc(call))


def repack_moe_experts(llm) -> int:
    """Pack every MoE layer's experts again for vLLM's kernel after a reload_weights (which packs them at the first
    load only, and on a reload copies the new, unpacked weights over the packed ones: the layer then computes with
    garbage). Returns the MoE layers repacked on each worker (the smallest count)."""

    def repack(model) -> int:
        n = 0
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(experts, "process_weights_after_loading"):
                experts.process_weights_after_loading(module)
                n += 1
        return n

    return _per_model(llm, repack)


def regrow_released_mla_weights(llm) -> int:
    """Give back every MLA layer's up-projection (kv_b_proj) a weight of its loaded shape where vLLM released it
    (vLLM-CPU's AMX MLA packs W_UK / W_UV from it at load, then leaves a 0-element weight): an in-place reload_weights
    copies each layer's new weights into the tensors the layer holds, and refuses one of another shape. The MLA
    layer packs the new weight and releases it again when the reload finishes. Returns the layers regrown on each
    worker (the smallest count)."""

    def regrow(model) -> int:
        n = 0
        for module in model.modules():
            proj = getattr(module, "kv_b_proj", None) if hasattr(module, "kv_lora_rank") else None
            weight = getattr(proj, "weight", None)
            if weight is None or weight.numel() or not hasattr(module, "v_head_dim"):
                continue
            rows = module.num_heads * (module.qk_nope_head_dim + module.v_head_dim)  # this TP rank's heads
            proj.weight = torch.nn.Parameter(
                torch.empty(rows, module.kv_lora_rank, dtype=proj.params_dtype), requires_grad=False
            )
            n += 1
        return n

    return _per_model(llm, regrow)


def count_c_linears(llm) -> int:
    """How many linear layers of `llm`'s model run `PackedLinear` (the smallest count over its workers)."""
    return _per_model(llm, lambda model: sum(isinstance(getattr(m, "cpu_linear", None), PackedLinear)
                                             for m in model.modules()))  # fmt: skip


class CSwiGLU:
    """vLLM's `SiluAndMul` forward (silu(x[..., :d]) * x[..., d:]) on an eager CPU engine: one pass over x
    (`Kernels.swiglu_forward`, the kernel the actor's fp32 training runs on CPU), where vLLM-CPU 0.32 runs torch's silu
    into a fresh tensor, then the product into another. Tensors other than contiguous fp32 host ones go to vLLM's own
    forward."""

    def __init__(self, native, kernels) -> None:
        self._vllm = native
        self._kernels = kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels.takes(x) and x.is_contiguous() and x.shape[-1] % 2 == 0:
            return self._kernels.swiglu_forward(x)
        return self._vllm(x)


def install_c_swiglu(llm, kernels) -> int:
    """Put `CSwiGLU` in place of the forward of every `SiluAndMul` (that class exactly: its subclasses compute other
    things) of every worker's model of `llm` (a `vllm.LLM`, eager: a compiled engine traces vLLM's form). Returns
    how many modules run it (the smallest count over the workers; 0: this vLLM has no such module or attribute)."""

    def install(model) -> int:
        from vllm.model_executor.layers.activation import SiluAndMul

        count = 0
        for module in model.modules():
            if type(module) is SiluAndMul and hasattr(module, "_forward_method"):
                if not isinstance(module._forward_method, CSwiGLU):
                    module._forward_method = CSwiGLU(module._forward_method, kernels)
                count += 1
        return count

    return _per_model(llm, install)


SAMPLER = "mindrl_c"


class InverseCdfSampling:
    """vLLM's random sampling step (`TopKTopPSampler.forward` of one engine) for the requests mindrl sends: no top-k,
    no top-p, fp32 logits already divided by the temperature (and filtered by vLLM's logits processors: min-p,
    allowed tokens, bad words, which set excluded tokens to -inf). One kernel per step (`Kernels.sample_rows`)
    draws each row's token by inverse CDF from softmax(logits) with one uniform per row and writes the log-softmax
    that `processed_logprobs` returns. vLLM-CPU's own step writes the log-softmax (one pass), then draws Gumbel noise
    for every vocabulary entry (SplitMix64 and two logs each) for its arg-max: the same distribution.

    A seeded request draws its uniform from the request's own generator (as vLLM draws its noise seed), an unseeded
    one from the global RNG, so a seed gives the same tokens run to run and on every TP peer; the tokens are not the
    ones vLLM's Gumbel noise picks for that seed. Everything else (top-k or top-p set, fp64 Gumbel noise,
    `processed_logits`, a non-fp32 or device tensor) goes to vLLM's own forward."""

    def __init__(self, sampler, kernels) -> None:
        self._vllm = sampler.forward
        self._mode = sampler.logprobs_mode
        self._fp64 = bool(getattr(sampler, "use_fp64_gumbel", False))
        self._kernels = kernels

    def __call__(self, logits: torch.Tensor, generators: dict, k, p):
        covered = (
            k is None and p is None and not self._fp64 and self._mode != "processed_logits"
            and self._kernels.takes(logits) and logits.dim() == 2
        )  # fmt: skip
        if not covered:
            return self._vllm(logits, generators, k, p)
        uniforms = torch.rand(logits.shape[0], dtype=torch.float64)
        if generators:  # one index-put for the seeded rows (a Python loop of scalar writes costs twice as much)
            seeded = [torch.rand(1, dtype=torch.float64, generator=g).item() for g in generators.values()]
            uniforms[list(generators)] = torch.tensor(seeded, dtype=torch.float64)
        ids, logprobs = self._kernels.sample_rows(logits, uniforms)
        return ids, (logprobs if self._mode == "processed_logprobs" else None)


def _count_at_least(original, kernels, x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's `batched_count_greater_than` ((x >= values).sum(-1), a sampled token's rank) in one read of x, for
    fp32 host rows; vLLM's own function otherwise."""
    if kernels.takes(x) and x.dim() == 2 and x.stride(-1) == 1:
        return kernels.count_at_least(x, values)
    return original(x, values)


def install_c_sampler(llm, kernels) -> str:
    """Put `InverseCdfSampling` in place of the random sampling step of every worker of `llm` (a `vllm.LLM`), and
    the rank count in vLLM's sampler module (for the process: the same counts). Returns the sampler's name,
    SAMPLER, or "vllm" where this vLLM's model runner has no sampler of that form (nothing changed)."""
    import vllm.v1.sample.sampler as sampler_module

    def install(worker) -> bool:
        sampler = getattr(getattr(getattr(worker, "model_runner", None), "sampler", None), "topk_topp_sampler", None)
        if sampler is None or not hasattr(sampler, "logprobs_mode"):
            return False
        if not isinstance(sampler.forward, InverseCdfSampling):
            sampler.forward = InverseCdfSampling(sampler, kernels)
        return True

    if not all(llm.collective_rpc(install)):
        return "vllm"
    count = sampler_module.batched_count_greater_than
    if not isinstance(count, functools.partial):
        sampler_module.batched_count_greater_than = functools.partial(_count_at_least, count, kernels)
    return SAMPLER
