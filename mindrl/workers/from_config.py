"""From the validated config to what the workers build: one function per worker kind, so that the workers never read
the YAML schema and neither the trainer nor the planner re-derives a setting."""

from __future__ import annotations

import os

from mindrl.checkpoint import mcore_ckpt
from mindrl.checkpoint.iterations import critic_dir
from mindrl.checkpoint.resume import ResumePoint
from mindrl.config.settings import LoRASettings, OptimSettings
from mindrl.platform import DETERMINISTIC_ENV, current_platform
from mindrl.platform.profiler import ProfileOptions
from mindrl.resharding import OffloadConfig
from mindrl.resharding.residency import ResidencySchedule
from mindrl.rewards import RewardSettings
from mindrl.rewards.model_scores import RewardModelMix
from mindrl.workers.profiling import ProfileSettings
from mindrl.workers.settings import (
    CriticSettings,
    IntegratedSettings,
    MicroBatching,
    ModelSettings,
    PPOLossSettings,
    RewardModelSettings,
)


def worker_env(cfg) -> dict[str, str]:
    """Environment variables every worker process of the run starts with, beyond the platform's defaults: the
    collectives' buffer size (rl_config.hccl_buffersize) and, with megatron_training.npu_deterministic, the platform's
    deterministic switches and MINDRL_DETERMINISTIC (the process then turns on torch's deterministic algorithms
    before its first kernel)."""
    platform, env = current_platform(), {}
    if cfg.rl_config.hccl_buffersize is not None:
        env.update(platform.collective_buffer_env(cfg.rl_config.hccl_buffersize))
    if cfg.megatron_training.npu_deterministic:
        env.update({**platform.deterministic_env(), DETERMINISTIC_ENV: "1"})
    return env


def rollout_size(cfg) -> int:
    """Responses per iteration."""
    return cfg.megatron_training.global_batch_size * cfg.rl_config.n_samples_per_prompt


def num_mini_batches(cfg) -> int:
    """Optimizer steps per epoch of an iteration (mini_batch_size counts prompts, as in MindSpeed-RL; an iteration
    trains on rl_config.train_batch_size prompts)."""
    return max(1, cfg.rl_config.num_mini_batches)


def total_optimizer_steps(cfg) -> int:
    return cfg.megatron_training.train_iters * num_mini_batches(cfg) * cfg.rl_config.epochs


def _optim(role_cfg, total_steps: int, mt) -> OptimSettings:
    warmup = role_cfg.lr_warmup_iters or int(round((role_cfg.lr_warmup_fraction or 0.0) * total_steps))
    dist_opt = role_cfg.use_distributed_optimizer
    return role_cfg.optim_settings(
        lr_warmup_iters=int(warmup),
        use_distributed_optimizer=bool(mt.use_distributed_optimizer if dist_opt is None else dist_opt),
    )


def _layers_per_stage(role_cfg, arch) -> tuple[int, ...] | None:
    """num_layer_list's stages where it splits the layers otherwise than evenly; None: megatron's even split."""
    counts = role_cfg.stage_layer_counts(int(arch.num_layers)) if arch is not None and arch.num_layers else None
    if counts is None or len(set(counts)) == 1:
        return None
    return tuple(counts)


def model_settings(
    role_cfg, cfg, forward_mbs: int | None, resume_dir: str | None, load: str | None = None, critic: bool = False
) -> ModelSettings:
    """One model's settings (the actor's or, with `critic`, the critic's: `role_cfg`) as the trainer builds it and
    the planner sizes it."""
    mt, rl = cfg.megatron_training, cfg.rl_config
    budget, max_rows = rl.token_budget("critic" if critic else "update")
    forward_budget, forward_max_rows = rl.token_budget("critic" if critic else "actor")
    total = total_optimizer_steps(cfg)
    sp = role_cfg.sequence_parallel
    load = load or role_cfg.load
    return ModelSettings(
        load=load,
        tp=role_cfg.tensor_model_parallel_size,
        pp=role_cfg.pipeline_model_parallel_size,
        layers_per_stage=_layers_per_stage(role_cfg, cfg.critic_model if critic else cfg.model),
        cp=role_cfg.context_parallel_size,
        ep=role_cfg.expert_model_parallel_size,
        moe=(cfg.critic_model if critic else cfg.model).moe_training_overrides(),
        micro_batch_size=role_cfg.micro_batch_size,
        forward_micro_batch_size=forward_mbs or role_cfg.micro_batch_size,
        optim=_optim(role_cfg, total, mt),
        total_steps=total,
        dtype=mt.dtype,
        sequence_parallel=bool(mt.sequence_parallel if sp is None else sp),
        recompute=role_cfg.recompute_settings(),
        seed=mt.seed,
        resume_dir=resume_dir,
        load_iteration=None if resume_dir is None else int(os.path.basename(resume_dir)[len("iter_") :]),
        load_optim=not role_cfg.no_load_optim,
        load_rng=not role_cfg.no_load_rng,
        lora=_lora(role_cfg),
        remove_padding=rl.use_remove_padding,
        token_budget=budget,
        max_rows=max_rows,
        forward_token_budget=forward_budget,
        forward_max_rows=forward_max_rows,
    )


