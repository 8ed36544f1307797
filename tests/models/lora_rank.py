"""Rank functions of tests/models/test_lora.py (importable by the pool's ranks)."""

from __future__ import annotations

import torch


def lora_outputs(load_dir: str, tp: int, pp: int, sp: bool, recompute: bool, ids: torch.Tensor, r: int, alpha: float,
                 targets: list[str], full: dict[str, torch.Tensor]) -> dict | None:  # fmt: skip
    """The trainer's model (`build_model_and_optimizer` with LoRA: DDP, megatron's optimizer) of the checkpoint at
    TP x PP (SP, full recomputation of every layer), its adapters set from the whole matrices `full`: logits of ids[:, :-1]
    with and without the adapters, the adapters' grads of the mean next-token cross entropy of `ids` (DDP's, after megatron's
    finalize), the merged weights' shards (W + scale * B A) and what one optimizer step
    changed. dp rank 0 only."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mindrl.config.settings import LoRASettings, OptimSettings, RecomputeSettings
    from mindrl.models.forward import attention_inputs, forward_outputs, run_schedule
    from mindrl.models.lora import adapter_mapping, adapters_disabled, is_adapter_param, merged_weights
    from mindrl.models.weight_map import full_to_local, global_name
    from mindrl.models.wrappers import unwrap
    from mindrl.resharding import WeightStreamer
    from mindrl.workers.train_setup import build_model_and_optimizer

    lora = LoRASettings(lora_target_modules=targets, lora_r=r, lora_alpha=alpha)
    rc = RecomputeSettings("full", "uniform", 1) if recompute else None
    spec, ddp, optimizer, _ = build_model_and_optimizer(load_dir, tp, pp, OptimSettings(lr=1e-3), total_steps=1,
                                                        sequence_parallel=sp, recompute=rc, lora=lora)  # fmt: skip
    offset = get_transformer_layer_offset(unwrap(ddp).config)
    tp_rank = ps.get_tensor_model_parallel_rank()
    names = {}
    with torch.no_grad():
        for name, p in unwrap(ddp).named_parameters():
            if is_adapter_param(name):
                g = names[name] = global_name(name, offset)
                p.copy_(full_to_local(adapter_mapping(spec, g)[0], full[g], tp_rank, tp))
    merged = {global_name(n, offset): t.clone() for n, t in merged_weights(ddp).items()}
    # What the rollout engine receives: the reshard's HF tensors, gathered over TP and PP (collective).
    streamed = {n: t.clone() for n, t in WeightStreamer(ddp, spec).stream() if n.endswith("proj.weight")}
    logits = forward_outputs(ddp, ids[:, :-1])  # under SP the length must divide over TP
    with adapters_disabled(ddp):
        base_logits = forward_outputs(ddp, ids[:, :-1])

    def step(data_iterator, m):
        x = next(data_iterator)
        inputs, labels = x[:, :-1], x[:, 1:]
        position_ids, mask = attention_inputs(inputs, None)
        per_token = m(inputs, position_ids, mask, labels=labels)
        return per_token, lambda out: (out.float().mean(), {})

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    run_schedule(ddp, step, [ids], ids.shape[1] - 1, ids.shape[0], forward_only=False)
    params = dict(unwrap(ddp).named_parameters())
    grads = {names[n]: p.main_grad.clone() for n, p in params.items() if is_adapter_param(n)}
    before = {n: p.detach().clone() for n, p in params.items()}
    ok, _, _ = optimizer.step()
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if ps.get_data_parallel_rank() != 0:
        return None
    keep = tp_rank == 0
    return {
        "tp_rank": tp_rank,
        "logits": logits if keep else None,
        "base_logits": base_logits if keep else None,
        "grads": grads,
        "merged": merged,
        "streamed": streamed if keep and ps.is_pipeline_first_stage() else None,
        "step_ok": ok,
        "backbone_trainable": sorted(n for n, p in params.items() if p.requires_grad and not is_adapter_param(n)),
        "backbone_changed": sorted(
            n for n, p in params.items() if not is_adapter_param(n) and not torch.equal(p, before[n])
        ),  # fmt: skip
        "adapters_changed": all(not torch.equal(p, before[n]) for n, p in params.items() if is_adapter_param(n)),
        "optimizer_params": len(stepped),
        "adapter_params": sum(is_adapter_param(n) for n in params),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "numel": sum(p.numel() for p in params.values()),
        "trainable_numel": sum(p.numel() for p in params.values() if p.requires_grad),
    }


def _lora_model(load_dir: str, tp: int, pp: int, r: int, alpha: float, targets: list[str], seed: int):
    from mindrl.checkpoint import loading
    from mindrl.models.lora import apply_lora

    spec, _, model = loading.build_and_load(load_dir, tp, pp, "float32")
    apply_lora(model, r, alpha, targets, seed)
    return spec, model


def _adapters(model) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mindrl.models.lora import is_adapter_param
    from mindrl.models.weight_map import global_name

    offset = get_transformer_layer_offset(model.config)
    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "adapters": {
            global_name(n, offset): p.detach().clone() for n, p in model.named_parameters() if is_adapter_param(n)
        },  # fmt: skip
        "backbone": {
            global_name(n, offset): p.detach().clone() for n, p in model.named_parameters() if not is_adapter_param(n)
        },  # fmt: skip
    }


def save_lora(load_dir: str, it_dir: str, tp: int, pp: int, r: int, alpha: float, targets: list[str],
              full: dict[str, torch.Tensor]) -> None:  # fmt: skip
    """The LoRA model at TP x PP, adapters set from `full`, saved with mindrl's dist-checkpoint writer."""
    from megatron.core import parallel_state as ps

    from mindrl.checkpoint.mcore_ckpt import save_model
    from mindrl.models.lora import adapter_mapping, is_adapter_param
    from mindrl.models.weight_map import full_to_local

    spec, model = _lora_model(load_dir, tp, pp, r, alpha, targets, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_param(name):
                g = _global(model, name)
                p.copy_(full_to_local(adapter_mapping(spec, g)[0], full[g], ps.get_tensor_model_parallel_rank(), tp))
    save_model(model, it_dir)


def _global(model, name: str) -> str:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mindrl.models.weight_map import global_name

    return global_name(name, get_transformer_layer_offset(model.config))


def load_lora(load_dir: str, it_dir: str, tp: int, pp: int, r: int, alpha: float, targets: list[str]) -> dict | None:
    """A fresh LoRA model at TP x PP (other adapters: another seed) with `it_dir` loaded: its adapters and backbone by
    global name, on dp rank 0."""
    from mindrl.checkpoint.mcore_ckpt import load_model

    _, model = _lora_model(load_dir, tp, pp, r, alpha, targets, seed=2)
    load_model(model, it_dir)
    out = _adapters(model)
    return out if out["dp_rank"] == 0 else None


def resume_lora(load_dir: str, save_root: str, tp: int, pp: int, ids: torch.Tensor, r: int, alpha: float,
                targets: list[str], ckpt_filter: bool) -> dict | None:  # fmt: skip
    """The trainer's LoRA model (`build_model_and_optimizer`) takes a step on `ids`, saves its train state as the
    trainer does, and takes a second step; a fresh one (other initial adapters) is built from that save and its
    train state loaded, as a resumed actor is, and takes the same second step. Their adapters after it, and the
    backbone's, on dp rank 0 (by local name: the same layout). ckpt_filter: lora_ckpt_filter (the save holds the
    adapters only; the resumed backbone comes from load_dir)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from mindrl.checkpoint import mcore_ckpt
    from mindrl.checkpoint.train_state import load_train_state, save_train_state
    from mindrl.config.settings import LoRASettings, OptimSettings
    from mindrl.models.forward import attention_inputs, run_schedule
    from mindrl.models.lora import is_adapter_param
    from mindrl.models.wrappers import unwrap
    from mindrl.workers.settings import ModelSettings
    from mindrl.workers.train_setup import build_model_and_optimizer

    lora = LoRASettings(lora_target_modules=targets, lora_r=r, lora_alpha=alpha, lora_ckpt_filter=ckpt_filter)
    optim = OptimSettings(lr=1e-2)

    def step(data_iterator, m):
        x = next(data_iterator)
        inputs, labels = x[:, :-1], x[:, 1:]
        position_ids, mask = attention_inputs(inputs, None)
        return m(inputs, position_ids, mask, labels=labels), lambda out: (out.float().mean(), {})

    def train_step(ddp, optimizer, scheduler) -> None:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run_schedule(ddp, step, [ids], ids.shape[1] - 1, ids.shape[0], forward_only=False)
        ok, _, _ = optimizer.step()
        assert ok
        scheduler.step(1)

    def state(ddp) -> dict:
        return {n: p.detach().clone() for n, p in unwrap(ddp).named_parameters()}

    spec, ddp, optimizer, scheduler = build_model_and_optimizer(load_dir, tp, pp, optim, 4, lora=lora, seed=1)
    train_step(ddp, optimizer, scheduler)
    saved = state(ddp)
    it_dir = mcore_ckpt.iteration_dir(save_root, 1)
    if torch.distributed.get_rank() == 0:
        import os

        os.makedirs(it_dir, exist_ok=True)
    torch.distributed.barrier()
    save_train_state(ddp, optimizer, scheduler, spec, "actor", ModelSettings(load_dir, tp, pp, lora=lora), it_dir,
                     True, True)  # fmt: skip
    if torch.distributed.get_rank() == 0:
        mcore_ckpt.write_tracker(save_root, 1)
    torch.distributed.barrier()
    saved_keys = set(dist_checkpointing.load_tensors_metadata(it_dir))
    train_step(ddp, optimizer, scheduler)
    straight = state(ddp)

    _, ddp2, optimizer2, scheduler2 = build_model_and_optimizer(save_root, tp, pp, optim, 4, iteration=1, lora=lora,
                                                                seed=2)  # fmt: skip
    fresh = state(ddp2)
    load_train_state(ddp2, optimizer2, scheduler2, it_dir, True, True)
    train_step(ddp2, optimizer2, scheduler2)
    resumed = state(ddp2)
    if ps.get_data_parallel_rank() != 0:
        return None
    return {
        # built with another seed, it holds the saved adapters: build_and_load loaded them
        "loaded_saved": all(torch.equal(fresh[n], saved[n]) for n in saved),
        "second_step_moved": any(not torch.equal(saved[n], straight[n]) for n in saved if is_adapter_param(n)),
        "adapters_equal": all(torch.equal(resumed[n], straight[n]) for n in straight if is_adapter_param(n)),
        "backbone_equal": all(torch.equal(resumed[n], straight[n]) for n in straight if not is_adapter_param(n)),
        "num_adapters": sum(is_adapter_param(n) for n in straight),
        "saved_backbone": sorted(k for k in saved_keys if ".lora.lora_" not in k),
        "meta": mcore_ckpt.read_model_meta(save_root, 1)[1],
    }


def checkpoint_logits(load_dir: str, tp: int, pp: int, ids: torch.Tensor) -> torch.Tensor | None:
    """Logits of `ids` from the checkpoint as every loader builds it (a LoRA checkpoint with its adapters), at TP x PP;
    on the last stage's first TP rank of dp rank 0."""
    from megatron.core import parallel_state as ps

    from mindrl.checkpoint import loading
    from mindrl.models.forward import forward_outputs

    _, meta, model = loading.build_and_load(load_dir, tp, pp, "float32")
    logits = forward_outputs(model, ids)
    first = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    return logits if first and logits is not None else None
