"""Where am I running: the only package that knows about npu / cuda / cpu.

Everything else asks `current_platform()` for the device, the torch.distributed backend and the Ray
resource, and calls `current_platform().apply()` once per process before building megatron models.
"""

from mindrl.platform.detect import Platform, current_platform

__all__ = ["Platform", "current_platform"]
