"""Module-level functions the checkpoint tests run on ranks."""

from __future__ import annotations

import torch


def padded_logits(load_dir: str, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    from megatron.core import parallel_state as ps

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.models.forward import forward_outputs

    _, _, model = build_and_load(load_dir, 2, 1, "float32")
    out = forward_outputs(model, input_ids, attention_mask)
    return out if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 else None
