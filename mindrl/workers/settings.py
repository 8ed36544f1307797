"""What the driver tells the workers to build: plain dataclasses filled from the validated config, so the
workers do not depend on the YAML schema."""

from __future__ import annotations

from dataclasses import dataclass, field

from mindrl.config.settings import LoRASettings, OptimSettings, RecomputeSettings
from mindrl.resharding.residency import ResidencySchedule
from mindrl.rollout.base import RolloutConfig
from mindrl.workers.profiling import ProfileSettings


@dataclass(frozen=True)
class MicroBatching:
    """How a batch is cut into micro-batches and laid out for the model (rl_config's use_dynamic_bsz and
    use_remove_padding; an int where one is accepted means `MicroBatching(rows=that)`)."""

    rows: int = 1
    """Rows per micro-batch (micro_batch_size) when there is no token budget."""
    token_budget: int | None = None
    """Micro-batches of at most this many tokens instead of `rows` rows (use_dynamic_bsz, *max_packing_token_size):
    packed, the rows' real tokens; padded, rows x the micro-batch's widths. None: `rows` rows each."""
    max_rows: int | None = None
    """With a token budget, at most this many rows per micro-batch (*dynamic_max_batch_size); None: no cap."""
    packed: bool = False
    """Each micro-batch's rows packed into one row without padding (use_remove_padding, `PackedRows`). Packed rows
    and token-budget micro-batches compute each row on its own: no prefix groups (`PREFIX_SHARING`)."""


@dataclass(frozen=True)
class PPOLossSettings:
    """Loss knobs of the actor and critic updates (rl_config)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = None
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    """KL(policy || reference) in the actor loss; 0 when the KL is in the reward."""
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    cliprange_value: float | None = 0.5
    rollout_is_threshold: float | None = None
    """Truncated importance sampling cap on pi_old / pi_rollout (None: off)."""
    temperature: float = 1.0
    """The sampling temperature: logprobs are those of softmax(logits / temperature)."""
    policy_loss_mode: str = "vanilla"
    """vanilla: PPO's token-level ratio; gspo: GSPO's sequence-level ratio (`mindrl.algorithms.gspo_policy_loss`)."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm's constant divisor (Dr.GRPO); None: the mini-batch's response width."""
    shuffle_mini_batch: bool = False
    """Take each update's mini-batches in a seeded random order (the same on every rank)."""
    seed: int = 1234
    """Seed of that order (with the scheduler's step count)."""


@dataclass(frozen=True)
class ModelSettings:
    """One trained megatron model (the actor or the critic)."""

    load: str
    """mindrl megatron checkpoint to start from (any TP/PP)."""
    tp: int = 1
    pp: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    """Each pipeline stage's layer count (num_layer_list); None: num_layers / PP each."""
    micro_batch_size: int = 1
    """Rows per micro-batch in the update."""
    forward_micro_batch_size: int = 1
    """Rows per micro-batch in forward-only passes (old logprobs, reference logprobs, values)."""
    remove_padding: bool = False
    """Each micro-batch's rows packed into one row without padding (rl_config.use_remove_padding)."""
    token_budget: int | None = None
    """Tokens per micro-batch in the update instead of micro_batch_size rows (rl_config.use_dynamic_bsz)."""
    max_rows: int | None = None
    """With token_budget: rows per update micro-batch at most (None: no cap)."""
    forward_token_budget: int | None = None
    """Tokens per micro-batch in forward-only passes (old logprobs, values) instead of forward_micro_batch_size."""
    forward_max_rows: int | None = None
    optim: OptimSettings = field(default_factory=OptimSettings)
    total_steps: int = 1
    """Optimizer steps of the whole run (the LR decay horizon)."""
    dtype: str = "float32"
    sequence_parallel: bool = False
    cp: int = 1
    """Context-parallel size (actor_config / critic_config.context_parallel_size)."""
    ep: int = 1
    """Expert-parallel size of a MoE model (expert_model_parallel_size)."""
    moe: dict = field(default_factory=dict)
    """A MoE model's router losses in training, as TransformerConfig keys (`ModelArchConfig.moe_training_overrides`;
    empty: the checkpoint's)."""
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)
    """Activation recomputation in the update (none by default)."""
    seed: int = 1234
    resume_dir: str | None = None
    """Iteration directory to restore the optimizer, LR scheduler and RNG from (None: start fresh)."""
    load_iteration: int | None = None
    """The iteration of `load` to build the model from (None: its tracker's); set when resuming."""
    load_optim: bool = True
    load_rng: bool = True
    lora: LoRASettings | None = None
    """Adapters on the frozen loaded model (lora_target_modules set); None: the whole model trains."""

    def micro_batching(self, forward: bool) -> MicroBatching:
        """How the update (forward False) or a forward-only pass of this model cuts its micro-batches."""
        if forward:
            return MicroBatching(self.forward_micro_batch_size, self.forward_token_budget, self.forward_max_rows,
                                 self.remove_padding)  # fmt: skip
        return MicroBatching(self.micro_batch_size, self.token_budget, self.max_rows, self.remove_padding)