def _lora(role_cfg) -> LoRASettings | None:
    if not role_cfg.lora:
        return None
    return LoRASettings(
        lora_target_modules=list(role_cfg.lora_target_modules),
        lora_r=role_cfg.lora_r,
        lora_alpha=role_cfg.lora_alpha,
        lora_ckpt_filter=role_cfg.lora_ckpt_filter,
    )


def loss_settings(cfg) -> PPOLossSettings:
    rl = cfg.rl_config
    sampling = cfg.generate_config.sampling(1)
    return PPOLossSettings(
        clip_ratio_low=rl.clip_ratio_low if rl.clip_ratio_low is not None else rl.clip_ratio,
        clip_ratio_high=rl.clip_ratio_high if rl.clip_ratio_high is not None else rl.clip_ratio,
        clip_ratio_c=rl.clip_ratio_c,
        entropy_coeff=float(rl.entropy_coeff),
        kl_loss_coef=float(rl.kl_coef_in_loss),
        kl_loss_type=rl.kl_loss_type or rl.kl_penalty,
        loss_agg_mode=rl.loss_agg_mode,
        cliprange_value=rl.cliprange_value,
        rollout_is_threshold=rl.importance_threshold,
        temperature=sampling.temperature if sampling.temperature > 0 else 1.0,
        policy_loss_mode=rl.policy_loss_mode,
        loss_scale_factor=float(rl.loss_scale_factor or sampling.max_tokens),
        shuffle_mini_batch=rl.shuffle_mini_batch,
        seed=cfg.megatron_training.seed,
    )


def engine_model_dir(cfg) -> str:
    """An HF dir with the actor's config.json for the rollout engine: the checkpoint's carried-over HF files,
    else the tokenizer dir."""
    for d in (os.path.join(cfg.actor_config.load, mcore_ckpt.HF_FILES), cfg.megatron_training.tokenizer_name_or_path):
        if d and os.path.isfile(os.path.join(d, "config.json")):
            return d
    raise FileNotFoundError(
        f"no HF config.json for the rollout engine: looked in {cfg.actor_config.load}/{mcore_ckpt.HF_FILES} "
        f"(actor_config.load) and megatron_training.tokenizer_name_or_path={cfg.megatron_training.tokenizer_name_or_path!r}"
    )


def needs_reference(cfg) -> bool:
    return cfg.rl_config.needs_reference


def profile_settings(cfg) -> ProfileSettings | None:
    """profiler_config.integrated for the workers (actor and critic alike); None when profiling is off. A relative
    profile_save_path is taken from the driver's working directory (the workers' may differ)."""
    p = cfg.profiler_config.integrated
    if not p.profile:
        return None
    options = ProfileOptions(
        with_host=p.profile_with_cpu,
        with_device=p.profile_with_npu,
        with_memory=p.profile_with_memory,
        record_shapes=p.profile_record_shapes,
        with_stack=p.profile_with_module,
        level=p.profile_level,
        export_type=p.profile_export_type,
        analyse=p.profile_analysis,
    )
    return ProfileSettings(
        save_path=os.path.abspath(p.profile_save_path),
        stages=p.stages,
        start=p.profile_step_start,
        end=p.profile_step_end,
        ranks=p.ranks,
        options=options,
        mstx=p.mstx,
    )


def integrated_settings(cfg, resume: ResumePoint | None = None) -> IntegratedSettings:
    """resume: where the run resumes (`mindrl.checkpoint.resume.find_resume(cfg)`), None to start at iteration 0."""
    rl, gen = cfg.rl_config, cfg.generate_config
    rollout = gen.rollout_config(engine_model_dir(cfg), cfg.megatron_training.seed)
    # A synced reference (rl_config.sync_ref_model) resumes from the checkpoint's own copy, not the original.
    ref = (resume and resume.ref_dir) or rl.integrated_mode_config.ref_model_load_path or cfg.actor_config.load
    ref_budget, ref_max_rows = rl.token_budget("ref")
    return IntegratedSettings(
        actor=model_settings(cfg.actor_config, cfg, rl.actor_forward_micro_batch_size, resume and resume.actor_dir),
        rollout=rollout,
        loss=loss_settings(cfg),
        ref_load=ref if needs_reference(cfg) and not rl.share_backbone else None,
        share_backbone=needs_reference(cfg) and rl.share_backbone,
        ref_forward_micro_batch_size=rl.ref_forward_micro_batch_size or cfg.actor_config.micro_batch_size,
        ref_token_budget=ref_budget,
        ref_max_rows=ref_max_rows,
        residency=residency(cfg),
        bucket_size_mb=gen.bucket_size_mb,
        # bounded: samplers generate; the actor only exports its weights (no engine of its own)
        # engines on devices of their own (separate placement's rollout_resource): sent over the weight group
        remote_rollout=gen.rollout_mode == "server" or rl.async_mode == "bounded" or own_engines(cfg),
        profile=profile_settings(cfg),
        router_replay=rl.router_replay_mode == "R2",
    )


