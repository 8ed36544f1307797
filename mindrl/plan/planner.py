"""The dry-run plan of a validated config: where every rank sits, each model's layout and what each phase of an
iteration holds on a device, checked against the device's memory. Starts no worker and builds no model."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mindrl.plan.memory as mem
from mindrl.config.rl import PACKING_USES
from mindrl.config.root import RLConfig
from mindrl.config.settings import RecomputeSettings
from mindrl.plan.devices import Device, pick_device
from mindrl.plan.params import PlanError, adapter_params, stage_params, total_params
from mindrl.resharding.offload import OffloadConfig
from mindrl.resharding.residency import MODELS, PHASES, PLAN_PHASES, STEP
from mindrl.workers import from_config

_KIND_OF = {"weights_bytes": "param", "grads_bytes": "grad", "optimizer_bytes": "optimizer"}
"""A planner term -> the offload kind the residency schedule moves (mindrl.resharding.residency)."""


@dataclass(frozen=True)
class ModelLayout:
    role: str
    tp: int
    pp: int
    dp: int
    vpp: int
    sequence_parallel: bool
    micro_batch_size: int
    forward_micro_batch_size: int
    micro_batches_per_step: int
    update_shape: tuple[int, int]
    """(s, b) of an update micro-batch (`memory.micro_batch_shape`: packed rows and token budgets)."""
    forward_shape: tuple[int, int]
    """(s, b) of a forward-only micro-batch (old logprobs, values)."""
    packed: bool
    token_budget: int | None
    distributed_optimizer: bool
    dtype: str
    params_total: int
    params_per_stage: list[int]
    """Parameters of one TP rank of each pipeline stage."""
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)
    """Activation recomputation in the update (recompute_* keys)."""
    cp: int = 1
    """Context parallelism: each rank computes 1 / cp of every row's columns (the shapes above are whole rows)."""
    trainable_per_stage: list[int] | None = None
    """Parameters with gradients and optimizer state per stage (one TP rank); None: all of them. With LoRA: the
    adapters only (params_per_stage counts the frozen backbone and the adapters)."""
    ep: int = 1
    """Expert parallelism of a MoE model (expert_model_parallel_size)."""
    expert_params_per_stage: list[int] = field(default_factory=list)
    stage_layer_counts: list[int] | None = None
    """Each pipeline stage's layers as num_layer_list gives them; None: num_layers / PP each."""
    """Of params_per_stage, the routed experts' (a MoE model; empty: none)."""


@dataclass(frozen=True)
class RolloutLayout:
    infer_tp: int
    replicas: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    params_per_rank: int


@dataclass(frozen=True)
class DeviceSlot:
    """One device: its node, and the ranks on it as (tp_rank, pp_rank, dp_rank) / (replica, infer_tp_rank)."""

    device: int
    node: int
    local: int
    actor: tuple[int, int, int]
    critic: tuple[int, int, int] | None
    engine: tuple[int, int] | None


@dataclass
class Plan:
    config_name: str
    source: str
    device: Device
    device_why: str
    world: int
    train_seq_len: int
    layouts: dict[str, ModelLayout]
    rollout: RolloutLayout | None
    """None: a training-only run (stage: dpo, mindrl.plan.offline)."""
    placement: list[DeviceSlot]
    memory: dict[str, dict[str, dict[str, int]]]
    """role -> phase -> term -> bytes, for the device with the highest peak; 'total' -> phase -> bytes."""
    peak_device: int
    kv_cache: dict[str, int]
    residency: dict[str, dict[str, str]]
    verdict: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    groups: list = field(default_factory=list)
    """Separate placement (mindrl.plan.separate.GroupPlan per device group); empty in integrated mode, where
    `placement` lists every device."""


