"""Module-level functions the reward-model tests run on pool ranks, and transformers' scoring they compare with."""

from __future__ import annotations

import functools

import torch

from mindrl.batch import Batch
from mindrl.checkpoint.convert import _rms_norm_in_dtype


def scores_rank(load_dir: str, tp: int, pp: int, batch: Batch, dtype: str, micro) -> torch.Tensor | None:
    """`last_token_scores` of the whole batch on every DP rank; returned by the TP-0, DP-0 rank of the last stage."""
    from megatron.core import parallel_state as ps

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.workers.reward_worker import last_token_scores

    _, _, model = build_and_load(load_dir, tp, pp, dtype)
    out = last_token_scores(model, batch, micro)
    keep = out is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return out if keep else None


def hf_model(hf_dir: str, dtype: torch.dtype):
    """transformers' model in `dtype` (in fp64 with fp64 RMSNorm statistics, as `convert.hf_outputs`)."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=dtype).eval()
    if dtype == torch.float64:
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
                module.forward = functools.partial(_rms_norm_in_dtype, module)
    return model


def hf_scores(model, rows: list[list[int]], pad: int, side: str) -> torch.Tensor:
    """transformers' own scoring of `rows` (token ids) batched with `side` padding, or one by one (side "none")."""
    with torch.no_grad():
        if side == "none":
            return torch.stack([model(input_ids=torch.tensor([r])).logits[0, 0] for r in rows])
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            ids[i, cols], mask[i, cols] = torch.tensor(r), 1
        return model(input_ids=ids, attention_mask=mask).logits[:, 0]
