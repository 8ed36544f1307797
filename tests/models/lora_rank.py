"""Rank functions of tests/models/test_lora.py (importable by the pool's ranks)."""

from __future__ import annotations

import torch


def lora_outputs(load_dir: str, tp: int, pp: int, ids: torch.Tensor, r: int, alpha: float, targets: list[str],
                 full: dict[str, torch.Tensor]) -> dict | None:  # fmt: skip
    """This rank's LoRA model (the checkpoint at TP x PP, adapters set from the whole matrices `full`): logits with
    and without the adapters, and the adapters' grads of the mean next-token cross entropy of `ids`. dp rank 0 only."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mindrl.checkpoint import loading
    from mindrl.models.forward import attention_inputs, forward_outputs, run_schedule
    from mindrl.models.lora import adapter_mapping, adapters_disabled, apply_lora, is_adapter_param
    from mindrl.models.weight_map import full_to_local, global_name

    spec, _, model = loading.build_and_load(load_dir, tp, pp, "float32")
    apply_lora(model, r, alpha, targets)
    offset = get_transformer_layer_offset(model.config)
    tp_rank = ps.get_tensor_model_parallel_rank()
    names = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_param(name):
                g = names[name] = global_name(name, offset)
                p.copy_(full_to_local(adapter_mapping(spec, g)[0], full[g], tp_rank, tp))
    logits = forward_outputs(model, ids)
    with adapters_disabled(model):
        base_logits = forward_outputs(model, ids)

    def step(data_iterator, m):
        x = next(data_iterator)
        inputs, labels = x[:, :-1], x[:, 1:]
        position_ids, mask = attention_inputs(inputs, None)
        per_token = m(inputs, position_ids, mask, labels=labels)
        return per_token, lambda out: (out.float().mean(), {})

    run_schedule(model, step, [ids], ids.shape[1] - 1, ids.shape[0], forward_only=False)
    grads = {names[n]: p.grad.clone() for n, p in model.named_parameters() if is_adapter_param(n)}
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad and not is_adapter_param(n))
    backbone_grads = sorted(n for n, p in model.named_parameters() if p.grad is not None and not is_adapter_param(n))
    if ps.get_data_parallel_rank() != 0:
        return None
    keep = tp_rank == 0
    return {
        "tp_rank": tp_rank,
        "logits": logits if keep else None,
        "base_logits": base_logits if keep else None,
        "grads": grads,
        "backbone_trainable": trainable,
        "backbone_grads": backbone_grads,
    }
