"""The Ascend NPU platform: one NPU per rank, hccl collectives, megatron through torch_npu (which redirects
torch.cuda.*) and, when installed, MindSpeed's Ascend-fused kernels. Not runnable here (no NPU)."""

from __future__ import annotations

import contextlib

from mindrl.platform.accelerator import AcceleratorPlatform


class NpuPlatform(AcceleratorPlatform):
    name = "npu"
    dist_backend = "hccl"
    ray_resource = "NPU"
    planner_device = "910b"

    def weight_channel_group(self, store, rank: int, world_size: int, timeout_s: float):
        import datetime

        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # noqa: PLC0415 (only on Ascend hosts)

        opts = ProcessGroupHCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        return ProcessGroupHCCL(store, rank, world_size, opts)

    def _adapt(self) -> None:
        import torch_npu  # noqa: F401
        from torch_npu.contrib import transfer_to_npu  # noqa: F401

        with contextlib.suppress(ImportError):
            import mindspeed.megatron_adaptor  # noqa: F401
