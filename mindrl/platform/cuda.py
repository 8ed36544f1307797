"""The CUDA platform: one GPU per rank, nccl collectives, megatron and vLLM as they ship."""

from __future__ import annotations

import os

from mindrl.platform.accelerator import AcceleratorPlatform


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    dist_backend = "nccl"
    ray_resource = "GPU"
    planner_device = "h100"

    def ray_actor_options(self, fraction: float) -> dict:
        return {"num_cpus": 0, "num_gpus": fraction}

    def weight_channel_group(self, store, rank: int, world_size: int, timeout_s: float):
        import datetime

        import torch.distributed as dist

        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)

    def _adapt(self) -> None:
        # Megatron's recommended setting for overlapping TP communication on GPUs.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
