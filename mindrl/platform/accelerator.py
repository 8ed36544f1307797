"""The base of the device platforms (CUDA, NPU): a torch device module (`torch.cuda`, `torch.npu`) per rank; the
subclasses add their backend, Ray resource and adaptation."""

from __future__ import annotations

import os

import torch

from mindrl.platform.base import Platform


class AcceleratorPlatform(Platform):
    def _module(self):
        return getattr(torch, self.name)

    def device(self, local_rank: int | None = None) -> torch.device:
        if local_rank is None:
            module = self._module()
            if module.is_initialized():
                local_rank = module.current_device()
            else:
                local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(self.name, local_rank)

    def local_rank(self, rank: int) -> int:
        return rank % max(self.device_count(), 1)

    def set_device(self, local_rank: int) -> None:
        self._module().set_device(local_rank)

    def device_count(self) -> int:
        return self._module().device_count()

    def synchronize(self) -> None:
        self._module().synchronize()

    def empty_cache(self) -> None:
        self._module().empty_cache()

    def memory_allocated(self) -> int:
        return self._module().memory_allocated()

    def max_memory_allocated(self) -> int:
        return self._module().max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        self._module().reset_peak_memory_stats()
