"""The Ascend NPU platform: one NPU per rank, hccl collectives, megatron through torch_npu (which redirects
torch.cuda.*) and, when installed, MindSpeed's Ascend-fused kernels. Not runnable here (no NPU)."""

from __future__ import annotations

import contextlib

import torch

from mindrl.platform.accelerator import AcceleratorPlatform


class NpuPlatform(AcceleratorPlatform):
    name = "npu"
    dist_backend = "hccl"
    ray_resource = "NPU"
    planner_device = "910b"
    attention_operands = "native"  # npu_fusion_attention: bf16 operands, fp32 softmax inside
    attention_grouped_kv = True
    device_rms_norm = True

    def core_attention(self, q, k, v, mask, scale: float, dropout: float):
        import torch_npu  # noqa: PLC0415 (only on Ascend hosts)

        sq, s = q.shape[2], k.shape[2]
        if mask is None:  # causal: the queries are the last sq positions
            mask = torch.ones(sq, s, dtype=torch.bool, device=q.device).triu_(s - sq + 1)[None, None]
        # BNSD layout; grouped K/V heads read in place; atten_mask True = hidden, as megatron's.
        return torch_npu.npu_fusion_attention(
            q, k, v, q.shape[1], input_layout="BNSD", atten_mask=mask, scale=scale, keep_prob=1.0 - dropout
        )[0]

    def rms_norm(self, x, weight, eps: float):
        import torch_npu  # noqa: PLC0415

        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def deterministic_env(self) -> dict[str, str]:
        # HCCL / LCCL reduce in a fixed order; the matmul and ATB kernels keep their K-split order fixed and their
        # communication-overlapped variants off (the switches MindSpeed-RL's deterministic mode sets).
        return {
            **super().deterministic_env(),
            "HCCL_DETERMINISTIC": "true",
            "LCCL_DETERMINISTIC": "1",
            "CLOSE_MATMUL_K_SHIFT": "1",
            "ATB_MATMUL_SHUFFLE_K_ENABLE": "0",
            "ATB_LLM_LCOC_ENABLE": "0",
        }

    def collective_buffer_env(self, mib: int) -> dict[str, str]:
        return {"HCCL_BUFFSIZE": str(mib)}

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
