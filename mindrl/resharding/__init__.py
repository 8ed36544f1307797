"""Training layout -> inference layout: stream HF-layout weights from a TP/PP megatron model in bounded
buckets (`stream`), offload / onload the trainer's params, grads and optimizer state (`offload`), and the
two switches of the hybrid engine around a rollout (`manager`)."""

from mindrl.resharding.manager import ShardingManager, ToInferStats
from mindrl.resharding.offload import KINDS, OffloadConfig, OffloadStats, TrainStateOffloader
from mindrl.resharding.stream import DEFAULT_BUCKET_MB, ReshardError, ReshardStats, WeightStreamer, stream_weights

__all__ = [
    "DEFAULT_BUCKET_MB",
    "KINDS",
    "OffloadConfig",
    "OffloadStats",
    "ReshardError",
    "ReshardStats",
    "ShardingManager",
    "ToInferStats",
    "TrainStateOffloader",
    "WeightStreamer",
    "stream_weights",
]
