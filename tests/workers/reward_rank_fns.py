"""Module-level functions the reward-model tests run on pool ranks."""

from __future__ import annotations

import torch

from mindrl.batch import Batch


def scores_rank(load_dir: str, tp: int, pp: int, batch: Batch, dtype: str, micro) -> torch.Tensor | None:
    """`last_token_scores` of the whole batch on every DP rank; returned by the TP-0, DP-0 rank of the last stage."""
    from megatron.core import parallel_state as ps

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.workers.reward_worker import last_token_scores

    _, _, model = build_and_load(load_dir, tp, pp, dtype)
    out = last_token_scores(model, batch, micro)
    keep = out is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return out if keep else None
