"""Where am I running: the only package that knows about npu / cuda / cpu. Everything else asks `current_platform()` for
the device, backend and Ray resource, and calls `current_platform().apply()` once per process before megatron."""

from mindrl.platform.base import DETERMINISTIC_ENV, Platform, determinism_requested, env_switch, in_host_memory
from mindrl.platform.cpu import CpuPlatform
from mindrl.platform.cuda import CudaPlatform
from mindrl.platform.detect import cpu_platform, current_platform
from mindrl.platform.npu import NpuPlatform

__all__ = [
    "DETERMINISTIC_ENV",
    "CpuPlatform",
    "CudaPlatform",
    "NpuPlatform",
    "Platform",
    "cpu_platform",
    "current_platform",
    "determinism_requested",
    "env_switch",
    "in_host_memory",
]
