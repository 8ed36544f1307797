"""The plan of an offline preference run (`stage: dpo`, mindrl-train-dpo): training only, no rollout engine. The policy
computes the reference's log-probabilities in one forward pass before the first step ('score'), then trains ('train')."""

from __future__ import annotations

import mindrl.plan.memory as mem
from mindrl.config.settings import RecomputeSettings
from mindrl.config.sft import SFTConfig
from mindrl.plan import planner
from mindrl.plan.devices import pick_device
from mindrl.plan.params import PlanError, stage_params, total_params

PHASES = ("score", "train")


def make_dpo_plan(
    cfg: SFTConfig,
    device: str | None = None,
    device_memory_gib: float | None = None,
    devices_per_node: int | None = None,
) -> planner.Plan:
    """The plan of a loaded DPO config (`mindrl.preflight.load_dpo_config`) on `device` (as `mindrl.plan.make_plan`).
    A pair is two sequences of up to seq_length tokens: a micro-batch of micro_batch_size pairs runs 2 x that many
    rows."""
    mt, arch = cfg.megatron_training, cfg.model
    if arch is None:
        raise PlanError("megatron_training.model is not set: the planner needs the architecture (a model file)")
    tp, pp, world = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size, mt.world_size
    dev, why = pick_device(world, cfg.config_name, device, device_memory_gib, devices_per_node)
    dp, seq, rows = mt.dp, mt.seq_length, 2 * mt.micro_batch_size
    recompute = RecomputeSettings(
        **{k: getattr(mt, k) for k in RecomputeSettings.__dataclass_fields__}  # the same four keys
    )
    per_stage = [stage_params(arch, "actor", tp, pp, s) for s in range(pp)]
    lay = planner.ModelLayout(
        role="actor", tp=tp, pp=pp, dp=dp, vpp=1, sequence_parallel=mt.sequence_parallel and tp > 1,
        micro_batch_size=mt.micro_batch_size, forward_micro_batch_size=mt.micro_batch_size,
        micro_batches_per_step=mt.global_batch_size // (dp * mt.micro_batch_size), update_shape=(seq, rows),
        forward_shape=(seq, rows), packed=False, token_budget=None,
        distributed_optimizer=mt.use_distributed_optimizer,
        dtype=mt.dtype, params_total=total_params(arch), params_per_stage=[p.total for p in per_stage],
        recompute=recompute, expert_params_per_stage=[p.experts for p in per_stage],
    )  # fmt: skip
    placement = [
        planner.DeviceSlot(i, i // dev.per_node, i % dev.per_node, planner.rank_coords(i, tp, pp, world), None, None)
        for i in range(world)
    ]
    plan = planner.Plan(
        cfg.config_name, cfg.source, dev, why, world, seq, {"actor": lay}, None, placement, {}, 0, {}, {}
    )
    best = None
    for stage in range(pp):  # devices of one stage hold the same bytes
        memory = _stage_memory(plan, cfg, lay, stage)
        if best is None or max(memory["total"].values()) > max(best["total"].values()):
            best, plan.peak_device = memory, next(s.device for s in placement if s.actor[1] == stage)
    plan.memory = best
    plan.verdict = planner.verdict(cfg, plan, best, plan.layouts, fix=_fix)
    ref = "mt.ref_model, built at the policy's layout and dropped after it" if mt.separate_reference else "the policy"
    plan.notes += [
        f"training only (stage: dpo): no rollout engine; the reference log-probabilities are one forward pass of {ref} "
        "over the data before the first step (phase 'score')",
        f"a global batch of {mt.global_batch_size} pairs: {lay.micro_batches_per_step} micro-batches of "
        f"{mt.micro_batch_size} pair(s) ({rows} sequences of up to {seq} tokens) per DP rank",
    ]
    if getattr(mt, "world_size_from_layout", False):
        plan.notes.append(f"no world_size in the config: {world} devices, TP x PP (DP 1)")
    return plan


def _stage_memory(plan: planner.Plan, cfg: SFTConfig, lay: planner.ModelLayout, stage: int) -> dict:
    mt, arch, dev = cfg.megatron_training, cfg.model, plan.device
    e = mem.DTYPE_BYTES[lay.dtype]
    state = planner._state(lay, stage)
    s, b = lay.forward_shape
    # the reference pass: forward only, the logits of its last stage (the policy's optimizer is built already)
    forward = mem.forward_bytes(arch, "actor", s, b, lay.tp, e) if stage == lay.pp - 1 else 0
    out: dict[str, dict[str, dict[str, int]]] = {"actor": {}}
    if mt.separate_reference:
        out["actor"]["score"] = dict(state)
        out["reference"] = {"score": {"weights_bytes": state["weights_bytes"], "activations_bytes": forward}}
    else:
        out["actor"]["score"] = {**state, "activations_bytes": forward}
    out["actor"]["train"] = {**state, **planner._update_acts(lay, arch, stage, dev)}
    out["total"] = {f"{p}_bytes": planner._phase_total(out, p) for p in PHASES}
    return out


def _fix(cfg: SFTConfig, role: str, phase: str, term: str, layouts: dict, kv_by_utilization: bool) -> str:
    """The key that would shrink `role.phase.term` of a DPO run."""
    lay, arch = layouts["actor"], cfg.model
    if term == "activations_bytes":
        if lay.micro_batch_size > 1:
            return "megatron_training.micro_batch_size (lower it)"
        if phase == "score":
            return "megatron_training.tensor_model_parallel_size (raise it: the logits split over TP)"
        if lay.tp > 1 and not lay.sequence_parallel:
            return "megatron_training.sequence_parallel: true"
        if lay.recompute.recompute_granularity != "full":
            return "megatron_training.recompute_granularity: full (recompute_method: uniform, recompute_num_layers: 1)"
        if arch.num_kv_heads % (2 * lay.tp) == 0:
            return "megatron_training.tensor_model_parallel_size (raise it), or a shorter seq_length"
        return "megatron_training.seq_length (lower it): every layer is recomputed already"
    if term == "optimizer_bytes" and not lay.distributed_optimizer:
        return "megatron_training.use_distributed_optimizer: true"
    if term == "optimizer_bytes" and lay.dp == 1:
        return "megatron_training.world_size (raise it: the distributed optimizer shards over DP)"
    return "megatron_training.tensor_model_parallel_size or pipeline_model_parallel_size (raise it)"
