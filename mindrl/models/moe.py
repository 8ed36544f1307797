"""Mixture-of-experts pieces around megatron-core's own MoE layer: the router's probabilities in fp64 when the model
runs in fp64, so that the logits check (`mindrl.checkpoint.convert.check`) compares two exact forwards; the router's
load-balancing loss as megatron tracks it, and the tokens each expert was sent, for the trainer's metrics."""

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


def _apply_expert_bias(router, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
    """megatron-core 0.16's TopKRouter._apply_expert_bias with the padding mask ([tokens], True on padding) taken
    per token: megatron's own ANDs it with the [tokens, experts] routing map as is, which fails to broadcast (or,
    with as many tokens as experts, masks experts instead of tokens)."""
    if router.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            router.local_tokens_per_expert += routing_map.sum(dim=0)


def install_router_padding_fix() -> None:
    """Count the expert bias's tokens without padding (`_apply_expert_bias`; idempotent)."""
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter._apply_expert_bias = _apply_expert_bias


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


class ExpertLoad:
    """Counts the tokens each router of `model` (megatron's TopKRouter modules) sends to each expert, by global
    layer, from install until `close`: a forward hook on every router. A forward re-run by activation recompute in
    the backward pass is not counted again."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._handles = [m.register_forward_hook(self._count) for m in model.modules() if isinstance(m, TopKRouter)]

    def _count(self, router, args, output) -> None:
        if torch._C._current_graph_task_id() != -1:  # inside backward: a recompute of a forward already counted
            return
        routing_map = output[1]
        padding = args[1] if len(args) > 1 else None  # [s, b] True on padding (megatron's MoE layer passes it)
        if padding is not None:
            routing_map = routing_map & ~padding.reshape(-1, 1)
        self.counts[router.layer_number - 1] += routing_map.sum(dim=0).to(device="cpu", dtype=torch.float64)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def expert_load_metrics(counts: torch.Tensor, prefix: str) -> dict[str, float]:
    """min / max / std over every MoE layer's experts of each expert's tokens over its even share of the layer's
    (1.0: a balanced router; counts: (layers, experts), all ranks' tokens; layers that routed nothing are not MoE
    layers or held no tokens). Empty when nothing was routed."""
    counts = counts[counts.sum(dim=1) > 0]
    if not counts.numel():
        return {}
    load = counts * counts.shape[1] / counts.sum(dim=1, keepdim=True)
    return {
        f"{prefix}/moe_expert_load_min": float(load.min()),
        f"{prefix}/moe_expert_load_max": float(load.max()),
        f"{prefix}/moe_expert_load_std": float(load.std(correction=0)),
    }


# ------------------------------------------------------------------------------------------------ routing replay
def moe_routers(model: torch.nn.Module) -> list:
    """The model's routers (megatron's TopKRouter modules) by layer, each with megatron's `RouterReplay` (built here
    where the config did not ask for it: megatron reads `router.router_replay` at every routing)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    routers = sorted((m for m in model.modules() if isinstance(m, TopKRouter)), key=lambda r: r.layer_number)
    for r in routers:
        if r.router_replay is None:
            r.router_replay = RouterReplay()
            RouterReplay.global_router_replay_instances.remove(r.router_replay)  # mindrl addresses its own routers
    return routers


class RoutingReplay:
    """megatron's router replay on `model`'s routers for the duration of a `with`: `record` keeps each forward's
    top-k choices (`recorded()`), `replay` routes by the choices given to `set_targets` instead of the router's own,
    the routing weights still the router's scores of those experts. A replayed forward also counts how many of the
    given choices the router would have made itself (`agreement`: (matching choices, choices), over real tokens)."""

    def __init__(self, model: torch.nn.Module, mode: str):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.routers = moe_routers(model)
        self.action = {"record": RouterReplayAction.RECORD, "replay": RouterReplayAction.REPLAY_FORWARD}[mode]
        self.agreement = torch.zeros(2, dtype=torch.float64)
        self._handles = []

    def __enter__(self) -> RoutingReplay:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self.routers:
            r.router_replay.clear_indices()
            r.router_replay.set_router_replay_action(self.action)
            if self.action == RouterReplayAction.REPLAY_FORWARD:
                self._handles.append(r.register_forward_hook(self._agree))
        return self

    def __exit__(self, *exc) -> None:
        for r in self.routers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()
        for h in self._handles:
            h.remove()
        self._handles = []

    def recorded(self) -> torch.Tensor:
        """[tokens, layers, k] the last forward's choices, tokens in the routers' order (sequence-major)."""
        return torch.stack([r.router_replay.get_recorded_indices() for r in self.routers], 1)

    def set_targets(self, choices: torch.Tensor) -> None:
        """choices: [tokens, layers, k] for the next forward, tokens in the routers' order."""
        for i, r in enumerate(self.routers):
            r.router_replay.clear_indices()
            r.router_replay.set_target_indices(choices[:, i].contiguous())

    def _agree(self, router, args, output) -> None:
        if torch._C._current_graph_task_id() != -1:  # a recompute in the backward pass
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = router.router_replay
        with torch.no_grad():
            replay.set_router_replay_action(RouterReplayAction.RECORD)  # the router's own choice, nothing else
            try:
                logits = router.gating(args[0]).view(-1, router.config.num_moe_experts)
                mod = sys.modules[_ROUTER_MODULE]
                _, own = mod.topk_routing_with_score_function(
                    logits, router.topk, use_pre_softmax=router.config.moe_router_pre_softmax,
                    num_groups=router.config.moe_router_num_groups, group_topk=router.config.moe_router_group_topk,
                    scaling_factor=router.config.moe_router_topk_scaling_factor, score_function=router.score_function,
                    expert_bias=router.expert_bias, router_replay=None,
                )  # fmt: skip
            finally:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            given = output[1]
            padding = args[1] if len(args) > 1 else None
            real = torch.ones(given.shape[0], dtype=torch.bool, device=given.device)
            if padding is not None:
                real = ~padding.reshape(-1)
            self.agreement += torch.tensor(
                [float((own & given)[real].sum()), float(given[real].sum())], dtype=torch.float64
            )