def own_engines(cfg) -> bool:
    """Separate placement with rl_config.rollout_resource: the engines have devices of their own."""
    rl = cfg.rl_config
    return not rl.use_integrated_worker and rl.rollout_resource is not None


def critic_settings(cfg, resume: ResumePoint | None = None) -> CriticSettings:
    fwd = getattr(cfg.rl_config, "critic_forward_micro_batch_size", None)
    model = model_settings(
        cfg.critic_config, cfg, fwd, resume and resume.critic_dir, critic_dir(cfg, "load"), critic=True
    )
    return CriticSettings(
        critic=model, loss=loss_settings(cfg), residency=residency(cfg), profile=profile_settings(cfg)
    )


def reward_model_settings(cfg) -> RewardModelSettings | None:
    """The reward model's (reward_config); None without one. Its forward passes take reward_config.micro_batch_size
    rows, packed like the others' with rl_config.use_remove_padding."""
    rc = cfg.reward_config
    if rc is None:
        return None
    return RewardModelSettings(
        load=rc.load,
        tp=rc.tensor_model_parallel_size,
        pp=rc.pipeline_model_parallel_size,
        micro_batching=MicroBatching(rows=rc.micro_batch_size, packed=cfg.rl_config.use_remove_padding),
        dtype=cfg.megatron_training.dtype,
        seed=cfg.megatron_training.seed,
        residency=residency(cfg),
        profile=profile_settings(cfg),
    )


def reward_model_mix(cfg) -> RewardModelMix | None:
    """How the reward model's scores enter the reward (rl_config); None without a reward model."""
    if cfg.reward_config is None:
        return None
    rl = cfg.rl_config
    clip = tuple(float(x) for x in rl.reward_clip_range) if rl.reward_clip_range is not None else None
    return RewardModelMix(float(rl.reward_model_weight), bool(rl.normalize_reward), clip)


def residency(cfg) -> ResidencySchedule:
    """Which state of each model is on the device in each phase: the actor's generate_config.offload_train_*
    switches; its weights are needed while scoring unless the run is on-policy (no old logprobs to compute) and the
    reference has weights of its own (share_backbone: the reference pass runs on the actor's).
    Separate placement: a model alone on its devices stays there; a merged reference / reward model leaves outside
    scoring with ref_reward_offload; the actor offloads only for engines in its own processes.
    megatron_training.swap_optimizer: the actor's optimizer state is on the device for its optimizer steps only."""
    rl = cfg.rl_config
    offload = OffloadConfig.from_generate_config(cfg.generate_config)
    swap = bool(cfg.megatron_training.swap_optimizer)
    if rl.use_integrated_worker:
        return ResidencySchedule(offload, actor_forward=not rl.on_policy or rl.share_backbone, swap_optimizer=swap)
    return ResidencySchedule(
        offload if rl.rollout_resource is None else OffloadConfig(),
        swap_optimizer=swap,
        actor_forward=not rl.on_policy,
        critic_offload=False,
        reward_offload=rl.colocate_critic_reward and rl.ref_reward_offload,
        reference_offload=rl.colocate_actor_ref and rl.ref_reward_offload,
    )


def reward_settings(cfg) -> RewardSettings:
    rl = cfg.rl_config
    return RewardSettings(
        verifier_function=rl.verifiers,  # none with rule_reward false: the reward model alone
        verifier_weight=rl.verifier_weights,
        timeout=float(rl.verifier_timeout),
        num_workers=max(1, int(rl.verifier_parallel or 1)),
    )


def sampling(cfg, tokenizer):
    """The rollout's SamplingConfig (n samples per prompt), stopping also at the tokenizer's end tokens (EOS,
    <|im_end|>) where it has them."""
    s = cfg.generate_config.sampling(cfg.rl_config.n_samples_per_prompt)
    s.stop_token_ids = sorted(set(s.stop_token_ids) | set(end_token_ids(tokenizer)))
    return s


def end_token_ids(tokenizer) -> list[int]:
    """The tokenizer's end tokens a response stops at: EOS and <|im_end|>, where it has them."""
    ids = set()
    for tok in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")):
        if isinstance(tok, int) and tok >= 0 and tok != tokenizer.unk_token_id:
            ids.add(tok)
    return sorted(ids)
