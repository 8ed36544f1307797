"""Training layout -> inference layout: stream HF-layout weights from a TP/PP megatron model in bounded
buckets (`stream`), and offload / onload the trainer's params, grads and optimizer state (`offload`)."""

from mindrl.resharding.stream import DEFAULT_BUCKET_MB, ReshardError, ReshardStats, WeightStreamer, stream_weights

__all__ = ["DEFAULT_BUCKET_MB", "ReshardError", "ReshardStats", "WeightStreamer", "stream_weights"]
