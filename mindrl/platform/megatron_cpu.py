"""Megatron-core on a CPU host: its modules see a `torch` whose `cuda` namespace and device="cuda" mean the CPU, plus
the RNG tracker, `Tensor.cuda()`, the optimizer's type checks and the weight-gradient slot adapted to it."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import sys
import types

import torch

# megatron modules imported up front so that their `torch` global can be swapped before use.
_MEGATRON_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.backends",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
)


_CPU = torch.device("cpu")
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
    "randperm", "eye", "linspace", "empty_strided", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like",
)  # fmt: skip


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # no pinned-memory allocator without an accelerator (CP's rotary chunk index)
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return factory


class _NoopEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NoopStream(_NoopEvent):
    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoopEvent()


class _CudaOnCpu(types.ModuleType):
    """`torch.cuda` as megatron sees it on a CPU host: one device, the CPU, and the CPU generator."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.Event = _NoopEvent
        self.Stream = _NoopStream
        self.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def synchronize(*args, **kwargs):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def current_stream(*args, **kwargs):
        return _NoopStream()

    default_stream = current_stream

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()

    @staticmethod
    def set_stream(*args, **kwargs):
        pass

    @staticmethod
    def is_current_stream_capturing():
        return False

    @staticmethod
    def memory_allocated(*args, **kwargs):
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def memory_stats(*args, **kwargs):
        return {}

    @staticmethod
    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *args, **kwargs):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


class _TorchOnCpu(types.ModuleType):
    """The `torch` module as megatron sees it on a CPU host; everything not overridden is real torch."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups skip __getattr__
        return value


_TORCH_PROXY: _TorchOnCpu | None = None


def _patch_module(mod: types.ModuleType) -> None:
    if getattr(mod, "torch", None) is torch:
        mod.torch = _TORCH_PROXY


class _PatchMegatronOnImport(importlib.abc.MetaPathFinder):
    """Gives megatron.core modules imported after apply() the proxy too."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("megatron.core"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                original = spec.loader.exec_module

                def exec_module(module, _original=original):
                    _original(module)
                    _patch_module(module)

                spec.loader.exec_module = exec_module
                return spec
            if spec is not None:
                return spec
        return None


def _cpu_get_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, *args, **kwargs):
    torch.set_rng_state(new_state)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cpu_tensors_report_cuda_types():
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _within_cuda_type_checks(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cpu_tensors_report_cuda_types():
            return fn(*args, **kwargs)

    return wrapper


def _wrap_method(cls: type, name: str) -> None:
    attr = cls.__dict__[name]
    if isinstance(attr, (classmethod, staticmethod)):
        setattr(cls, name, type(attr)(_within_cuda_type_checks(attr.__func__)))
    else:
        setattr(cls, name, _within_cuda_type_checks(attr))


def _import_megatron_quietly() -> None:
    """Megatron warns once per module that Apex / Transformer Engine are absent: expected on CPU."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*(Apex|Transformer Engine).*not installed.*|Apex is not installed.*"
        )
        for name in _MEGATRON_MODULES:
            importlib.import_module(name)


class CpuWgradAccumulation:
    """The CPU form of megatron's `fused_weight_gradient_mlp_cuda`: main_grad += grad_output^T @ input.

    One GEMM that adds into the grad buffer, instead of a fresh weight-grad tensor that DDP's hook then adds to
    main_grad in another pass over it (and frees). `mindrl.kernels.cpu_linear` puts a oneDNN form in its place."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        """total_input (tokens, in), grad_output (tokens, out), main_grad (out, in)."""
        if total_input.dtype != main_grad.dtype:  # 16-bit activations, fp32 grads: the 16-bit GEMM, added
            main_grad.add_(grad_output.t().matmul(total_input))
        else:
            main_grad.addmm_(grad_output.t(), total_input)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _host_tensor(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's `moe_utils.maybe_move_tensor_to_cpu` for tensors already on the host."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _uneven_gather(original):
    """megatron's gather along the first dimension; with uneven split sizes (the MoE dispatcher's tokens per TP
    rank) as equal-size pieces padded to the largest, since gloo's all_gather takes equal sizes only."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(pieces, output_split_sizes)])

    return gather


