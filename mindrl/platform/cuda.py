"""The CUDA platform: one GPU per rank, nccl collectives, megatron and vLLM as they ship."""

from __future__ import annotations

import os

import torch

from mindrl.platform.accelerator import AcceleratorPlatform


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    dist_backend = "nccl"
    ray_resource = "GPU"
    planner_device = "h100"
    attention_operands = "native"  # flash / memory-efficient SDPA: bf16 operands, fp32 softmax inside

    def deterministic_env(self) -> dict[str, str]:
        # cuBLAS picks reduction splits by workspace unless it has a fixed one (torch's deterministic mode raises
        # without it); NCCL's ring all-reduce adds in one fixed order for a given world, where NVLS / tree variants
        # may change with message size and topology; Transformer Engine's non-deterministic kernels stay off.
        return {
            **super().deterministic_env(),
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
            "NCCL_ALGO": "Ring",
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
        }

    def ray_actor_options(self, fraction: float) -> dict:
        return {"num_cpus": 0, "num_gpus": fraction}

    def weight_channel_group(self, store, rank: int, world_size: int, timeout_s: float):
        import datetime

        import torch.distributed as dist

        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)

    def core_attention(self, q, k, v, mask, scale: float, dropout: float):
        # Causal without padding: the flash kernel reads grouped K/V in place. A padding mask goes to the
        # memory-efficient kernel, which takes K/V expanded to the query heads (the base's path).
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        return super().core_attention(q, k, v, mask, scale, dropout)

    def _adapt(self) -> None:
        # Megatron's recommended setting for overlapping TP communication on GPUs.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
