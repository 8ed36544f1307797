"""What the driver tells the workers to build: plain dataclasses filled from the validated config, so the
workers do not depend on the YAML schema."""

from __future__ import annotations

from dataclasses import dataclass, field

from mindrl.config.settings import OptimSettings, RecomputeSettings
from mindrl.resharding import OffloadConfig
from mindrl.rollout.base import RolloutConfig
from mindrl.workers.profiling import ProfileSettings
from mindrl.workers.rl_model import PPOLossSettings


@dataclass(frozen=True)
class ModelSettings:
    """One trained megatron model (the actor or the critic)."""

    load: str
    """mindrl megatron checkpoint to start from (any TP/PP)."""
    tp: int = 1
    pp: int = 1
    micro_batch_size: int = 1
    """Rows per micro-batch in the update."""
    forward_micro_batch_size: int = 1
    """Rows per micro-batch in forward-only passes (old logprobs, reference logprobs, values)."""
    optim: OptimSettings = field(default_factory=OptimSettings)
    total_steps: int = 1
    """Optimizer steps of the whole run (the LR decay horizon)."""
    dtype: str = "float32"
    sequence_parallel: bool = False
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)
    """Activation recomputation in the update (none by default)."""
    seed: int = 1234
    resume_dir: str | None = None
    """Iteration directory to restore the optimizer, LR scheduler and RNG from (None: start fresh)."""
    load_iteration: int | None = None
    """The iteration of `load` to build the model from (None: its tracker's); set when resuming."""
    load_optim: bool = True
    load_rng: bool = True


@dataclass(frozen=True)
class IntegratedSettings:
    """Actor + reference + rollout engine in one process per device."""

    actor: ModelSettings
    rollout: RolloutConfig
    """The engine (its `model` dir gives the HF config and tokenizer)."""
    loss: PPOLossSettings = field(default_factory=PPOLossSettings)
    ref_load: str | None = None
    """Reference model checkpoint; None: no reference model (no KL term)."""
    ref_forward_micro_batch_size: int = 1
    offload: OffloadConfig = field(default_factory=lambda: OffloadConfig(True, True, False))
    bucket_size_mb: float = 512
    remote_rollout: bool = False
    """Rollout runs on rollout servers: no engine is built here; `push_weights` streams the weights to them."""
    profile: ProfileSettings | None = None
    """Stages to profile (profiler_config); None: none."""


@dataclass(frozen=True)
class CriticSettings:
    critic: ModelSettings
    loss: PPOLossSettings = field(default_factory=PPOLossSettings)
    offload: bool = True
    profile: ProfileSettings | None = None
    """Keep the critic's params, grads and optimizer state off the device between its own phases."""
