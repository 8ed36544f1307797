"""Offload / onload of the trainer's params, grads and optimizer state around the rollout
(`generate_config.offload_train_*`), by storage, so every view comes back valid (see `TrainStateOffloader`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mindrl.platform import current_platform

KINDS = ("param", "grad", "optimizer")


@dataclass(frozen=True)
class OffloadConfig:
    """Which trainer state leaves the device during the rollout (MindSpeed-RL's generate_config keys)."""

    offload_train_optimizer: bool = False  # optimizer state (Adam moments, steps, fp32 main params)
    offload_train_grad: bool = False  # grad buffers (megatron DDP grad_data / main_grad, .grad)
    offload_train_param: bool = False  # model params (after the weights were streamed to the engine)

    @classmethod
    def from_generate_config(cls, cfg: Any) -> OffloadConfig:
        """From a generate_config object or dict (missing keys: False)."""
        get = cfg.get if isinstance(cfg, dict) else lambda k, d: getattr(cfg, k, d)
        return cls(*(bool(get(f"offload_train_{k}", False)) for k in ("optimizer", "grad", "param")))

    @property
    def kinds(self) -> tuple[str, ...]:
        on = {
            "param": self.offload_train_param,
            "grad": self.offload_train_grad,
            "optimizer": self.offload_train_optimizer,
        }
        return tuple(k for k in KINDS if on[k])


@dataclass
class OffloadStats:
    seconds: float = 0.0
    moved_bytes: dict[str, int] = field(default_factory=dict)  # per kind, this call
    device_bytes_before: dict[str, int] = field(default_factory=dict)  # storage accounting, per kind
    device_bytes_after: dict[str, int] = field(default_factory=dict)
    allocated_before: int = 0  # platform allocator (0 on CPU)
    allocated_after: int = 0


def _inner_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron (chained / mixed-precision / distributed) optimizer."""
    if optimizer is None:
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
    elif hasattr(optimizer, "chained_optimizers"):
        for sub in optimizer.chained_optimizers:
            yield from _inner_optimizers(sub)
    elif hasattr(optimizer, "optimizer"):
        yield from _inner_optimizers(optimizer.optimizer)
    else:
        raise TypeError(
            f"cannot find the torch optimizer inside {type(optimizer).__name__}: expected a torch.optim.Optimizer "
            "or a megatron optimizer (one with .optimizer or .chained_optimizers)"
        )


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _key(t: torch.Tensor) -> int:
    # The StorageImpl's address: stable across resize_, shared by all views (data_ptr is neither).
    return t.untyped_storage()._cdata


class TrainStateOffloader:
    """Moves the params, grads and optimizer state of `model_chunks` (+ `optimizer`) off the device and back.

    offloader = TrainStateOffloader([ddp_model], optimizer, OffloadConfig(True, True, True))
    offloader.offload()        # the configured kinds; or offload(["optimizer", "grad"])
    ...                        # rollout: the training state must not be touched
    offloader.onload()         # everything offloaded comes back, bit-identical

    Works on storages, not tensors: each device storage of a kind is copied into a host buffer and then resized to
    0 bytes, so every view of it (DDP's `main_grad` and bucket views, params inside a DDP `param_data` buffer, the
    optimizer's references) stays the same Python object and comes back valid and bit-identical when the storage is
    re-grown and copied back (megatron's `offload_grad_buffers` uses the same trick for grads, but drops their
    values). A storage is counted once, in the first kind that references it: param, then grad, then optimizer (an
    fp32 optimizer's "main params" are the model params; its grads are DDP's grad buffer).
    """

    def __init__(
        self, model_chunks: Sequence[torch.nn.Module], optimizer: Any = None, config: OffloadConfig | None = None
    ):
        self.model_chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        list(_inner_optimizers(optimizer))  # an optimizer it cannot unwrap fails here, not at the first rollout
        self.optimizer = optimizer
        self.config = config or OffloadConfig()
        self._host: dict[int, tuple[torch.UntypedStorage, torch.Tensor, str]] = {}  # key -> (storage, host, kind)
        # Host copies of storages onloaded for a read-only hold: still equal to the device's, so offloading them again
        # frees the device storage without a copy (a reference or reward model is written to its host buffer once).
        self._kept: dict[int, torch.Tensor] = {}
        self.platform = current_platform()

    # ------------------------------------------------------------------------------------ accounting
    def _category_tensors(self) -> dict[str, list[torch.Tensor]]:
        params, grads = [], []
        for chunk in self.model_chunks:
            for p in chunk.parameters():
                params.append(p)
                for g in (getattr(p, "main_grad", None), p.grad):
                    if g is not None:
                        grads.append(g)
            # megatron DDP's grad/param buffers (a plain nn.Module's `buffers` is a method: skip it)
            ddp_buffers = [getattr(chunk, a, None) for a in ("buffers", "expert_parallel_buffers")]
            for buf in [b for bs in ddp_buffers if isinstance(bs, (list, tuple)) for b in bs]:
                if getattr(buf, "param_data", None) is not None:
                    params.append(buf.param_data)
                if getattr(buf, "grad_data", None) is not None:
                    grads.append(buf.grad_data)
        opt = []
        for inner in _inner_optimizers(self.optimizer):
            opt.extend(_tensors(list(inner.state.values())))
            for group in inner.param_groups:
                for p in group["params"]:
                    opt.append(p)  # fp32 main params of a mixed-precision optimizer (model params otherwise)
                    if p.grad is not None:
                        grads.append(p.grad)
        return {"param": params, "grad": grads, "optimizer": opt}

    def storages(self) -> dict[str, dict[int, torch.UntypedStorage]]:
        """Unique device storages per kind; a storage belongs to the first kind that references it."""
        seen: set[int] = set()
        out: dict[str, dict[int, torch.UntypedStorage]] = {}
        for kind, tensors in self._category_tensors().items():
            out[kind] = {}
            for t in tensors:
                k = _key(t)
                if k not in seen:
                    seen.add(k)
                    out[kind][k] = t.untyped_storage()
        return out

    def device_bytes(self) -> dict[str, int]:
        """Bytes the trainer's params / grads / optimizer state hold on the device now, per kind."""
        return {kind: sum(s.nbytes() for s in st.values()) for kind, st in self.storages().items()}

    def host_bytes(self) -> int:
        return sum(h.nbytes for _, h, _ in self._host.values())

    @property
    def offloaded_kinds(self) -> set[str]:
        return {kind for _, _, kind in self._host.values()}

    # ------------------------------------------------------------------------------------ moving
    def offload(self, kinds: Iterable[str] | None = None) -> OffloadStats:
        """Copy the storages of `kinds` (default: the configured ones) to host buffers, then free them."""
        kinds = self.config.kinds if kinds is None else (kinds,) if isinstance(kinds, str) else tuple(kinds)
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown offload kinds {unknown}; expected some of {KINDS}")
        stats = self._begin()
        t0 = time.perf_counter()
        moving, written = [], []
        for kind, storages in self.storages().items():
            if kind not in kinds:
                continue
            stats.moved_bytes[kind] = 0
            for k, storage in storages.items():
                n = storage.nbytes()
                if k in self._host or n == 0:
                    continue
                host = self._kept.pop(k, None)
                if host is None:
                    host = self.platform.host_buffer(n)
                    host.untyped_storage().copy_(storage, non_blocking=True)
                    written.append(host)
                self._host[k] = (storage, host, kind)
                moving.append(storage)
                stats.moved_bytes[kind] += n
        self.platform.synchronize()  # the copies must land before the device memory is released
        for storage in moving:
            storage.resize_(0)
        for host in written:
            self.platform.host_copied(host)
        self.platform.empty_cache()
        return self._end(stats, t0)

    def onload(self, kinds: Iterable[str] | None = None, keep_host: bool = False) -> OffloadStats:
        """Re-grow the offloaded storages of `kinds` (default: all) on the device and copy their bytes back.
        keep_host: keep their host copies for the next `offload`, which then copies nothing: only when nothing changes
        them on the device in between (`holding(read_only=True)`)."""
        kinds = KINDS if kinds is None else (kinds,) if isinstance(kinds, str) else tuple(kinds)
        stats = self._begin()
        t0 = time.perf_counter()
        back = [k for k, (_, _, kind) in self._host.items() if kind in kinds]
        for k in back:
            storage, host, kind = self._host[k]
            storage.resize_(host.nbytes)
            storage.copy_(host.untyped_storage(), non_blocking=True)
            stats.moved_bytes[kind] = stats.moved_bytes.get(kind, 0) + host.nbytes
        self.platform.synchronize()
        for k in back:
            host = self._host.pop(k)[1]
            if keep_host:
                self._kept[k] = host
                self.platform.host_copied(host)
        return self._end(stats, t0)

    def place(self, on_device: Iterable[str]) -> None:
        """Leave exactly the kinds `on_device` on the device: offload the others, onload these (if offloaded)."""
        on = set(on_device)
        if self.offloaded_kinds & on:
            self.onload(self.offloaded_kinds & on)
        if any(self.device_bytes()[k] for k in KINDS if k not in on):
            self.offload([k for k in KINDS if k not in on])

    @contextlib.contextmanager
    def holding(self, kinds: Iterable[str] = KINDS, read_only: bool = False) -> Iterator[None]:
        """`kinds` on the device for the block; those it had to onload leave again after it (also on an error).
        read_only: the block does not change them (a forward), so they leave without being copied out again."""
        moved = self.offloaded_kinds & set(kinds)
        if moved:
            self.onload(moved, keep_host=read_only)
        try:
            yield
        finally:
            if moved:
                self.offload(moved)
            self._kept.clear()  # only valid across this block

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """An optimizer step with the optimizer state swapped in (swap_optimizer): on the device for the block, on the
        host after it, including the state the block created (Adam's first step), so it never stays behind."""
        if "optimizer" in self.offloaded_kinds:
            self.onload(["optimizer"])
        try:
            yield
        finally:
            self.offload(["optimizer"])

    def _begin(self) -> OffloadStats:
        self.platform.synchronize()
        return OffloadStats(device_bytes_before=self.device_bytes(), allocated_before=self.platform.memory_allocated())

    def _end(self, stats: OffloadStats, t0: float) -> OffloadStats:
        stats.seconds = time.perf_counter() - t0
        stats.device_bytes_after = self.device_bytes()
        stats.allocated_after = self.platform.memory_allocated()
        return stats
