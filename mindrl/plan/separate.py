"""The plan of separate placement (`use_integrated_worker: false`): each device group (a role on its own devices, with
the roles merged onto it) sized like an integrated device holding only those roles; `make_plan` picks the mode."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mindrl.config.placement import DeviceGroup, device_groups
from mindrl.config.root import RLConfig
from mindrl.plan import planner
from mindrl.plan.devices import pick_device
from mindrl.plan.params import stage_params
from mindrl.resharding.residency import PLAN_PHASES
from mindrl.workers import from_config


@dataclass
class GroupPlan:
    """One device group: its devices (global indices), the memory of its most loaded device by role and phase
    (plus 'total'), that device, and the group's verdict."""

    roles: tuple[str, ...]
    resource_key: str
    devices: list[int]
    nodes: list[int]
    memory: dict[str, dict[str, dict[str, int]]]
    peak_device: int
    residency: dict[str, dict[str, str]]
    verdict: dict[str, object] = field(default_factory=dict)


def make_plan(
    cfg: RLConfig,
    device: str | None = None,
    device_memory_gib: float | None = None,
    devices_per_node: int | None = None,
) -> planner.Plan:
    """The plan of `cfg` in either mode (integrated: mindrl.plan.planner.make_plan). Separate placement: the
    Plan's `groups` hold each device group; its memory, peak device and verdict are the tightest group's."""
    if not isinstance(cfg, RLConfig):  # a stage: dpo config (mindrl.preflight.load_dpo_config): training only
        from mindrl.plan.offline import make_dpo_plan

        return make_dpo_plan(cfg, device, device_memory_gib, devices_per_node)
    rl, gen = cfg.rl_config, cfg.generate_config
    if rl.use_integrated_worker:
        return planner.make_plan(cfg, device, device_memory_gib, devices_per_node)
    has_ref = from_config.needs_reference(cfg)
    has_critic = rl.needs_critic and cfg.critic_config is not None
    has_reward = cfg.reward_config is not None and cfg.reward_model is not None
    groups = device_groups(rl, has_ref, has_critic, has_reward)
    total = sum(g.size for g in groups)
    dev, why = pick_device(total, cfg.config_name, device, device_memory_gib, devices_per_node)
    size = {role: g.size for g in groups for role in g.roles}
    layouts = {"actor": planner._layout(cfg, "actor", size["actor"])}
    if has_ref and not rl.colocate_actor_ref:
        layouts["reference"] = replace(planner._layout(cfg, "actor", size["reference"]), role="reference")
    if has_critic:
        layouts["critic"] = planner._layout(cfg, "critic", size["critic"])
    itp = gen.infer_tensor_parallel_size
    rollout = planner.RolloutLayout(itp, size["rollout"] // itp, gen.dtype, gen.max_model_len, gen.max_num_seqs,
                                    stage_params(cfg.model, "actor", itp, 1, 0).total)  # fmt: skip
    seq = cfg.sequence_length
    plan = planner.Plan(cfg.config_name, cfg.source, dev, why, total, seq, layouts, rollout, [], {}, 0, {}, {})
    plan.groups = [_group_plan(plan, cfg, g, has_ref) for g in groups]
    worst = min(plan.groups, key=lambda g: g.verdict["headroom_bytes"])
    plan.memory, plan.peak_device, plan.residency = worst.memory, worst.peak_device, worst.residency
    plan.verdict = {**worst.verdict, "fits": all(g.verdict["fits"] for g in plan.groups),
                    "group": "+".join(worst.roles)}  # fmt: skip
    engines = next(g for g in plan.groups if "rollout" in g.roles)
    per_token = planner.mem.kv_bytes_per_token(cfg.model, itp, planner.mem.DTYPE_BYTES[gen.dtype])
    budget = engines.memory["rollout"]["rollout"]["kv_cache_bytes"]
    plan.kv_cache = {
        "budget_bytes": budget,
        "bytes_per_token": per_token,
        "sequences_at_max_len": planner.mem.sequences_in_cache(budget, gen.max_model_len, per_token),
        "max_num_seqs": gen.max_num_seqs,
    }
    if dev.kv_by_utilization and gen.kv_cache_memory_gib is None and budget == 0:
        plan.verdict["fits"] = False
        plan.notes.append(
            "the engine's weights and step activations exceed generate_config.gpu_memory_utilization x device "
            "memory: no room for a KV cache (raise gpu_memory_utilization or infer_tensor_parallel_size)"
        )
    if 0 < plan.kv_cache["sequences_at_max_len"] < gen.max_num_seqs:
        plan.notes.append(
            f"the KV cache holds {plan.kv_cache['sequences_at_max_len']} sequences of max_model_len at once, fewer "
            f"than max_num_seqs={gen.max_num_seqs}: vLLM queues (or preempts) the rest"
        )
    if not has_ref:
        plan.notes.append("no reference model: the config has no KL term (init_kl_coef 0)")
    return plan


def _group_plan(plan: planner.Plan, cfg: RLConfig, g: DeviceGroup, has_ref: bool) -> GroupPlan:
    """Memory of every device of `g` with only its roles counted; the most loaded one is kept."""
    lays = plan.layouts
    trunk = lays["reference"] if g.roles[0] == "reference" else lays["actor"]  # the actor-shaped model here
    local_layouts = {"actor": trunk, **({"critic": lays["critic"]} if "critic" in g.roles else {})}
    # An engine on devices of its own never has to sleep: nothing else needs its memory.
    dev = plan.device if "actor" in g.roles else replace(plan.device, sleep_mode=False)
    gp = replace(plan, world=g.size, layouts=local_layouts, device=dev)
    sched = from_config.residency(cfg)
    best, best_j = None, 0
    for j in range(g.size):
        c = local_layouts.get("critic")
        slot = planner.DeviceSlot(
            device=j, node=0, local=j,
            actor=planner.rank_coords(j, trunk.tp, trunk.pp, g.size, trunk.cp) if g.size % (trunk.tp * trunk.pp * trunk.cp) == 0 else (0, 0, 0),
            critic=None if c is None else planner.rank_coords(j, c.tp, c.pp, g.size, c.cp),
            engine=(j // plan.rollout.infer_tp, j % plan.rollout.infer_tp),
        )  # fmt: skip
        full = planner._device_memory(gp, cfg, slot, has_ref and "reference" in g.roles)
        memory = {role: full[role] for role in g.roles if role in full}
        phases = [p for p in PLAN_PHASES if any(p in v for v in memory.values())]
        memory["total"] = {f"{p}_bytes": planner._phase_total(memory, p) for p in phases}
        if best is None or max(memory["total"].values()) > max(best["total"].values()):
            best, best_j = memory, j
    devices = list(g.devices)
    residency = {
        role: {p: sched.describe(role, p) for p in PLAN_PHASES if p in best[role]} for role in g.roles
        if role in best and role != "rollout"
    }  # fmt: skip
    return GroupPlan(
        roles=g.roles,
        resource_key=g.key,
        devices=devices,
        nodes=sorted({d // plan.device.per_node for d in devices}),
        memory=best,
        peak_device=g.first + best_j,
        residency=residency,
        verdict=_verdict(cfg, plan, best),
    )


def _verdict(cfg: RLConfig, plan: planner.Plan, memory: dict) -> dict[str, object]:
    lays = {"actor": plan.layouts["actor"], **({"critic": plan.layouts["critic"]} if "critic" in plan.layouts else {})}
    return planner.verdict(cfg, plan, memory, lays)
