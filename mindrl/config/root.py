"""`RLConfig`: the whole run's config, and the rules that span sections (layouts against the model and the
devices, batch divisibility, sequence lengths), checked once when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from mindrl.config import placement
from mindrl.config.errors import Collector
from mindrl.config.generate import GenerateConfig
from mindrl.config.megatron import MegatronTrainingConfig, RoleConfig
from mindrl.config.model import ModelArchConfig
from mindrl.config.profiler import ProfilerConfig
from mindrl.config.rl import PACKING_USES, RLSectionConfig
from mindrl.config.section import Section


@dataclass
class ForwardRoleConfig(RoleConfig):
    """reward_config: a model run forward only. Its optimizer keys have no use, so lr is not required."""

    SECTION: ClassVar[str] = "reward_config"

    def validate(self, col: Collector) -> None:
        if self.lr is None:
            self.lr = max(self.min_lr, 1.0)  # never used: no optimizer is built
        super().validate(col)


@dataclass
class RLConfig(Section):
    """A validated PPO / GRPO config in MindSpeed-RL's schema. Build it with `mindrl.config.load_config`."""

    SECTION: ClassVar[str] = ""

    megatron_training: MegatronTrainingConfig = field(default_factory=MegatronTrainingConfig)
    """Global training settings, with actor_config's overrides of global keys applied."""
    actor_config: RoleConfig = field(default_factory=RoleConfig)
    """The actor (and reference) model: layout, optimizer, checkpoints."""
    critic_config: RoleConfig | None = None
    """The critic (value model); None without a critic (GRPO and the other group estimators)."""
    rl_config: RLSectionConfig = field(default_factory=RLSectionConfig)
    """The algorithm, rewards, logging and devices."""
    generate_config: GenerateConfig = field(default_factory=GenerateConfig)
    """The rollout engine and sampling."""
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    """Per-stage profiling of the workers (off by default)."""
    model: ModelArchConfig = field(default_factory=ModelArchConfig)
    """The actor's architecture (configs/model/NAME.yaml, NAME = actor_config.model)."""
    critic_model: ModelArchConfig | None = None
    """The critic's architecture (usually the same model file as the actor's); None without a critic."""
    reward_config: ForwardRoleConfig | None = None
    """The reward model (a value-head checkpoint: load, layout, micro_batch_size), merged over megatron_training as
    MindSpeed-RL's reward_config; None: rule rewards only."""
    reward_model: ModelArchConfig | None = None
    """The reward model's architecture; None without a reward model."""
    source: str = ""
    """The YAML file the config came from."""
    config_name: str = ""
    """The config's name (the file name without .yaml)."""
    ignored_keys: list[str] = field(default_factory=list)
    """MindSpeed-RL keys accepted but without effect here, as written ("megatron_training.use_flash_attn")."""

    def validate(self, col: Collector) -> None:
        self._resolve()
        rl, mt, gen = self.rl_config, self.megatron_training, self.generate_config
        if rl.needs_critic and self.critic_config is None:
            col.add("rl_config.adv_estimator", "gae needs a value model: add a critic_config section")
        world = rl.actor_resource.num_npus
        gbs, n = mt.global_batch_size, rl.n_samples_per_prompt
        crit = rl.critic_resource.num_npus if rl.critic_resource is not None else None
        if rl.use_integrated_worker and self.critic_config and crit is not None and world is not None and crit != world:
            col.add("rl_config.critic_resource.num_npus", f"{crit} differs from actor_resource.num_npus={world}: "
                    "the critic runs on the actor's devices; remove critic_resource or make them equal")  # fmt: skip
        train_key = (
            "rl_config.filter_groups_train_batch_size"
            if rl.filter_groups_enable
            else "megatron_training.global_batch_size"
        )
        train = rl.filter_groups_train_batch_size if rl.filter_groups_enable else gbs
        if train is not None and rl.mini_batch_size is not None and not col.is_bad("rl_config.mini_batch_size"):
            if train % rl.mini_batch_size:
                col.add("rl_config.mini_batch_size", f"{train_key}={train} prompts must be "
                        f"divisible by mini_batch_size={rl.mini_batch_size} (prompts per optimizer step)")  # fmt: skip
        roles = [("actor_config", self.actor_config, self.model)]
        if self.critic_config is not None and self.critic_model is not None:
            roles.append(("critic_config", self.critic_config, self.critic_model))
        devices = placement.check(self, col)  # role -> (its devices, the key that sets them)
        for role, rc, arch in roles:
            self._check_role(col, role, rc, arch, *devices[role.removesuffix("_config")], train, n)
        if rl.needs_reference and not rl.use_integrated_worker:  # forward only, the actor's layout
            self._check_role(col, "actor_config", self.actor_config, self.model, *devices["reference"], None, n)
        if self.reward_config is not None and self.reward_model is not None:
            self._check_role(col, "reward_config", self.reward_config, self.reward_model, *devices["reward"], None, n)
        self._check_reward_model(col, world)
        self._check_inference(col, *devices["rollout"], gbs)
        self._check_lengths(col)
        if gen.dtype != mt.dtype:
            col.note(f"generate_config.dtype={gen.dtype} differs from the training dtype {mt.dtype}: rollout "
                     "logprobs will differ from the trainer's (rollout_is_threshold can correct for it)")  # fmt: skip
        if gen.rollout_mode == "server" and rl.async_mode == "bounded":
            col.add("generate_config.rollout_mode", "'server' does not combine with rl_config.async_mode bounded: "
                    "bounded's samplers generate with engines of their own (async_sampler_engine) and the trainer "
                    "publishes its weights to them, never to the rollout servers, so the servers would generate "
                    "nothing; run mindrl-sampler processes on the rollout hosts (async_transport: zmq), or keep the "
                    "servers with async_mode sync or one_step_off")  # fmt: skip
        if mt.stage == "ray_dapo" and rl.sync_ref_model:
            col.add("rl_config.sync_ref_model", "is true but stage ray_dapo has no KL term and builds no reference model "
                    "to sync; set sync_ref_model: false, or use stage ray_grpo with a KL coefficient")  # fmt: skip
        self._check_lora(col)
        self._check_router_replay(col)
        if mt.eval_interval and not rl.val_data_path:
            col.ignore("megatron_training.eval_interval", "has no effect without rl_config.val_data_path")
        if rl.needs_critic and rl.use_kl_in_reward is False and rl.init_kl_coef > 0:
            col.note(f"rl_config: gae with use_kl_in_reward: false puts the KL in the actor loss (init_kl_coef="
                     f"{rl.init_kl_coef}); MindSpeed-RL's PPO applies no KL then; set init_kl_coef: 0 to match")  # fmt: skip

    def _check_router_replay(self, col: Collector) -> None:
        """Routing replay against the actor's model and layout (what `rl_model._replay_for` can lay out)."""
        if self.rl_config.router_replay_mode == "disabled":
            return
        actor = self.actor_config
        if self.rl_config.on_policy:
            col.add("rl_config.router_replay_mode", "R2 replays the old-logprob pass's routing, and this run computes "
                    "no old logprobs (one mini-batch, one epoch: the update's own forward is the old policy's)")  # fmt: skip
        if not getattr(self.model, "num_experts", None):
            col.add("rl_config.router_replay_mode", "needs a mixture-of-experts model (num_experts); this one has no "
                    "routers")  # fmt: skip
        for key in ("pipeline_model_parallel_size", "context_parallel_size"):
            if (getattr(actor, key, 1) or 1) > 1:
                col.add("rl_config.router_replay_mode", f"is not built for actor_config.{key} > 1")
        if actor.recompute_granularity is not None:
            col.add("rl_config.router_replay_mode", "is not built with activation recompute (actor_config."
                    "recompute_granularity): the backward would route again")  # fmt: skip

    def _check_lora(self, col: Collector) -> None:
        """share_backbone against the actor (MindSpeed-RL's rules), and LoRA against what the trainer runs."""
        rl, actor = self.rl_config, self.actor_config
        if rl.share_backbone:
            if not actor.lora:
                col.add("rl_config.share_backbone", "needs a LoRA actor (actor_config.lora_target_modules): only "
                        "frozen weights can be shared with the reference")  # fmt: skip
            if not rl.use_integrated_worker:
                col.add("rl_config.share_backbone", "needs use_integrated_worker: true (the reference shares the "
                        "actor's devices and weights)")  # fmt: skip
            if self.megatron_training.stage == "ray_dapo":
                col.add("rl_config.share_backbone", "stage ray_dapo has no reference model to share the backbone with")
            if rl.sync_ref_model:
                col.add("rl_config.share_backbone", "sync_ref_model moves the reference toward the actor, which a "
                        "shared frozen backbone cannot follow; set one of them false")  # fmt: skip
        for role, rc in (("critic_config", self.critic_config), ("reward_config", self.reward_config)):
            if rc is not None and rc.lora:
                col.add(f"{role}.lora_target_modules", "LoRA trains the actor only: a critic or reward model with "
                        "adapters is not implemented (docs/lora.md); remove lora_target_modules here")  # fmt: skip
        if not actor.lora:
            return
        # What the trainer runs with a LoRA actor today (docs/lora.md); the rest is refused, saying why.
        if not rl.use_integrated_worker:
            col.add("actor_config.lora_target_modules", "LoRA runs in the integrated worker only (separate "
                    "placement's reference / rollout workers do not build adapters yet); set use_integrated_worker: "
                    "true")  # fmt: skip
        # one_step_off and the reward model run through adapters (tests/trainer/test_lora_e2e.py): the engine gets the
        # merged weights on the same stream, the reward model scores as for any actor. The rest has had no run.
        if rl.async_mode == "bounded":
            col.add("actor_config.lora_target_modules", "LoRA with async_mode bounded has not been run through "
                    "adapters (its samplers get the merged weights published, but no test has checked them); use "
                    "async_mode one_step_off or sync")  # fmt: skip
        if rl.partial_rollout_max_split > 1:
            col.add("actor_config.lora_target_modules", "LoRA with partial rollout has not been run through adapters "
                    "(no test has checked responses resumed across weight versions); set partial_rollout_max_split: "
                    "1, or use async_mode one_step_off for overlap")  # fmt: skip
        if self.generate_config.rollout_mode == "server":
            col.add("actor_config.lora_target_modules", "LoRA with rollout servers is untested; set rollout_mode "
                    "to the in-process engine")  # fmt: skip
        if rl.needs_reference and not rl.share_backbone:
            col.add("actor_config.lora_target_modules", "a LoRA actor with a reference model of its own is "
                    "untested; set rl_config.share_backbone: true (the reference is the backbone with the adapters "
                    "off, no second copy)")  # fmt: skip

    def _resolve(self) -> None:
        """Fill the values that default to another section's."""
        mt = self.megatron_training
        for rc in (self.actor_config, self.critic_config, self.reward_config):
            if rc is None:
                continue
            if rc.use_distributed_optimizer is None:
                rc.use_distributed_optimizer = mt.use_distributed_optimizer
            if rc.sequence_parallel is None:
                rc.sequence_parallel = mt.sequence_parallel
            if rc.model is None:
                rc.model = mt.model
        if self.generate_config.tokenizer_name_or_path is None:
            self.generate_config.tokenizer_name_or_path = mt.tokenizer_name_or_path
        if mt.stage == "ray_dapo":
            self.rl_config.use_dapo_stage()
        if mt.global_batch_size is not None and mt.global_batch_size >= 1:
            a = self.actor_config
            c = self.critic_config if self.rl_config.needs_critic else None
            self.rl_config.bind(
                mt.global_batch_size,
                max(1, a.tp * a.pp * a.cp),  # the model-parallel ranks per DP rank: DP = world / (TP x PP x CP)
                None if c is None else max(1, c.tp * c.pp * c.cp),
                max(1, self.generate_config.infer_tensor_parallel_size),
            )

    def _check_role(
        self,
        col: Collector,
        role: str,
        rc: RoleConfig,
        arch: ModelArchConfig,
        world: int | None,
        world_key: str,
        gbs: int | None,
        n: int,
    ) -> None:
        tp, pp = rc.tp, rc.pp
        tp_key, pp_key = f"{role}.tensor_model_parallel_size", f"{role}.pipeline_model_parallel_size"
        if col.is_bad(tp_key, pp_key) or tp < 1 or pp < 1:
            return
        where = f"model.{arch.name}"
        if arch.name and not col.is_bad(f"{where}.num_attention_heads", f"{where}.num_query_groups"):
            dims = [
                ("num_attention_heads", arch.num_attention_heads),
                ("num_kv_heads (num_query_groups)", arch.num_kv_heads),
                ("ffn_hidden_size", arch.ffn_size),
                ("padded_vocab_size", arch.padded_vocab_size),
            ] + ([("moe_ffn_hidden_size", arch.expert_ffn_size)] if arch.is_moe else [])
            bad = [f"{what}={size}" for what, size in dims if size and size % tp]
            if bad:
                col.add(tp_key, f"TP={tp} does not divide {where}: {', '.join(bad)}")
        if arch.name and arch.num_layers and arch.num_layers % pp and rc.stage_layer_counts(arch.num_layers) is None:
            col.add(pp_key, f"PP={pp} does not divide {where}.num_layers={arch.num_layers} (an uneven split needs "
                    f"{role}.num_layer_list)")  # fmt: skip
        elif arch.name and arch.num_layers:
            self._check_layer_list(col, role, rc, arch.num_layers, where)
            general = rc.recompute_problems()
            for key, message in rc.recompute_problems(arch.num_layers // pp):
                if (key, message) not in general:
                    col.add(f"{role}.{key}", f"{message} ({where}.num_layers={arch.num_layers}, PP={pp})")
        if arch.is_moe and tp > 1 and not rc.sequence_parallel and not col.is_bad(tp_key):
            col.add(f"{role}.sequence_parallel", f"must be true: megatron trains the MoE layers of {where} under "
                    f"TP={tp} only with sequence parallelism")  # fmt: skip
        ep, ep_key = rc.ep, f"{role}.expert_model_parallel_size"
        if ep > 1 and arch.name and not col.is_bad(ep_key):
            if not arch.is_moe:
                col.add(ep_key, f"EP={ep} needs a mixture-of-experts model; {where} has no num_experts")
            elif arch.num_experts % ep:
                col.add(ep_key, f"EP={ep} does not divide {where}.num_experts={arch.num_experts}")
        if world is None or col.is_bad(world_key):
            return
        cp, cp_key = rc.cp, f"{role}.context_parallel_size"
        if cp < 1 or col.is_bad(cp_key):
            return
        if world % (tp * pp * cp):
            names, sizes = ("TP x PP x CP", f"{tp} x {pp} x {cp}") if cp > 1 else ("TP x PP", f"{tp} x {pp}")
            col.add(cp_key if cp > 1 else tp_key, f"{names} = {sizes} = {tp * pp * cp} does not divide the {world} "
                    f"devices ({world_key})")  # fmt: skip
            return
        dp, mbs = world // (tp * pp * cp), rc.micro_batch_size
        if ep > 1 and (dp * cp) % ep and not col.is_bad(ep_key):
            col.add(ep_key, f"EP={ep} must divide DP x CP = {dp} x {cp} (expert-parallel ranks are carved out of the "
                    f"data-parallel ones: {world} devices / (TP x PP) = {world // (tp * pp)})")  # fmt: skip
        if gbs is None or col.is_bad(f"{role}.micro_batch_size", "megatron_training.global_batch_size"):
            return
        rollout = gbs * n
        what = "filter_groups_train_batch_size" if self.rl_config.filter_groups_enable else "global_batch_size"
        if rollout % (dp * mbs):
            col.add(f"{role}.micro_batch_size", f"{what} x n_samples_per_prompt = {gbs} x {n} = {rollout} "
                    f"responses must be divisible by DP x micro_batch_size = {dp} x {mbs} = {dp * mbs}")  # fmt: skip
        mini = self.rl_config.mini_batch_size
        if mini is not None and not gbs % mini and (mini * n) % (dp * mbs):
            col.add(f"{role}.micro_batch_size", f"a mini-batch of mini_batch_size x n_samples_per_prompt = {mini} x "
                    f"{n} = {mini * n} responses must be divisible by DP x micro_batch_size = {dp} x {mbs} = {dp * mbs}")  # fmt: skip

    @staticmethod
    def _check_layer_list(col: Collector, role: str, rc: RoleConfig, num_layers: int, where: str) -> None:
        """num_layers_per_virtual_pipeline_stage and num_layer_list against the layout. mindrl runs one chunk per
        stage: VPP is refused unless it says num_layers / PP; num_layer_list must give PP entries >= 1 summing to
        num_layers (MindSpeed-RL's rule), and each stage then builds that many layers."""
        vpp, vpp_key = rc.num_layers_per_virtual_pipeline_stage, f"{role}.num_layers_per_virtual_pipeline_stage"
        if vpp is not None and not col.is_bad(vpp_key):
            if vpp == num_layers // rc.pp:
                col.ignore(vpp_key, "one chunk per pipeline stage, as mindrl runs")
            else:
                col.add(vpp_key, f"{vpp} is not supported by mindrl (the interleaved pipeline schedule): it runs one "
                        f"chunk of {where}.num_layers / PP = {num_layers} / {rc.pp} layers per stage; remove it or "
                        f"set it to {num_layers // rc.pp}")  # fmt: skip
        given, key = rc.num_layer_list, f"{role}.num_layer_list"
        if given is None or col.is_bad(key):
            return
        try:
            layers = [int(x) for x in given.split(",")] if isinstance(given, str) else list(given)
        except ValueError:
            col.add(key, f"{given!r} is not a comma-separated list of layer counts like '16,16,16,16'")
            return
        pp = rc.pp
        if len(layers) != pp or sum(layers) != num_layers or min(layers) < 1:
            col.add(key, f"{given!r} must give each of the PP={pp} stages >= 1 layer, {num_layers} in all "
                    f"({where}.num_layers)")  # fmt: skip

    def _check_reward_model(self, col: Collector, world: int | None) -> None:
        """reward_config against the rest: co-located on the actor's devices (MindSpeed-RL refuses reward_config in
        integrated mode; mindrl runs it there, offloaded outside scoring)."""
        rl, rm = self.rl_config, self.reward_config
        res = rl.reward_resource.num_npus if rl.reward_resource is not None else None
        if not rl.rule_reward and rm is None:
            col.add("rl_config.rule_reward", "is false and there is no reward model, so nothing gives a reward: add "
                    "a reward_config section (load: a value-head checkpoint) or set rule_reward: true")  # fmt: skip
        elif not rl.rule_reward and rl.reward_model_weight == 0:
            col.add("rl_config.reward_model_weight", "is 0 and rule_reward is false, so every reward is 0: the "
                    "reward model alone gives the reward; give it a non-zero weight")  # fmt: skip
        if rm is None:
            if rl.reward_resource is not None:
                col.add("rl_config.reward_resource", "is set but there is no reward model: add a reward_config "
                        "section (load: a value-head checkpoint) or remove reward_resource")  # fmt: skip
            knobs = {"reward_model_weight": 1.0, "normalize_reward": False, "reward_clip_range": None}
            for key, default in knobs.items():
                if getattr(rl, key) != default:
                    col.ignore(f"rl_config.{key}", "has no effect without a reward model (reward_config)")
            return
        if rl.use_integrated_worker and res is not None and world is not None and res != world:
            col.add("rl_config.reward_resource.num_npus", f"{res} differs from actor_resource.num_npus={world}: the "
                    "reward model runs on the actor's devices (co-located, offloaded outside scoring); remove "
                    "reward_resource, make them equal, or give it its own devices with use_integrated_worker: false")  # fmt: skip

    def _check_inference(self, col: Collector, world: int | None, world_key: str, gbs: int | None) -> None:
        itp = self.generate_config.infer_tensor_parallel_size
        key = "generate_config.infer_tensor_parallel_size"
        if itp < 1 or col.is_bad(key):
            return
        arch, where = self.model, f"model.{self.model.name}"
        bad = []
        if arch.name and arch.num_attention_heads and arch.num_attention_heads % itp:
            bad.append(f"num_attention_heads={arch.num_attention_heads}")
        kv = arch.num_kv_heads  # vLLM splits the KV heads over TP, or replicates them when TP is a multiple of them
        if arch.name and kv and kv % itp and itp % kv:
            bad.append(f"num_kv_heads={kv} (nor is it a multiple of them, which vLLM would replicate)")
        if bad:
            col.add(key, f"infer TP={itp} does not divide {where}: {', '.join(bad)}")
        iep, iep_key = self.generate_config.infer_expert_parallel_size, "generate_config.infer_expert_parallel_size"
        if self.generate_config.enable_expert_parallel and arch.name and not arch.is_moe:
            col.ignore("generate_config.enable_expert_parallel", f"has no effect on {where}: it has no experts")
        experts_over = iep * itp  # vLLM's EP: TP x its data-parallel size
        if iep > 1 and arch.is_moe and not col.is_bad(iep_key) and arch.num_experts % experts_over:
            col.add(iep_key, f"infer TP x infer EP = {itp} x {iep} does not divide {where}.num_experts="
                    f"{arch.num_experts}")  # fmt: skip
        if world is None:
            return
        if iep > 1 and world % experts_over and not col.is_bad(iep_key):
            col.add(iep_key, f"infer TP x infer EP = {itp} x {iep} does not divide the {world} devices ({world_key})")
        if world % itp:
            col.add(key, f"infer TP={itp} does not divide the {world} devices ({world_key})")
        elif gbs is not None and gbs % (world // itp):
            col.add(key, f"global_batch_size={gbs} prompts must split evenly over the {world // itp} engine replicas "
                    f"(num_npus / infer TP = {world} / {itp})")  # fmt: skip

    @property
    def sequence_length(self) -> int:
        """The longest sequence the trainer sees: the prompt and one turn, or with multi_turn_enable the prompt and a
        whole episode (max_total_response_length, its turns and observations)."""
        rl, max_tokens = self.rl_config, self.generate_config.sampling_config.max_tokens
        total = rl.max_total_response_length if rl.multi_turn_enable and rl.max_total_response_length else 0
        return rl.max_prompt_length + max(max_tokens, total)

    def _check_lengths(self, col: Collector) -> None:
        gen, rl, mt = self.generate_config, self.rl_config, self.megatron_training
        max_tokens = gen.sampling_config.max_tokens
        need = rl.max_prompt_length + max_tokens
        if gen.max_model_len <= rl.max_prompt_length:  # vLLM refuses a prompt that leaves no room for a response
            col.add("generate_config.max_model_len", f"{gen.max_model_len} <= rl_config.max_prompt_length = "
                    f"{rl.max_prompt_length}: the longest prompts leave no room for a response token")  # fmt: skip
        elif gen.max_model_len < need:  # vLLM stops a request at max_model_len (finish_reason 'length'); so does mindrl
            longest = gen.max_model_len - max_tokens
            col.note(f"generate_config.max_model_len={gen.max_model_len} < rl_config.max_prompt_length + "
                     f"sampling_config.max_tokens = {rl.max_prompt_length} + {max_tokens} = {need}: a prompt longer "
                     f"than {longest} tokens gets at most max_model_len - its length response tokens (down to "
                     f"{gen.max_model_len - rl.max_prompt_length} for a {rl.max_prompt_length}-token prompt), stopped "
                     f"with finish_reason 'length' as vLLM does; prompts up to {longest} tokens get max_tokens")  # fmt: skip
        if rl.overlong_buffer_enable:  # MindSpeed-RL's rules
            max_tokens = gen.sampling_config.max_tokens
            if rl.rollout_max_tokens is None:
                rl.rollout_max_tokens = max_tokens
            elif rl.rollout_max_tokens != max_tokens:
                col.add("rl_config.rollout_max_tokens", f"{rl.rollout_max_tokens} differs from "
                        f"generate_config.sampling_config.max_tokens={max_tokens}: the overlong penalty must end at the "
                        "length the rollout stops at")  # fmt: skip
            if rl.overlong_buffer >= max_tokens:
                col.add("rl_config.overlong_buffer", f"{rl.overlong_buffer} must be below "
                        f"sampling_config.max_tokens={max_tokens}")  # fmt: skip
        total = rl.max_total_response_length
        if (
            total is not None
            and 0 < total < gen.sampling_config.max_tokens
            and not col.is_bad("rl_config.max_total_response_length")
        ):  # MindSpeed-RL's rule: an episode holds at least one full turn
            col.add("rl_config.max_total_response_length", f"{total} < generate_config.sampling_config.max_tokens="
                    f"{gen.sampling_config.max_tokens}: an episode must hold a whole first turn")  # fmt: skip
        if rl.multi_turn_enable and total and not col.is_bad("rl_config.max_total_response_length"):
            if gen.max_model_len < rl.max_prompt_length + total:  # the last turn's context: prompt + whole episode
                col.add("generate_config.max_model_len", f"{gen.max_model_len} < rl_config.max_prompt_length + "
                        f"rl_config.max_total_response_length = {rl.max_prompt_length} + {total} = "
                        f"{rl.max_prompt_length + total}: an episode's last turn sees the prompt and every earlier "
                        "turn and observation")  # fmt: skip
        if mt.seq_length is not None and gen.max_model_len < mt.seq_length:
            col.add("generate_config.max_model_len", f"{gen.max_model_len} < megatron_training.seq_length="
                    f"{mt.seq_length} (MindSpeed-RL's rule: the engine must hold a training sequence)")  # fmt: skip
        if rl.use_dynamic_bsz:  # MindSpeed-RL's rule: every row fits its micro-batch's token budget
            uses = {"update": True, "actor": not rl.on_policy, "ref": rl.needs_reference, "critic": rl.needs_critic}
            short = {}
            for use, key in PACKING_USES.items():
                source = key if getattr(rl, key) is not None else "max_packing_token_size"
                if uses[use] and getattr(rl, source) < need:
                    short.setdefault(source, []).append(use)
            for key, which in short.items():
                col.note(f"rl_config.{key}={getattr(rl, key)} tokens per micro-batch ({', '.join(which)}) is below "
                         f"max_prompt_length + sampling_config.max_tokens = {need}: a longer row gets a micro-batch of "
                         "its own")  # fmt: skip
        limit = self.model.max_position_embeddings if self.model.name else None
        if limit is not None and gen.max_model_len > limit:
            col.add("generate_config.max_model_len", f"{gen.max_model_len} exceeds the model's "
                    f"max_position_embeddings={limit} (model.{self.model.name})")  # fmt: skip

    # -- output ----------------------------------------------------------------------------------------
    def resolved(self) -> dict[str, Any]:
        """The derived values the trainer uses (for logging)."""
        rl = self.rl_config
        return {
            "dtype": self.megatron_training.dtype,
            "world_size": rl.world_size,
            "actor_dp": rl.actor_dp,
            "critic_dp": rl.critic_dp,
            "infer_dp": rl.infer_dp,
            "num_mini_batches": rl.num_mini_batches,
            "mini_batch_responses": rl.mini_batch_responses,
            "on_policy": rl.on_policy,
            "needs_critic": rl.needs_critic,
            "kl_in_reward": rl.kl_in_reward,
            "kl_coef_in_loss": rl.kl_coef_in_loss,
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every section, the model(s), the ignored keys and the derived values."""
        out: dict[str, Any] = {"config_name": self.config_name, "source": self.source}
        for name in (
            "megatron_training", "actor_config", "critic_config", "reward_config", "rl_config", "generate_config",
            "profiler_config",
        ):  # fmt: skip
            section = getattr(self, name)
            if section is not None:
                out[name] = section.to_dict()
        out["model"] = self.model.to_dict()
        if self.critic_model is not None:
            out["critic_model"] = self.critic_model.to_dict()
        if self.reward_model is not None:
            out["reward_model"] = self.reward_model.to_dict()
        out["ignored_keys"] = list(self.ignored_keys)
        try:
            out["resolved"] = self.resolved()
        except RuntimeError:  # not bound (an invalid config built directly)
            pass
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
