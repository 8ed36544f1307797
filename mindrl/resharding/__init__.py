"""Training layout -> inference layout: HF-layout weight streaming from a TP/PP megatron model (`stream`), offload of
the trainer's state (`offload`) by phase (`residency`), the hybrid engine's two switches around a rollout (`manager`)."""

from mindrl.resharding.manager import ShardingManager, ToInferStats
from mindrl.resharding.offload import KINDS, OffloadConfig, OffloadStats, TrainStateOffloader
from mindrl.resharding.residency import PHASES, ResidencySchedule
from mindrl.resharding.stream import DEFAULT_BUCKET_MB, ReshardError, ReshardStats, WeightStreamer, stream_weights

__all__ = [
    "DEFAULT_BUCKET_MB",
    "KINDS",
    "OffloadConfig",
    "OffloadStats",
    "PHASES",
    "ReshardError",
    "ReshardStats",
    "ResidencySchedule",
    "ShardingManager",
    "ToInferStats",
    "TrainStateOffloader",
    "WeightStreamer",
    "stream_weights",
]
