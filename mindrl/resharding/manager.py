"""The hybrid engine's two switches: `reshard_to_infer` (offload optimizer + grads, stream the weights into
the rollout engine, then offload params if configured) and `reshard_to_train` (onload what training needs next)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mindrl.resharding.offload import OffloadStats, TrainStateOffloader
from mindrl.resharding.stream import ReshardStats, WeightStreamer


@dataclass
class ToInferStats:
    reshard: ReshardStats
    offload_before: OffloadStats  # optimizer / grads, before streaming
    offload_after: OffloadStats | None  # params, after streaming (None unless offload_train_param)


class ShardingManager:
    """Owns one actor's streamer and offloader. Both switches are collective over the model's ranks."""

    def __init__(self, streamer: WeightStreamer, offloader: TrainStateOffloader):
        self.streamer = streamer
        self.offloader = offloader

    def reshard_to_infer(self, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> ToInferStats:
        kinds = self.offloader.config.kinds
        # Params are streamed from the device, so they leave it only after the engine has its copy.
        before = self.offloader.offload([k for k in kinds if k != "param"])
        reshard = self.streamer.load_into(load_weights)
        after = self.offloader.offload(["param"]) if "param" in kinds else None
        return ToInferStats(reshard, before, after)

    def reshard_to_train(self, kinds: Iterable[str] | None = None) -> OffloadStats:
        """Onload the offloaded state of `kinds` (default: all of it); the rest stays off the device."""
        return self.offloader.onload(kinds)
