"""Module-level functions the planner tests run on pool ranks: megatron's own parameter counts and the bytes a
built model + optimizer really holds."""

from __future__ import annotations

import contextlib

import torch


def count_params(hf_dir: str, role: str, tp: int, pp: int, ep: int = 1) -> dict:
    """This rank's parameter count in the model mindrl builds (mindrl.models.builder) at TP x PP (x EP), and how
    many of them are routed experts'."""
    from megatron.core import parallel_state as ps

    from mindrl.launch import init_model_parallel
    from mindrl.models.builder import build_model
    from mindrl.models.hf_config import ModelSpec

    init_model_parallel(tp, pp, ep=ep)
    model = build_model(ModelSpec.from_hf_dir(hf_dir), role, dtype="float32", perform_initialization=False)
    return {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "params": sum(p.numel() for p in model.parameters()),
        "experts": sum(p.numel() for n, p in model.named_parameters() if ".experts." in n),
    }


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def measured_storage(load_dir: str, tp: int, distributed: bool, dtype: str = "float32") -> dict:
    """Build the trainer's model + optimizer (mindrl.workers.train_setup) from `load_dir` at TP x 1, take one
    optimizer step (so Adam's state exists) and count the distinct storages of weights, gradient buffers and
    optimizer state on this rank."""
    from mindrl.workers.train_setup import OptimSettings, build_model_and_optimizer, train_steps

    optim = OptimSettings(lr=1e-3, weight_decay=0.01, use_distributed_optimizer=distributed)
    spec, ddp, optimizer, _ = build_model_and_optimizer(load_dir, tp, 1, optim, total_steps=1, dtype=dtype)
    train_steps(ddp, optimizer, spec.vocab_size, steps=1, seed=0, batch=4, seq=16)
    params = list(ddp.module.parameters())
    weights = _storages(params)
    grads = {k: v for k, v in _storages(getattr(p, "main_grad", None) for p in params).items() if k not in weights}
    inner = optimizer.optimizer
    state = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.numel() > 1]
    main = [p for g in inner.param_groups for p in g["params"]]
    opt = {k: v for k, v in _storages(state + main).items() if k not in weights and k not in grads}
    return {
        "params": sum(p.numel() for p in params),
        "weights_bytes": sum(weights.values()),
        "grads_bytes": sum(grads.values()),
        "optimizer_bytes": sum(opt.values()),
    }


def saved_activation_bytes(
    hf_dir: str, role: str, tp: int, sp: bool, batch: int, seq: int, dtype: str, fused_norm: bool,
    gemm_attention: bool = False, platform: str = "cpu",
) -> dict:  # fmt: skip
    """Bytes of the distinct non-parameter storages autograd saves for backward in one forward of `batch`
    sequences of `seq` tokens (the actor with megatron's vocab-parallel cross entropy, or the critic's values);
    fused_norm: the RMSNorms as mindrl's eager fused function (else torch's rms_norm under autograd);
    gemm_attention: the core attention as batched GEMMs (else torch's SDPA kernel); platform "cuda": the core
    attention as the CUDA platform calls it (16-bit operands as they are), run here on CPU tensors."""
    params, forward = _tiny_forward(hf_dir, role, tp, sp, batch, seq, dtype, fused_norm)
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            saved[s.data_ptr()] = s.nbytes()
        return t

    with _attention_path(seq, gemm_attention, platform):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        out.float().sum().backward()
    return {"saved_bytes": sum(saved.values())}


def _tiny_forward(
    hf_dir: str, role: str, tp: int, sp: bool, batch: int, seq: int, dtype: str, fused_norm: bool, recompute=None
):
    """(parameter storages, forward) for the model mindrl builds at TP x 1 (its RMSNorms fused as asked), training,
    on a seeded batch: forward() runs the actor with labels (megatron's vocab-parallel cross entropy) or the critic."""
    from mindrl.launch import init_model_parallel
    from mindrl.models.builder import RMSNorm, build_model
    from mindrl.models.forward import attention_inputs
    from mindrl.models.hf_config import ModelSpec

    init_model_parallel(tp, 1)
    spec = ModelSpec.from_hf_dir(hf_dir)
    model = build_model(spec, role, dtype=dtype, sequence_parallel=sp, recompute=recompute)
    model.train()
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fused = fused_norm
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (batch, seq + 1), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    position_ids, mask = attention_inputs(inputs, None)
    if role == "critic":
        return params, lambda: model(inputs, position_ids, mask)
    return params, lambda: model(inputs, position_ids, mask, labels=labels)