def rank_coords(rank: int, tp: int, pp: int, world: int, cp: int = 1) -> tuple[int, ...]:
    """(tp_rank, pp_rank, dp_rank), and cp_rank when cp > 1, of a global rank in megatron's default order
    'tp-cp-ep-dp-pp' (TP fastest, then CP, then DP, then PP), as parallel_state.initialize_model_parallel lays
    ranks out."""
    dp = world // (tp * pp * cp)
    coords = (rank % tp, rank // (tp * cp * dp), (rank // (tp * cp)) % dp)
    return coords if cp == 1 else (*coords, (rank // tp) % cp)


def _layout(cfg: RLConfig, role: str, world: int) -> ModelLayout:
    rc, arch = (cfg.critic_config, cfg.critic_model) if role == "critic" else (cfg.actor_config, cfg.model)
    model_role = "critic" if role == "critic" else "actor"
    settings = _model_settings(cfg, role)
    dp = world // (settings.tp * settings.pp * settings.cp)
    counts = rc.stage_layer_counts(int(arch.num_layers))  # num_layer_list's stages, as mindrl-train builds them
    rl = cfg.rl_config
    seq = cfg.sequence_length
    update = mem.micro_batch_shape(
        seq, settings.micro_batch_size, settings.token_budget, settings.max_rows, settings.remove_padding
    )
    forward = mem.micro_batch_shape(
        seq, settings.forward_micro_batch_size, settings.forward_token_budget, settings.forward_max_rows,
        settings.remove_padding,
    )  # fmt: skip
    lora = role != "critic" and rc.lora  # the critic's LoRA is refused at load with the actor's
    adapters = [adapter_params(arch, rc.lora_target_modules, rc.lora_r, rc.tp, rc.pp) if lora else 0] * rc.pp
    return ModelLayout(
        role=role,
        tp=settings.tp,
        pp=settings.pp,
        dp=dp,
        vpp=1,  # mindrl splits layers evenly over stages, without virtual stages
        sequence_parallel=settings.sequence_parallel and settings.tp > 1,
        micro_batch_size=settings.micro_batch_size,
        forward_micro_batch_size=settings.forward_micro_batch_size,
        micro_batches_per_step=mem.micro_batches(rl.mini_batch_responses // dp, seq, update),
        update_shape=update,
        forward_shape=forward,
        packed=settings.remove_padding,
        token_budget=settings.token_budget,
        distributed_optimizer=settings.optim.use_distributed_optimizer,
        dtype=settings.dtype,
        params_total=total_params(arch, model_role)
        + (adapter_params(arch, rc.lora_target_modules, rc.lora_r, 1) if lora else 0),
        params_per_stage=[
            stage_params(arch, model_role, rc.tp, rc.pp, s, rc.ep, counts).total + adapters[s] for s in range(rc.pp)
        ],
        expert_params_per_stage=[
            stage_params(arch, model_role, rc.tp, rc.pp, s, rc.ep, counts).experts for s in range(rc.pp)
        ],
        stage_layer_counts=counts,
        ep=rc.ep,
        recompute=settings.recompute,
        cp=settings.cp,
        trainable_per_stage=adapters if lora else None,
    )


def _model_settings(cfg: RLConfig, role: str):
    """The role's ModelSettings exactly as the trainer derives them (mindrl.workers.from_config), without touching
    the disk (integrated_settings also needs the engine's config.json; a resumed run reads its checkpoint):
    no resume dir, which changes nothing the plan reads."""
    rl = cfg.rl_config
    if role == "critic":
        fwd = getattr(rl, "critic_forward_micro_batch_size", None)
        return from_config.model_settings(replace(cfg.critic_config, finetune=True), cfg, fwd, None, critic=True)
    return from_config.model_settings(
        replace(cfg.actor_config, finetune=True), cfg, rl.actor_forward_micro_batch_size, None
    )


def make_plan(
    cfg: RLConfig,
    device: str | None = None,
    device_memory_gib: float | None = None,
    devices_per_node: int | None = None,
) -> Plan:
    """The plan of `cfg` (from mindrl.config.load_config) on `device` (a key of mindrl.plan.devices.CHOICES;
    None: named by the config name, else the current platform's)."""
    rl, gen = cfg.rl_config, cfg.generate_config
    if not rl.use_integrated_worker:
        raise PlanError("use_integrated_worker: false is planned by mindrl.plan.make_plan (mindrl.plan.separate)")
    world = rl.world_size
    dev, why = pick_device(world, cfg.config_name, device, device_memory_gib, devices_per_node)
    layouts = {"actor": _layout(cfg, "actor", world)}
    has_ref, has_critic = from_config.needs_reference(cfg), rl.needs_critic and cfg.critic_config is not None
    if has_critic:
        layouts["critic"] = _layout(cfg, "critic", world)
    itp = gen.infer_tensor_parallel_size
    rollout = RolloutLayout(
        infer_tp=itp,
        replicas=world // itp,
        dtype=gen.dtype,
        max_model_len=gen.max_model_len,
        max_num_seqs=gen.max_num_seqs,
        params_per_rank=_engine_params(cfg),
    )
    a, c = layouts["actor"], layouts.get("critic")
    placement = [
        DeviceSlot(
            device=i,
            node=i // dev.per_node,
            local=i % dev.per_node,
            actor=rank_coords(i, a.tp, a.pp, world, a.cp),
            critic=None if c is None else rank_coords(i, c.tp, c.pp, world, c.cp),
            engine=(i // itp, i % itp),
        )
        for i in range(world)
    ]
    seq = cfg.sequence_length
    plan = Plan(cfg.config_name, cfg.source, dev, why, world, seq, layouts, rollout, placement, {}, 0, {}, {})
    _fill_memory(plan, cfg, has_ref)
    _judge(plan, cfg)
    return plan


# ------------------------------------------------------------------------------------------------ memory
def _engine_params(cfg: RLConfig) -> int:
    """One rollout device's weights: the model split over infer TP, its experts (enable_expert_parallel) instead
    whole, over infer TP x infer_expert_parallel_size devices (vLLM's EP spans its TP and DP ranks)."""
    gen, arch = cfg.generate_config, cfg.model
    whole = stage_params(arch, "actor", gen.infer_tensor_parallel_size, 1, 0)
    iep = gen.infer_expert_parallel_size
    if not (arch.is_moe and gen.enable_expert_parallel and iep > 1):
        return whole.total
    return (
        whole.total - whole.experts + stage_params(arch, "actor", 1, 1, 0, iep * gen.infer_tensor_parallel_size).experts
    )


def _state(lay: ModelLayout, stage: int) -> dict[str, int]:
    params = lay.params_per_stage[stage]
    trained = params if lay.trainable_per_stage is None else lay.trainable_per_stage[stage]
    # the routed experts' state is sharded over their own DP (LoRA adapters, on a dense model only, are not experts)
    experts = (
        lay.expert_params_per_stage[stage] if lay.expert_params_per_stage and lay.trainable_per_stage is None else 0
    )
    e = mem.DTYPE_BYTES[lay.dtype]
    expert_dp = max(1, lay.dp * lay.cp // lay.ep)  # a distributed optimizer shards the experts' state over these
    return {
        "weights_bytes": params * e,
        "grads_bytes": trained * mem.GRAD_BYTES,
        "optimizer_bytes": mem.optimizer_bytes(trained - experts, lay.dtype, lay.distributed_optimizer, lay.dp)
        + mem.optimizer_bytes(experts, lay.dtype, lay.distributed_optimizer, expert_dp),
    }


def _update_acts(lay: ModelLayout, arch, stage: int, dev: Device) -> dict[str, int]:
    """The update's activations under the layout's recomputation, and (marked alt.) under full recomputation of
    every layer where the layout does not recompute fully already."""
    out = {"activations_bytes": _acts(lay, arch, stage, lay.recompute, dev)}
    if lay.recompute.recompute_granularity != "full":
        out["activations_recompute_bytes"] = _acts(lay, arch, stage, mem.FULL_RECOMPUTE, dev)
    return out


def _acts(lay: ModelLayout, arch, stage: int, recompute: RecomputeSettings, dev: Device) -> int:
    s, b = lay.update_shape
    return mem.train_activation_bytes(
        arch, "critic" if lay.role == "critic" else "actor", -(-s // lay.cp), b, lay.tp, lay.pp,
        lay.sequence_parallel, mem.DTYPE_BYTES[lay.dtype], stage, lay.micro_batches_per_step, recompute,
        dev.kernels.norm == "eager_fused", dev.kernels.gemm_attention_max_len, dev.kernels, lay.cp,
        lay.stage_layer_counts[stage] if lay.stage_layer_counts else None,
    )  # fmt: skip


def _local(shape: tuple[int, int], cp: int) -> tuple[int, int]:
    """(s, b) of a micro-batch -> what one context-parallel rank computes of it: s / cp columns of each row."""
    return -(-shape[0] // cp), shape[1]


def _device_memory(plan: Plan, cfg: RLConfig, slot: DeviceSlot, has_ref: bool) -> dict:
    rl, gen = cfg.rl_config, cfg.generate_config
    seq, dev = plan.train_seq_len, plan.device
    a, c = plan.layouts["actor"], plan.layouts.get("critic")
    out: dict[str, dict[str, dict[str, int]]] = {"actor": {}, "reference": {}, "critic": {}, "rollout": {}}
    actor = _state(a, slot.actor[1])
    ea = mem.DTYPE_BYTES[a.dtype]
    # The rollout engine: during rollout it takes gpu_memory_utilization of the device (weights, its step
    # activations, the KV cache in what is left), or an explicit KV size (CPU); it sleeps outside rollout
    # where it can (vLLM's sleep mode; on the host, VllmEngine's release of its storages).
    ei = mem.DTYPE_BYTES[gen.dtype]
    eng_w = plan.rollout.params_per_rank * ei
    eng_act = mem.engine_activation_bytes(cfg.model, gen.max_num_batched_tokens, gen.max_num_seqs, gen.infer_tensor_parallel_size, ei)  # fmt: skip
    if gen.kv_cache_memory_gib is not None:
        kv = int(gen.kv_cache_memory_gib * (1 << 30))
    elif not dev.kv_by_utilization:
        from mindrl.platform import current_platform
        from mindrl.rollout.base import full_batch_kv_bytes

        cap = current_platform().rollout_kv_cache_bytes()  # the engine's own default (VllmEngine): capped full batch
        m = cfg.model
        if m.multi_latent_attention:  # the compressed KV: vLLM's blocks as full_batch_kv_bytes counts them
            per_token = mem.kv_bytes_per_token(m, gen.infer_tensor_parallel_size, ei)
            full = (gen.max_num_seqs * -(-gen.max_model_len // mem.KV_BLOCK) + 2) * mem.KV_BLOCK * per_token
        else:
            full = full_batch_kv_bytes(int(m.num_layers), m.num_kv_heads, m.head_dim, ei, gen.max_num_seqs,
                                       gen.max_model_len, gen.infer_tensor_parallel_size)  # fmt: skip
        kv = min(cap, full) if cap else int(gen.gpu_memory_utilization * dev.memory_bytes)
    else:
        kv = int(gen.gpu_memory_utilization * dev.memory_bytes) - eng_w - eng_act
    engine = {"weights_bytes": eng_w, "activations_bytes": eng_act, "kv_cache_bytes": max(0, kv)}
    asleep = engine if not dev.sleep_mode else dict.fromkeys(engine, 0)  # outside the rollout

    sched = from_config.residency(cfg)

    def held(model: str, phase: str, state: dict[str, int]) -> dict[str, int]:
        on = sched.on_device(model, phase)
        return {k: (v if _KIND_OF[k] in on else 0) for k, v in state.items()}

    out["actor"]["rollout"] = held("actor", "rollout", actor)
    if a.trainable_per_stage is not None:  # LoRA: the reshard merges each adapted linear before the engine gets it
        rc = cfg.actor_config
        # A transient of the reshard, which wakes the engine's weights before its KV cache: counted with the
        # rollout, an upper bound.
        out["actor"]["rollout"]["merge_buffer_bytes"] = mem.merge_buffer_bytes(
            cfg.model, rc.lora_target_modules, rc.lora_r, a.tp, ea
        )
    out["rollout"]["rollout"] = engine
    fwd_a = 0 if rl.on_policy else mem.forward_bytes(cfg.model, "actor", *_local(a.forward_shape, a.cp), a.tp, ea)
    out["actor"]["score"] = {**held("actor", "score", actor), "activations_bytes": fwd_a}
    if has_ref:
        ref_mbs = rl.ref_forward_micro_batch_size or a.micro_batch_size
        # share_backbone: the reference pass runs on the actor's own weights with the adapters off: no copy.
        ref_w = {"weights_bytes": 0 if rl.share_backbone else actor["weights_bytes"]}
        ref_shape = mem.micro_batch_shape(seq, ref_mbs, *rl.token_budget("ref"), a.packed)
        ref_act = mem.forward_bytes(cfg.model, "actor", *_local(ref_shape, a.cp), a.tp, ea)
        out["reference"] = {"rollout": {**held("reference", "rollout", ref_w), "activations_bytes": 0},
                            "score": {**held("reference", "score", ref_w), "activations_bytes": ref_act}}  # fmt: skip
    out["rollout"]["score"] = asleep
    if c is not None:
        critic = _state(c, slot.critic[1])
        ec = mem.DTYPE_BYTES[c.dtype]
        cfwd = mem.forward_bytes(cfg.critic_model, "critic", *_local(c.forward_shape, c.cp), c.tp, ec)
        out["critic"] = {
            "rollout": held("critic", "rollout", critic),
            "score": {**held("critic", "score", critic), "activations_bytes": cfwd},
            "critic_train": {
                **held("critic", "critic_train", critic),
                **_update_acts(c, cfg.critic_model, slot.critic[1], dev),
            },
            "train": held("critic", "train", critic),
        }
        out["actor"]["critic_train"] = held("actor", "critic_train", actor)
        out["rollout"]["critic_train"] = asleep
        if has_ref:
            out["reference"]["critic_train"] = {**held("reference", "critic_train", ref_w), "activations_bytes": 0}
    if cfg.reward_config is not None and cfg.reward_model is not None:
        out["reward"] = _reward_memory(plan, cfg, slot, held)
    out["actor"]["train"] = {**held("actor", "train", actor), **_update_acts(a, cfg.model, slot.actor[1], dev)}
    out["rollout"]["train"] = asleep
    if has_ref:
        out["reference"]["train"] = {**held("reference", "train", ref_w), "activations_bytes": 0}
    if sched.swap_optimizer:  # the optimizer steps, apart: the state swapped in, the micro-batches' activations freed
        for role, by_phase in out.items():
            if "train" in by_phase:
                step = {k: (0 if k.startswith("activations") else v) for k, v in by_phase["train"].items()}
                by_phase[STEP] = {**step, **held(role, STEP, actor)} if role == "actor" else dict(by_phase["train"])
    out = {role: phases for role, phases in out.items() if phases}
    phases = [p for p in PLAN_PHASES if any(p in v for v in out.values())]
    out["total"] = {f"{p}_bytes": _phase_total(out, p) for p in phases}
    return out


def _reward_memory(plan: Plan, cfg: RLConfig, slot: DeviceSlot, held) -> dict[str, dict[str, int]]:
    """The reward model on `slot`'s device, by phase: its weights (its own TP x PP stage) where the residency
    schedule has them, and a forward pass's activations while scoring. No grads, no optimizer."""
    rm, settings = cfg.reward_config, from_config.reward_model_settings(cfg)
    stage = rank_coords(slot.device, rm.tp, rm.pp, plan.world)[1]
    e = mem.DTYPE_BYTES[settings.dtype]
    weights = {"weights_bytes": stage_params(cfg.reward_model, "critic", rm.tp, rm.pp, stage).total * e}
    m = settings.micro_batching
    shape = mem.micro_batch_shape(plan.train_seq_len + 1, m.rows, m.token_budget, m.max_rows, m.packed)
    acts = mem.forward_bytes(cfg.reward_model, "critic", *shape, rm.tp, e)
    phases = [p for p in PHASES if p != "critic_train" or cfg.rl_config.needs_critic]
    return {p: {**held("reward", p, weights), "activations_bytes": acts if p == "score" else 0} for p in phases}


def _phase_total(memory: dict, phase: str) -> int:
    # The full-recomputation figure is an alternative to activations_bytes (what the configured recomputation
    # keeps), never added to it.
    return sum(
        v for role, phases in memory.items() if role != "total"
        for k, v in phases.get(phase, {}).items() if k != "activations_recompute_bytes"
    )  # fmt: skip


def _fill_memory(plan: Plan, cfg: RLConfig, has_ref: bool) -> None:
    seen: dict[tuple, dict] = {}
    best, best_slot = None, 0
    for slot in plan.placement:  # devices with the same stages hold the same bytes
        rm = cfg.reward_config
        key = (slot.actor[1], None if slot.critic is None else slot.critic[1],
               None if rm is None else rank_coords(slot.device, rm.tp, rm.pp, plan.world)[1])  # fmt: skip
        if key not in seen:
            seen[key] = _device_memory(plan, cfg, slot, has_ref)
            peak = max(seen[key]["total"].values())
            if best is None or peak > max(best["total"].values()):
                best, best_slot = seen[key], slot.device
    plan.memory, plan.peak_device = best, best_slot
    gen = cfg.generate_config
    per_token = mem.kv_bytes_per_token(cfg.model, gen.infer_tensor_parallel_size, mem.DTYPE_BYTES[gen.dtype])
    budget = best["rollout"]["rollout"]["kv_cache_bytes"]
    plan.kv_cache = {
        "budget_bytes": budget,
        "bytes_per_token": per_token,
        "sequences_at_max_len": mem.sequences_in_cache(budget, gen.max_model_len, per_token),
        "max_num_seqs": gen.max_num_seqs,
    }
    sched = from_config.residency(cfg)
    plan.residency = {
        role: {p: sched.describe(role, p) for p in PLAN_PHASES if p in best[role]}
        for role in MODELS if role in best
    }  # fmt: skip
    plan.residency["rollout"] = {
        p: "awake" if sched.engine_awake(p) or not plan.device.sleep_mode else "asleep" for p in best["rollout"]
    }


def has_ref_of(plan: Plan) -> bool:
    return "reference" in plan.memory


# ------------------------------------------------------------------------------------------------ verdict
def fix_key(
    cfg: RLConfig, role: str, phase: str, term: str, layouts: dict[str, ModelLayout], kv_by_utilization: bool
) -> str:
    """The config key that would shrink `role.phase.term`, with the direction to move it."""
    if role == "rollout":
        if term == "weights_bytes":
            return "generate_config.infer_tensor_parallel_size (raise it)"
        if cfg.generate_config.kv_cache_memory_gib is not None or not kv_by_utilization:
            return "generate_config.kv_cache_memory_gib (lower it)"
        return "generate_config.gpu_memory_utilization (lower it; the KV cache takes what is left of it)"
    if role == "reward":  # forward only: its micro-batch, else its layout
        if term == "activations_bytes" and cfg.reward_config.micro_batch_size > 1:
            return "reward_config.micro_batch_size (lower it)"
        return "reward_config.tensor_model_parallel_size or pipeline_model_parallel_size (raise it)"
    section = "critic_config" if role == "critic" else "actor_config"
    lay = layouts["critic" if role == "critic" else "actor"]
    every_switch = replace(from_config.residency(cfg), offload=OffloadConfig(True, True, True))
    if role == "actor" and term in _KIND_OF and _KIND_OF[term] not in every_switch.on_device("actor", phase):
        return f"generate_config.offload_train_{_KIND_OF[term]}: true"
    if term == "activations_bytes":
        if cfg.rl_config.use_dynamic_bsz:  # micro-batches cut by a token budget: that budget is the knob
            use = {"score": {"actor": "actor", "reference": "ref"}.get(role, "critic")}.get(phase, "update")
            use = "critic" if role == "critic" else use
            return f"rl_config.{PACKING_USES[use]} (lower it)"
        if phase == "score":
            name = {"actor": "actor", "reference": "ref", "critic": "critic"}[role]
            return f"rl_config.{name}_forward_micro_batch_size (lower it)"
        if lay.micro_batch_size > 1:
            return f"{section}.micro_batch_size (lower it)"
        if lay.tp > 1 and not lay.sequence_parallel:
            return "megatron_training.sequence_parallel: true"
        arch = cfg.critic_model if role == "critic" else cfg.model
        shorter = "shorter sequences (rl_config.max_prompt_length, generate_config.sampling_config.max_tokens)"
        if arch.num_kv_heads % (2 * lay.tp) == 0:
            return f"{section}.tensor_model_parallel_size (raise it), or {shorter}"
        if lay.recompute.recompute_granularity != "full":
            return f"{section}.recompute_granularity: full (recompute_method: uniform, recompute_num_layers: 1)"
        return f"{shorter}: TP {lay.tp} is already the most the KV heads allow, and every layer is recomputed"
    if term == "optimizer_bytes" and not lay.distributed_optimizer and lay.dp > 1:
        return "megatron_training.use_distributed_optimizer: true"
    return f"{section}.tensor_model_parallel_size or pipeline_model_parallel_size (raise it)"


def verdict(cfg: RLConfig, plan: Plan, memory: dict, layouts: dict, fix=None) -> dict[str, object]:
    """Fits or not: the peak phase of `memory` (one device's per-role, per-phase bytes) against the device, its
    largest term and the key that would shrink it (`fix`, `fix_key`'s signature; also each device group's verdict
    under separate placement)."""
    totals = memory["total"]
    phase = max(totals, key=totals.get).removesuffix("_bytes")
    peak, limit = totals[f"{phase}_bytes"], plan.device.memory_bytes
    terms = [
        (v, role, k) for role, phases in memory.items() if role != "total"
        for k, v in phases.get(phase, {}).items() if k != "activations_recompute_bytes"
    ]  # fmt: skip
    v, role, term = max(terms)
    return {
        "fits": peak <= limit,
        "peak_phase": phase,
        "peak_bytes": peak,
        "device_memory_bytes": limit,
        "headroom_bytes": limit - peak,
        "largest_term": f"{role}.{phase}.{term}",
        "largest_term_bytes": v,
        "fix": (fix or fix_key)(cfg, role, phase, term, layouts, plan.device.kv_by_utilization),
    }


def _judge(plan: Plan, cfg: RLConfig) -> None:
    plan.verdict = verdict(cfg, plan, plan.memory, plan.layouts)
    eng = plan.memory["rollout"]["rollout"]
    if plan.device.kv_by_utilization and cfg.generate_config.kv_cache_memory_gib is None and eng["kv_cache_bytes"] == 0:
        plan.verdict["fits"] = False
        plan.notes.append(
            "the engine's weights and step activations exceed generate_config.gpu_memory_utilization x device "
            "memory: no room for a KV cache (raise gpu_memory_utilization or infer_tensor_parallel_size)"
        )
    kv = plan.kv_cache
    if 0 < kv["sequences_at_max_len"] < kv["max_num_seqs"]:
        plan.notes.append(
            f"the KV cache holds {kv['sequences_at_max_len']} sequences of max_model_len at once, fewer than "
            f"max_num_seqs={kv['max_num_seqs']}: vLLM queues (or preempts) the rest"
        )
    if not has_ref_of(plan):
        plan.notes.append("no reference model: the config has no KL term (init_kl_coef 0)")
