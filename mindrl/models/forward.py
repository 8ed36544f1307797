"""Forward passes through a (TP, PP) megatron model with megatron's pipeline schedule: full-vocabulary logits (actor) or
per-token values (critic) on the last stage, None elsewhere; padding is `attention_mask` (b, s), 1 = real token."""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)

from mindrl.models.attention import PrefixGroups, mark_prefix_groups


def attention_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """(position_ids, megatron boolean mask [b,1,s,s] with True = masked) for left/right-padded rows."""
    b, s = input_ids.shape
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=input_ids.device), diagonal=1)
    if attention_mask is None:
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        return position_ids, causal.view(1, 1, s, s).expand(b, 1, s, s)
    valid = attention_mask.bool()
    position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)
    mask = causal.view(1, 1, s, s) | ~valid.view(b, 1, 1, s)
    # Fully masked rows (padding queries) would softmax over nothing: let them see themselves.
    mask = mask & ~torch.eye(s, dtype=torch.bool, device=input_ids.device).view(1, 1, s, s)
    return position_ids, mask


def prefix_group_inputs(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
):
    """(input_ids [G, s], position_ids, marked mask [G, 1, s, s], layout) of G prompts (ids and attention mask [G, P],
    left-padded) each followed by its samples' responses (ids and attention mask [G * n, R], right-padded, the
    samples of prompt i in rows i * n ... i * n + n - 1), packed as `PrefixGroups`. A query sees the real keys at or
    before its position in its own row (the prompt, and its own response), and itself: the rows' unpacked masks
    (`attention_inputs`) in the packed layout."""
    groups, p = prompt_ids.shape
    n, r = response_ids.shape[0] // groups, response_ids.shape[1]
    if groups * n != response_ids.shape[0] or n < 1:
        raise ValueError(f"{response_ids.shape[0]} responses do not split into {groups} prompts' samples")
    layout = PrefixGroups(p, n, r)
    device = prompt_ids.device
    ids = torch.cat([prompt_ids, response_ids.reshape(groups, n * r)], 1)
    valid = torch.cat([prompt_mask, response_mask.reshape(groups, n * r)], 1).bool()
    pos, seg = layout.positions(device), layout.segments(device)
    seen = (pos.view(1, -1) <= pos.view(-1, 1)) & ((seg.view(1, -1) == seg.view(-1, 1)) | (seg.view(1, -1) < 0))
    s = layout.width
    mask = ~(seen.view(1, 1, s, s) & valid.view(groups, 1, 1, s))
    mask &= ~torch.eye(s, dtype=torch.bool, device=device).view(1, 1, s, s)
    prompt_count = prompt_mask.long().sum(1, keepdim=True)
    response_pos = prompt_count.repeat_interleave(n, 0) + response_mask.long().cumsum(1) - 1
    position_ids = torch.cat([(prompt_mask.long().cumsum(1) - 1).clamp(min=0), response_pos.reshape(groups, n * r)], 1)
    return ids, position_ids.clamp(min=0), mark_prefix_groups(mask, layout), layout


def moe_padding(model: torch.nn.Module, padding: torch.Tensor) -> dict:
    """The keyword that tells a MoE model's routers which columns of its input [b, s] are padding (`padding`, True
    there): megatron's padding_mask, which its load-balancing and z losses and the expert bias's token counts leave
    out, so that they count the real tokens only, whatever padding a layout adds (pipeline parallelism pads every
    micro-batch to one shape, sequence parallelism to a multiple of TP). Nothing for a dense model."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    if not config.num_moe_experts:
        return {}
    if config.sequence_parallel and not ps.is_pipeline_first_stage():
        # megatron cuts the mask for sequence parallelism beside the embedding, on the first stage only
        padding = scatter_to_sequence_parallel_region(padding.t().contiguous()).t()
    return {"padding_mask": padding}


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a (wrapped) model computes on: its parameters' (`mindrl.models.builder.build_model` put them on
    the rank's device). Inputs go there; results come back to the host for the caller."""
    return next(model.parameters()).device


def _forward_step(data_iterator, model, gather_vocab: bool):
    input_ids, attention_mask = next(data_iterator)
    device = model_device(model)
    input_ids = input_ids.to(device)
    attention_mask = None if attention_mask is None else attention_mask.to(device)
    position_ids, mask = attention_inputs(input_ids, attention_mask)
    moe = {} if attention_mask is None else moe_padding(model, ~attention_mask.bool())
    output = model(input_ids, position_ids, mask, **moe)

    def collect(output_tensor, non_loss_data=True):
        if gather_vocab:
            output_tensor = gather_from_tensor_model_parallel_region(output_tensor)
        return output_tensor.detach().clone()

    return output, collect


def run_schedule(
    model: torch.nn.Module,
    step_fn,
    micro: list,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    collect: bool = False,
) -> list:
    """megatron's schedule of `model` over the micro-batches `micro` (seq_length and micro_batch_size size the
    pipeline's P2P buffers); collect: return step_fn's non-loss outputs."""
    return get_forward_backward_func()(
        forward_step_func=step_fn,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=len(micro),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        collect_non_loss_data=collect,
    )


@torch.no_grad()
def forward_outputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    micro_batch_size: int | None = None,
) -> torch.Tensor | None:
    """Logits (b, s, vocab) for an actor, values (b, s) for a critic, on the host; None off the last PP stage."""
    b, s = input_ids.shape
    mbs = micro_batch_size or b
    if b % mbs:
        raise ValueError(f"batch {b} is not divisible by micro_batch_size {mbs}")
    critic = getattr(model, "mindrl_role", "actor") == "critic"
    chunks = [
        (input_ids[i : i + mbs], None if attention_mask is None else attention_mask[i : i + mbs])
        for i in range(0, b, mbs)
    ]
    was_training = model.training
    model.eval()
    try:
        step = partial(_forward_step, gather_vocab=not critic)
        outputs = run_schedule(model, step, chunks, s, mbs, forward_only=True, collect=True)
    finally:
        model.train(was_training)
    if not ps.is_pipeline_last_stage():
        return None
    out = torch.cat(outputs, dim=0).cpu()
    return out.squeeze(-1) if critic else out
