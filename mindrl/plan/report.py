"""The plan as text for people and as one JSON object (`--json`) for scripts: memory.<role>.<phase>.<term> in
bytes, plus the layouts, placement, KV cache and verdict."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from mindrl.plan.planner import ModelLayout, Plan

GIB = float(1 << 30)


def to_json(plan: Plan) -> dict[str, Any]:
    return {
        "config_name": plan.config_name,
        "source": plan.source,
        "device": {**asdict(plan.device), "chosen_by": plan.device_why},
        "world_size": plan.world,
        "train_seq_len": plan.train_seq_len,
        "layouts": {role: asdict(lay) for role, lay in plan.layouts.items()},
        "rollout": None if plan.rollout is None else asdict(plan.rollout),
        "placement": [asdict(s) for s in plan.placement],
        "memory": plan.memory,
        "peak_device": plan.peak_device,
        "kv_cache": plan.kv_cache,
        "residency": plan.residency,
        "verdict": plan.verdict,
        "notes": plan.notes,
        **({"groups": [asdict(g) for g in plan.groups]} if plan.groups else {}),
    }


def _size(n: int) -> str:
    """Bytes in the largest unit that keeps the number >= 1 (B, KiB, MiB, GiB)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2.0**20), ("KiB", 1024.0)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _ranges(values: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def _placement_lines(plan: Plan) -> list[str]:
    lines = []
    for node in sorted({s.node for s in plan.placement}):
        slots = [s for s in plan.placement if s.node == node]
        lines.append(
            f"  node {node}: devices {_ranges([s.local for s in slots])} (global {_ranges([s.device for s in slots])})"
        )
        for s in slots:
            a = f"actor+ref rank {s.device:>3} ({_coords(s.actor)})"
            c = "" if s.critic is None else f" | critic rank {s.device:>3} ({_coords(s.critic)})"
            e = "" if s.engine is None else f" | engine {s.engine[0]} tp {s.engine[1]}"
            lines.append(f"    dev {s.local:>2}: {a}{c}{e}")
    return lines


def _coords(c: tuple[int, ...]) -> str:
    """(tp, pp, dp[, cp]) ranks as text."""
    return f"tp {c[0]} pp {c[1]} dp {c[2]}" + (f" cp {c[3]}" if len(c) > 3 else "")


def _micro(lay: ModelLayout) -> str:
    """An update's micro-batches: rows of the longest sequence, or a packed row / a token budget's rows."""
    (s, b), (fs, fb) = lay.update_shape, lay.forward_shape
    if not lay.packed and lay.token_budget is None:
        return f"mbs {lay.micro_batch_size} x {lay.micro_batches_per_step} per step (fwd mbs {lay.forward_micro_batch_size})"
    how = "packed " if lay.packed else ""
    return (f"{how}micro-batches of {b} x {s} tokens x {lay.micro_batches_per_step} per step (fwd {fb} x {fs}"
            f"{', token budget' if lay.token_budget is not None else ''})")  # fmt: skip


def to_text(plan: Plan) -> str:
    d, v = plan.device, plan.verdict
    lines = [
        f"mindrl-plan: {plan.config_name} ({plan.source})",
        f"device: {d.name}, {d.memory_bytes / GIB:.1f} GiB each, {d.per_node} per node ({plan.device_why}); "
        f"{plan.world} devices on {-(-plan.world // d.per_node)} node(s)",
        f"training sequence: up to {plan.train_seq_len} tokens "
        + (
            "(max_prompt_length + max_tokens, or + max_total_response_length with multi_turn_enable)"
            if plan.rollout
            else "(seq_length, each sequence of a pair)"
        ),
        "",
        "layouts",
    ]
    for role, lay in plan.layouts.items():
        opt = "distributed" if lay.distributed_optimizer else "replicated"
        lines.append(
            f"  {role + ('+reference' if role == 'actor' and 'reference' not in plan.layouts else ''):<16} TP {lay.tp} PP {lay.pp} "
            f"{f'CP {lay.cp} ' if lay.cp > 1 else ''}DP {lay.dp} VPP {lay.vpp} "
            f"SP {'on' if lay.sequence_parallel else 'off'}  {lay.dtype}  {_micro(lay)}  optimizer {opt}  "
            f"{lay.params_total / 1e9:.3f} B params, {max(lay.params_per_stage) / 1e9:.3f} B per rank"
            + _recompute_text(lay.recompute)
        )
    r = plan.rollout
    if r is not None:
        lines.append(
            f"  {'rollout engine':<16} infer TP {r.infer_tp} x {r.replicas} replicas  {r.dtype}  max_model_len "
            f"{r.max_model_len}  max_num_seqs {r.max_num_seqs}  {r.params_per_rank / 1e9:.3f} B params per rank"
        )
    if plan.groups:
        lines += ["", *_group_lines(plan)]
    else:
        fill = "Ray fills" if plan.rollout is not None else "the ranks fill"
        lines += ["", f"placement ({fill} a node's devices before the next)", *_placement_lines(plan), ""]
        lines += _memory_lines(plan.memory, f"device {plan.peak_device}, the highest peak")
        res = "; ".join(
            f"{role}: " + ", ".join(f"{p} {s}" for p, s in v_.items()) for role, v_ in plan.residency.items()
        )
        if res:
            lines.append(f"  residency: {res}")
    kv = plan.kv_cache
    lines.append("")
    if r is not None:
        lines += [
            f"KV cache: {_size(kv['budget_bytes'])} per device, {_size(kv['bytes_per_token'])} per token "
            f"-> {kv['sequences_at_max_len']} concurrent sequences of {r.max_model_len} tokens per engine "
            f"(max_num_seqs {kv['max_num_seqs']})",
            "",
        ]
    verdict = "FITS" if v["fits"] else "DOES NOT FIT"
    where = f" (tightest group: {v['group']})" if plan.groups else ""
    lines.append(
        f"verdict: {verdict}{where}: peak {_size(v['peak_bytes'])} in phase '{v['peak_phase']}' of "
        f"{_size(v['device_memory_bytes'])} (headroom {_size(v['headroom_bytes'])})"
    )
    lines.append(f"  largest term: {v['largest_term']} = {_size(v['largest_term_bytes'])}; to shrink it: {v['fix']}")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _group_lines(plan: Plan) -> list[str]:
    """Separate placement: each device group's devices, roles and memory (its most loaded device)."""
    lines = [f"separate placement (use_integrated_worker: false): {len(plan.groups)} device groups"]
    for g in plan.groups:
        merged = f" + {', '.join(g.roles[1:])} (merged)" if len(g.roles) > 1 else ""
        lines.append(
            f"  devices {_ranges(g.devices)} (node {_ranges(g.nodes)}): {g.roles[0]}{merged}  [{g.resource_key}]"
        )
    for g in plan.groups:
        fits = "fits" if g.verdict["fits"] else "DOES NOT FIT"
        lines += ["", f"group {'+'.join(g.roles)}: {fits}, peak {_size(g.verdict['peak_bytes'])} in "
                  f"'{g.verdict['peak_phase']}' (largest term {g.verdict['largest_term']})"]  # fmt: skip
        lines += _memory_lines(g.memory, f"device {g.peak_device}, the group's highest peak")
        if g.residency:
            res = "; ".join(
                f"{role}: " + ", ".join(f"{p} {s}" for p, s in v_.items()) for role, v_ in g.residency.items()
            )
            lines.append(f"  residency: {res}")
    return lines


def _memory_lines(mem: dict, which: str) -> list[str]:
    lines = []
    phases = [p.removesuffix("_bytes") for p in mem["total"]]
    unit, scale = ("GiB", GIB) if max(mem["total"].values()) >= 8 * GIB else ("MiB", 2.0**20)
    lines.append(f"memory per device in {unit} ({which})")
    lines.append(f"  {'role.term':<36}" + "".join(f"{p:>13}" for p in phases))
    for role, by_phase in mem.items():
        if role == "total":
            continue
        terms = []
        for p in phases:
            terms += [t for t in by_phase.get(p, {}) if t not in terms]
        for t in terms:
            cells = "".join(
                f"{by_phase[p][t] / scale:>13.2f}" if t in by_phase.get(p, {}) else f"{'-':>13}" for p in phases
            )
            label = f"{role}.{t.removesuffix('_bytes')}" + (" (alt.)" if "recompute" in t else "")
            lines.append(f"  {label:<36}{cells}")
    lines.append(f"  {'total':<36}" + "".join(f"{mem['total'][p + '_bytes'] / scale:>13.2f}" for p in phases))
    return lines


def _recompute_text(rc) -> str:
    """The layout's activation recomputation, for its line (nothing when there is none)."""
    parts = (
        [
            f"{rc.recompute_granularity}"
            + (f" {rc.recompute_method} {rc.recompute_num_layers}" if rc.recompute_method else "")
        ]
        if rc.recompute_granularity
        else []
    )
    parts += ["activation function"] if rc.recompute_activation_function else []
    return f"  recompute {' + '.join(parts)}" if parts else ""
