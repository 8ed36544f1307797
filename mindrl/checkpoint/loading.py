"""Build a model and load it from any checkpoint mindrl reads: its own dist-ckpt iterations (`mcore_ckpt`) or a
legacy megatron per-rank checkpoint (`legacy`), at whatever TP / PP it was saved with."""

from __future__ import annotations

import torch

from mindrl.checkpoint import legacy, mcore_ckpt
from mindrl.config.settings import RecomputeSettings
from mindrl.models.hf_config import ModelSpec


def build_and_load(
    load_dir: str,
    tp: int,
    pp: int,
    dtype: str | None = None,
    sequence_parallel: bool = False,
    iteration: int | str | None = None,
    hf_config: str | None = None,
    recompute: RecomputeSettings | None = None,
    cp: int = 1,
) -> tuple[ModelSpec, dict, torch.nn.Module]:
    """(spec, meta, model): this rank's stage of the checkpoint's model built at TP x PP (any saved layout),
    with the latest iteration (or `iteration`) loaded. Collective; call inside a rank. dtype defaults to the
    saved one. A legacy per-rank checkpoint (mp_rank_* files, see `legacy`) takes its architecture from
    `hf_config` (an HF model dir) or the config.json in load_dir/hf_files. recompute: activation recomputation
    in training (None: none); cp: the context-parallel size (the weights are replicated over it)."""
    from mindrl.launch import init_model_parallel
    from mindrl.models.builder import build_model

    if legacy.is_legacy(load_dir, iteration):
        return legacy.build_and_load(load_dir, tp, pp, dtype, sequence_parallel, hf_config, iteration, recompute, cp)
    init_model_parallel(tp, pp, cp=cp)
    iteration = mcore_ckpt.read_tracker(load_dir) if iteration is None else iteration
    spec, meta = mcore_ckpt.read_model_meta(load_dir, iteration)
    model = build_model(
        spec,
        meta["role"],
        dtype=dtype or meta["dtype"],
        sequence_parallel=sequence_parallel,
        perform_initialization=False,
        recompute=recompute,
    )
    mcore_ckpt.load_model(model, mcore_ckpt.iteration_dir(load_dir, iteration))
    return spec, meta, model
