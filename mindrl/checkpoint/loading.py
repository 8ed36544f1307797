"""Build a model and load it from any checkpoint mindrl reads: its own dist-ckpt iterations (`mcore_ckpt`) or a
legacy megatron per-rank checkpoint (`legacy`), at whatever TP / PP it was saved with."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from mindrl.checkpoint import legacy, mcore_ckpt
from mindrl.checkpoint.hf_io import CheckpointError
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
    value_head: bool = False,
    cp: int = 1,
    ep: int = 1,
    adapt: Callable[[torch.nn.Module], object] | None = None,
    **config_overrides,
) -> tuple[ModelSpec, dict, torch.nn.Module]:
    """(spec, meta, model): this rank's stage of the checkpoint's model built at TP x PP (any saved layout),
    with the latest iteration (or `iteration`) loaded. Collective; call inside a rank. dtype defaults to the
    saved one. A legacy per-rank checkpoint (mp_rank_* files, see `legacy`) takes its architecture from
    `hf_config` (an HF model dir) or the config.json in load_dir/hf_files. recompute: activation recomputation
    in training (None: none). value_head: build a critic (value-head model) whatever the checkpoint holds; from a
    causal LM that is its trunk with a fresh head (`value_model_spec`, `init_value_head`), and the returned spec
    is the value model's. cp: the context-parallel size (the weights are replicated over it). ep: the expert-parallel
    size of a MoE model (carved out of the data-parallel ranks). adapt: called on the built model before loading
    (LoRA's `apply_lora`): a checkpoint that holds the adapters (a LoRA run's own) loads them too; one without
    (the base model) leaves them as `adapt` made them. A LoRA checkpoint (its meta has `lora`) loaded without
    `adapt` gets its own adapters back (the frozen backbone plus the adapters: mindrl-convert merges them).
    config_overrides: TransformerConfig keys (a MoE model's router losses in training), and build_model's
    layers_per_stage."""
    from mindrl.launch import init_model_parallel
    from mindrl.models.builder import build_model

    if legacy.is_legacy(load_dir, iteration):
        if value_head:
            raise CheckpointError(
                f"{load_dir}: a value head on a legacy checkpoint; convert it with mindrl-convert first"
            )
        if config_overrides.get("layers_per_stage") is not None:
            raise CheckpointError(f"{load_dir}: uneven pipeline stages on a legacy checkpoint; convert it first")
        if ep > 1 or any(k != "layers_per_stage" for k in config_overrides):
            raise CheckpointError(
                f"{load_dir}: a legacy checkpoint of a MoE model; convert it with mindrl-convert first"
            )
        spec, meta, model = legacy.build_and_load(
            load_dir, tp, pp, dtype, sequence_parallel, hf_config, iteration, recompute, cp
        )
        if adapt is not None:
            adapt(model)
        return spec, meta, model
    init_model_parallel(tp, pp, cp=cp, ep=ep)
    iteration = mcore_ckpt.read_tracker(load_dir) if iteration is None else iteration
    spec, meta = mcore_ckpt.read_model_meta(load_dir, iteration)
    fresh_head = value_head and meta["role"] != "critic"
    if fresh_head:
        spec = value_model_spec(spec)
    model = build_model(
        spec,
        "critic" if value_head else meta["role"],
        dtype=dtype or meta["dtype"],
        sequence_parallel=sequence_parallel,
        perform_initialization=False,
        recompute=recompute,
        **config_overrides,
    )
    if adapt is None and meta.get("lora"):  # a LoRA run's checkpoint: its adapters, to load them
        from mindrl.models.lora import apply_lora

        lora = meta["lora"]
        apply_lora(model, lora["lora_r"], lora["lora_alpha"], lora["lora_target_modules"])
    elif adapt is not None:
        adapt(model)
    it_dir = mcore_ckpt.iteration_dir(load_dir, iteration)
    backbone = (meta.get("lora") or {}).get("backbone")
    if backbone is not None:  # an adapter-only checkpoint (lora_ckpt_filter): the frozen backbone lives elsewhere
        base_dir = mcore_ckpt.iteration_dir(backbone["load"], backbone["iteration"])
        if not os.path.isdir(base_dir):
            raise CheckpointError(f"{it_dir} holds LoRA adapters only (lora_ckpt_filter); its backbone {base_dir} "
                                  "(the run's original load) is missing")  # fmt: skip
        mcore_ckpt.load_model(model, base_dir)  # the base model has no adapters: they are left to the next load
        mcore_ckpt.load_model(model, it_dir, only_adapters=True)
    else:
        mcore_ckpt.load_model(model, it_dir, skip=("output_layer.",) if fresh_head else ())
        backbone = {"load": os.path.abspath(load_dir), "iteration": iteration}
    model.mindrl_backbone = backbone  # where its frozen weights come from, for an adapter-only save
    if fresh_head:
        init_value_head(model, spec)
    return spec, meta, model


def value_model_spec(spec: ModelSpec) -> ModelSpec:
    """The `*ForSequenceClassification` (one label) of a causal LM's spec: the same trunk, an untied scalar head."""
    if spec.is_value_model:
        return spec
    cfg = dict(spec.hf_config)
    cfg["architectures"] = [spec.architecture.replace("ForCausalLM", "ForSequenceClassification")]
    cfg.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, tie_word_embeddings=False)
    return ModelSpec.from_hf_config(cfg, f"{spec.architecture} as a value model")


def init_value_head(model: torch.nn.Module, spec: ModelSpec, seed: int = 0) -> None:
    """A fresh value head on the last stage, the same on every rank (it is replicated over TP): N(0, 1/(h+1)^2), the
    small start OpenRLHF's reward models use, so the first scores are near 0."""
    head = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if head is None:
        return
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(head.weight.shape, generator=gen, dtype=torch.float64) / (spec.hidden_size + 1)
    with torch.no_grad():
        head.weight.copy_(weight.to(head.weight.dtype))
