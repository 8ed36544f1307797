"""Mixture-of-experts pieces around megatron-core's own MoE layer: the router's probabilities in fp64 when the model
runs in fp64, so that the logits check (`mindrl.checkpoint.convert.check`) compares two exact forwards; the router's
load-balancing loss as megatron tracks it, for the trainer's metrics."""

from __future__ import annotations

import functools
import sys

import torch

_ROUTER_MODULE = "megatron.core.transformer.moe.router"


def _fp64_softmax_routing(original, logits: torch.Tensor, topk: int, *args, **kwargs):
    """megatron's top-k routing, with the probabilities of an fp64 softmax or sigmoid router recomputed in fp64
    (megatron takes that softmax / sigmoid in fp32 whatever the dtype): the experts chosen are megatron's own."""
    probs, routing_map = original(logits, topk, *args, **kwargs)
    options = dict(zip(("use_pre_softmax", "num_groups", "group_topk", "scaling_factor", "score_function"), args))
    options.update(kwargs)
    score_function = options.get("score_function", "softmax")
    if logits.dtype != torch.float64 or score_function not in ("softmax", "sigmoid"):
        return probs, routing_map
    if score_function == "sigmoid":  # the chosen experts' scores, renormalised when k > 1 (as megatron does)
        exact = torch.sigmoid(logits) * routing_map
        if topk > 1:
            exact = exact / (exact.sum(dim=-1, keepdim=True) + 1e-20)
    elif options.get("use_pre_softmax"):
        exact = torch.softmax(logits, dim=-1) * routing_map
    else:  # the softmax over each token's selected logits only
        exact = torch.softmax(logits.masked_fill(~routing_map, float("-inf")), dim=-1)
    if options.get("scaling_factor"):
        exact = exact * options["scaling_factor"]
    return exact, routing_map


def install_fp64_routing() -> None:
    """Route fp64 models with fp64 probabilities (idempotent; other dtypes are routed by megatron unchanged)."""
    import megatron.core.transformer.moe.router  # noqa: F401

    router = sys.modules[_ROUTER_MODULE]
    original = router.topk_routing_with_score_function
    if getattr(original, "mindrl_fp64", False):
        return
    routing = functools.partial(_fp64_softmax_routing, original)
    routing.mindrl_fp64 = True
    router.topk_routing_with_score_function = routing


def take_load_balancing_loss() -> float:
    """The load-balancing loss megatron tracked on this rank since the last call, summed over its MoE layers and
    micro-batches (unweighted by moe_aux_loss_coeff; under sequence or context parallelism this rank's share of
    it), then cleared. 0.0 for a dense model or without a load-balancing loss."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    total = 0.0
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        if name.endswith("load_balancing_loss"):
            total += float(entry["values"].sum())
        entry["values"].zero_()
    return total
