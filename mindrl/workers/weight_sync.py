"""The actor-to-engines weight group of separate placement (`rl_config.rollout_resource`): one process group over the
actor's ranks and the engines' ranks; actor rank 0 broadcasts each bucket of the inference-layout stream to it."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator

import torch

from mindrl.serving.channel import bucket_meta, meta_from_json, meta_to_json, pack, packed_bytes, unpack

ROOT = 0
"""The group rank that sends: the actor's rank 0 (the actor's ranks come first, then the engines')."""
END = -1
"""A header's bucket index that closes a version's stream."""


class WeightSyncError(RuntimeError):
    """The engines got another version than the driver announced, or the stream broke off."""


def join(addr: str, port: int, rank: int, world_size: int, timeout_s: float):
    """This process's end of the weight group (rank 0 hosts the store at addr:port): the platform's backend,
    outside the default world of either model. Blocks until all `world_size` ranks joined."""
    import torch.distributed as dist

    from mindrl.platform import current_platform

    store = dist.TCPStore(addr, port, world_size, rank == ROOT, timeout=datetime.timedelta(seconds=timeout_s))
    group = current_platform().weight_channel_group(dist.PrefixStore("mindrl-weights", store), rank, world_size,
                                                    timeout_s)  # fmt: skip
    return WeightGroup(group, store, rank)


class WeightGroup:
    """One bucket = a header (version, index, meta bytes, flat bytes), its tensors' metadata as JSON, and the tensors
    packed in one flat buffer (`mindrl.serving.channel.pack`): three broadcasts from ROOT."""

    def __init__(self, group, store, rank: int):
        from mindrl.platform import current_platform

        self.group, self._store, self.rank = group, store, rank
        self.device = current_platform().device()

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = ROOT
        self.group.broadcast([t], opts).wait()
        return t

    def _header(self, values: list[int] | None) -> list[int]:
        h = torch.tensor(values or [0, 0, 0, 0], dtype=torch.int64, device=self.device)
        return [int(x) for x in self._bcast(h).cpu()]

    def send(self, version: int, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[int, int]:
        """Actor ranks: broadcast `weights` (a collective stream every actor rank drains; only ROOT's tensors are
        sent, the other actor ranks receive the same bytes) as `version`. Returns (tensors, bytes) sent."""
        from mindrl.serving.client import _buckets

        sent = nbytes = index = 0
        for bucket in _buckets(weights, bucket_bytes):
            meta = json.dumps(meta_to_json(bucket_meta(bucket))).encode()
            flat = pack(bucket, self.device)
            self._header([version, index, len(meta), flat.numel()])
            self._bcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device))
            self._bcast(flat)
            sent, nbytes, index = sent + len(bucket), nbytes + flat.numel(), index + 1
            del flat, bucket
        self._header([version, END, 0, 0])
        return sent, nbytes

    def receive(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Engine ranks: the (name, tensor) stream of `version`, bucket by bucket (lazily: hand it to
        `load_weights` whole). Raises WeightSyncError on another version or a bucket out of order."""
        index = 0
        while True:
            got, i, meta_len, flat_len = self._header(None)
            if got != version:
                raise WeightSyncError(f"the actor sent weight version {got}, the driver announced {version}")
            if i == END:
                return
            if i != index:
                raise WeightSyncError(f"weight version {version}: bucket {i} arrived, {index} expected")
            raw = self._bcast(torch.empty(meta_len, dtype=torch.uint8, device=self.device))
            meta = meta_from_json(json.loads(bytes(raw.cpu().numpy())))
            if packed_bytes(meta) != flat_len:
                raise WeightSyncError(f"weight version {version}, bucket {i}: {flat_len} bytes for a meta of "
                                      f"{packed_bytes(meta)}")  # fmt: skip
            flat = self._bcast(torch.empty(flat_len, dtype=torch.uint8, device=self.device))
            yield from unpack(meta, flat).items()
            index += 1

    def close(self) -> None:
        self.group = self._store = None