def _uneven_reduce_scatter(original):
    """megatron's reduce-scatter along the first dimension; with uneven split sizes as an all-reduce of the whole
    tensor and this rank's slice of it (gloo has no uneven reduce-scatter)."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return torch.split(total, list(input_split_sizes))[group.rank()].clone()

    return reduce_scatter


def adapt_megatron() -> None:
    """Adapt megatron-core to the CPU (once per process: `Platform.apply` calls it)."""
    global _TORCH_PROXY
    _TORCH_PROXY = _TorchOnCpu()
    _import_megatron_quietly()
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.core") and mod is not None:
            _patch_module(mod)
    sys.meta_path.insert(0, _PatchMegatronOnImport())

    # Tensor-parallel RNG tracker: the CPU generator stands in for the CUDA one, so dropout inside
    # tracker.fork() and activation recompute reproduce exactly.
    random_mod = sys.modules["megatron.core.tensor_parallel.random"]
    originals = {random_mod._get_cuda_rng_state: _cpu_get_rng_state, random_mod._set_cuda_rng_state: _cpu_set_rng_state}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("megatron.core") or mod is None:
            continue
        for attr in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
            fn = getattr(mod, attr, None)
            if fn in originals:
                setattr(mod, attr, originals[fn])

    # Megatron moves tensors with .cuda() (broadcast_data, tied embeddings under PP, optimizer state).
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    # Weight-gradient accumulation into DDP's main_grad (megatron's apex kernel on CUDA), see
    # mindrl.workers.train_setup.accumulate_wgrad_in_main_grad.
    layers = sys.modules["megatron.core.tensor_parallel.layers"]
    layers.fused_weight_gradient_mlp_cuda = CpuWgradAccumulation
    layers._grad_accum_fusion_available = True

    # The MoE router's gating GEMM tests `te_general_gemm is not None`, a name megatron defines only when Transformer
    # Engine imports: without TE it raises NameError; None selects its torch.mm path.
    moe_utils = sys.modules["megatron.core.transformer.moe.moe_utils"]
    if not getattr(moe_utils, "HAVE_TE", False):
        moe_utils.te_general_gemm = None
    # Multi-latent attention tests `isinstance(linear_proj, TELinear)` when HAVE_TE, which it sets when megatron's TE
    # extension imports: without TE that module stands mock objects in for the classes, and isinstance raises.
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False
    # The all-to-all dispatcher moves its split sizes to the host as numpy arrays (all_to_all_single takes a
    # sequence of ints, not a tensor), but only when they are on a GPU: on the CPU they stayed tensors.
    original_to_cpu = moe_utils.maybe_move_tensor_to_cpu
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(mod, "maybe_move_tensor_to_cpu", None) is original_to_cpu:
            mod.maybe_move_tensor_to_cpu = _host_tensor

    # The MoE dispatcher under TP gathers and reduce-scatters its tokens in pieces of uneven sizes.
    mappings = sys.modules["megatron.core.tensor_parallel.mappings"]
    mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)

    # The optimizer asserts CUDA tensor type names while it builds its param groups and clips grads.
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    _wrap_method(distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups")
    _wrap_method(distrib_optimizer.DistributedOptimizer, "__init__")
    _wrap_method(optimizer.Float16OptimizerWithFloat16Params, "__init__")
    # Modules that imported the function by name hold their own reference: replace every one of them
    # (compare against the original, which clip_grads itself also holds until the loop reaches it).
    original_clip = clip_grads.clip_grad_by_total_norm_fp32
    wrapped_clip = _within_cuda_type_checks(original_clip)
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(mod, "clip_grad_by_total_norm_fp32", None) is original_clip:
            mod.clip_grad_by_total_norm_fp32 = wrapped_clip