@contextlib.contextmanager
def _attention_path(seq: int, gemm_attention: bool, platform: str):
    """The core attention as batched GEMMs (gemm_attention) or SDPA, on the CPU's path or CUDA's (platform "cuda",
    on CPU tensors); the shared rank's own settings come back afterwards."""
    import os
    from unittest import mock

    from mindrl.models import attention
    from mindrl.platform import CudaPlatform

    core = mock.patch.object(attention, "current_platform", CudaPlatform) if platform == "cuda" else None
    # read at every forward
    with mock.patch.dict(os.environ, {"MINDRL_GEMM_ATTENTION_MAX_LEN": str(seq if gemm_attention else 0)}):
        with core or contextlib.nullcontext():
            yield


def recompute_activation_peak(
    hf_dir: str, role: str, tp: int, sp: bool, batch: int, seq: int, dtype: str, fused_norm: bool,
    gemm_attention: bool, recompute, platform: str = "cpu",
) -> dict:  # fmt: skip
    """The peak of the bytes autograd holds for backward in one forward + backward under activation recomputation
    (`recompute`, a RecomputeSettings): the distinct non-parameter storages saved in forward that are still alive
    (sized now: a released activation output counts 0 until it is rebuilt), plus those a recomputation saves in
    backward; taken at the end of the forward, at the end of each recomputation and after each rebuilt activation
    output. platform "cuda": the core attention as the CUDA platform calls it, on CPU tensors (as above)."""
    import weakref

    from megatron.core.tensor_parallel import random as mrandom

    params, forward = _tiny_forward(hf_dir, role, tp, sp, batch, seq, dtype, fused_norm, recompute)
    kept: dict[int, list] = {}  # storage -> weak references to the saved tensors on it
    rebuild: dict[int, int] = {}  # what the running recomputation saved, storage -> bytes
    state = {"backward": False, "base": 0, "peak": 0}

    def live() -> int:  # by storage object: a released storage's address may have been given to another since
        storages = {}
        for refs in kept.values():
            for t in (r() for r in refs):
                if t is not None:
                    storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def pack(t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in params or not s.nbytes():
            return t
        if not state["backward"]:
            kept.setdefault(ptr, []).append(weakref.ref(t))
        elif not any(r() is not None for r in kept.get(ptr, ())):  # a freed storage's address may come back
            rebuild[ptr] = s.nbytes()
            state["peak"] = max(state["peak"], state["base"] + sum(rebuild.values()))
        return t

    backward, restore = mrandom.CheckpointFunction.__dict__["backward"], mrandom.CheckpointWithoutOutput._recompute

    def checkpoint_backward(ctx, *args):
        rebuild.clear()
        state["base"] = live()
        return backward.__func__(ctx, *args)

    def recompute_output(self, grad):
        restore(self, grad)
        state["peak"] = max(state["peak"], live() + sum(rebuild.values()))

    with _attention_path(seq, gemm_attention, platform):
        mrandom.CheckpointFunction.backward = staticmethod(checkpoint_backward)
        mrandom.CheckpointWithoutOutput._recompute = recompute_output
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward()
                state["peak"] = forward_end = live()
                state["backward"] = True
                out.float().sum().backward()
        finally:
            mrandom.CheckpointFunction.backward = backward
            mrandom.CheckpointWithoutOutput._recompute = restore
    return {"forward_end_bytes": forward_end, "peak_bytes": state["peak"]}


class _LiveAllocations:
    """The bytes of the storages the operators run inside `track()` allocate that are still alive, and their peak
    (checked after every operator): a host-side allocation profile of one piece of code."""

    def __init__(self) -> None:
        self.peak = 0
        self._refs: list = []

    def live(self) -> int:
        storages = {}
        for t in (r() for r in self._refs):
            if t is not None:
                storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(storages.values())

    @contextlib.contextmanager
    def track(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)}  # fmt: skip
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                        outer._refs.append(weakref.ref(t))
                outer.peak = max(outer.peak, outer.live())
                return out

        with Mode():
            yield


def merge_buffer_peak(load_dir: str, tp: int, dtype: str, r: int, alpha: float, targets: list[str]) -> dict:
    """The reshard of a LoRA model built from `load_dir` at TP x 1 in `dtype` (`WeightStreamer.stream`, as the
    rollout engine is fed): the peak bytes allocated while each adapted linear is merged (`merged_weight`, tracked
    alone), over the whole stream."""
    from unittest import mock

    import mindrl.models.lora as lora
    from mindrl.checkpoint import loading
    from mindrl.resharding import WeightStreamer

    spec, _, model = loading.build_and_load(load_dir, tp, 1, dtype)
    lora.apply_lora(model, r, alpha, targets)
    merge, peaks = lora.merged_weight, []

    def tracked(module):
        allocations = _LiveAllocations()
        with allocations.track():
            out = merge(module)
        peaks.append(allocations.peak)
        return out

    with mock.patch.object(lora, "merged_weight", tracked):
        streamed = sum(1 for _ in WeightStreamer(model, spec).stream())
    return {"peak_bytes": max(peaks), "merges": len(peaks), "streamed": streamed}
