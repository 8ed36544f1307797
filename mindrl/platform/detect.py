"""Which platform this process runs on: `MINDRL_PLATFORM=cpu|cuda|npu` if set (e.g. checkpoint conversion on a
host's CPU), else the first of npu, cuda, cpu that is there."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from mindrl.platform.base import Platform
from mindrl.platform.cpu import CpuPlatform
from mindrl.platform.cuda import CudaPlatform
from mindrl.platform.npu import NpuPlatform

_KINDS: dict[str, type[Platform]] = {"npu": NpuPlatform, "cuda": CudaPlatform, "cpu": CpuPlatform}


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401

        return torch.npu.is_available() and torch.npu.device_count() > 0
    except Exception:  # a torch_npu without CANN fails at import; that host has no usable NPU
        return False


def cpu_platform() -> CpuPlatform:
    """The CPU platform's facts, whatever this host has (e.g. for planning CPU stand-in ranks)."""
    return CpuPlatform()


@functools.cache
def current_platform() -> Platform:
    """Detect once per process: MINDRL_PLATFORM if set, else npu, then cuda, then cpu."""
    forced = os.environ.get("MINDRL_PLATFORM", "").strip().lower()
    if forced:
        if forced not in _KINDS:
            raise ValueError(f"MINDRL_PLATFORM={forced!r} is not one of {', '.join(_KINDS)}")
        return _KINDS[forced]()
    if _npu_available():
        return NpuPlatform()
    if torch.cuda.is_available():
        return CudaPlatform()
    return CpuPlatform()