@dataclass(frozen=True)
class IntegratedSettings:
    """Actor + reference + rollout engine in one process per device."""

    actor: ModelSettings
    rollout: RolloutConfig
    """The engine (its `model` dir gives the HF config and tokenizer)."""
    loss: PPOLossSettings = field(default_factory=PPOLossSettings)
    ref_load: str | None = None
    """Reference model checkpoint; None: no reference model of its own (no KL term, or share_backbone)."""
    share_backbone: bool = False
    """rl_config.share_backbone: the reference logprobs come from the actor with its adapters off (no ref_load)."""
    ref_forward_micro_batch_size: int = 1
    ref_token_budget: int | None = None
    """Tokens per micro-batch of the reference logprobs instead of ref_forward_micro_batch_size rows."""
    ref_max_rows: int | None = None
    residency: ResidencySchedule = field(default_factory=ResidencySchedule)
    """What the actor and the reference keep on the device in each phase (the offload_train_* switches)."""
    bucket_size_mb: float = 512
    remote_rollout: bool = False
    """Rollout runs elsewhere (rollout servers, samplers, or separate placement's engine group): no engine is built
    here; `push_weights` / `export_weights` / `send_weights` stream the weights to it."""
    profile: ProfileSettings | None = None
    """Stages to profile (profiler_config); None: none."""
    router_replay: bool = False
    """rl_config.router_replay_mode R2: the old-logprob pass records the routers' choices (`LogProbs.
    routed_experts`) for the update to replay."""

    def ref_micro_batching(self) -> MicroBatching:
        """How the reference logprobs cut their micro-batches (packed as the actor's)."""
        return MicroBatching(
            self.ref_forward_micro_batch_size, self.ref_token_budget, self.ref_max_rows, self.actor.remove_padding
        )


@dataclass(frozen=True)
class CriticSettings:
    critic: ModelSettings
    loss: PPOLossSettings = field(default_factory=PPOLossSettings)
    residency: ResidencySchedule = field(default_factory=ResidencySchedule)
    """What the critic keeps on the device in each phase (by default off it outside its own phases)."""
    profile: ProfileSettings | None = None


@dataclass(frozen=True)
class RewardModelSettings:
    """The reward model (reward_config): a value-head checkpoint run forward only, at its own TP x PP."""

    load: str
    """mindrl megatron checkpoint of the value-head model (`mindrl-convert hf2mcore --orm`)."""
    tp: int = 1
    pp: int = 1
    micro_batching: MicroBatching = field(default_factory=MicroBatching)
    """How its forward pass cuts micro-batches (reward_config.micro_batch_size rows, or rl_config's token budget)."""
    dtype: str = "float32"
    seed: int = 1234
    residency: ResidencySchedule = field(default_factory=ResidencySchedule)
    """When its weights are on the device (by default while scoring only)."""
    profile: ProfileSettings | None = None
