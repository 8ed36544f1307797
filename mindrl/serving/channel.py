"""The rollout server's torch.distributed weight channel: bucket metadata over HTTP, each bucket's bytes as one flat
buffer broadcast in a two-rank group (trainer rank 0, server rank 1), every wait bounded by a timeout."""

from __future__ import annotations

import concurrent.futures
import math
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mindrl.serving.protocol import _is_int, _short, bad_request

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_TIMEOUT_S = 3600.0


@dataclass
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def bucket_meta(bucket: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    out = []
    for name, t in bucket.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"weight {name!r} has dtype {t.dtype}: the dist channel carries {sorted(DTYPES)}")
        out.append(TensorMeta(name, _NAMES[t.dtype], tuple(t.shape)))
    return out


def meta_to_json(meta: list[TensorMeta]) -> list[list[Any]]:
    return [[m.name, m.dtype, list(m.shape)] for m in meta]


def meta_from_json(d: Any) -> list[TensorMeta]:
    """The tensors of a bucket from [[name, dtype, shape], ...]; 422 naming the entry if malformed."""
    if not isinstance(d, list) or not d:
        raise bad_request(f"tensors must be a non-empty list of [name, dtype, shape], got {_short(d)}", 422)
    out = []
    for i, e in enumerate(d):
        ok = isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and e[1] in DTYPES
        ok = ok and isinstance(e[2], list) and all(_is_int(x) and x >= 0 for x in e[2])
        if not ok:
            raise bad_request(
                f"tensors[{i}] must be [name, dtype (one of {sorted(DTYPES)}), shape (non-negative integers)], "
                f"got {_short(e)}",
                422,
            )
        out.append(TensorMeta(e[0], e[1], tuple(e[2])))
    return out


ALIGN = 64
"""Each tensor starts at a multiple of this many bytes in a bucket's buffer (a typed view needs its alignment)."""


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, end


def pack(bucket: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's tensors back to back (aligned) in one flat uint8 buffer on `device`, in `bucket_meta`'s order."""
    sizes = [t.numel() * t.element_size() for t in bucket.values()]
    offsets, total = _offsets(sizes)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for t, n, o in zip(bucket.values(), sizes, offsets):
        flat[o : o + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat


def packed_bytes(meta: list[TensorMeta]) -> int:
    return _offsets([m.nbytes for m in meta])[1]


def unpack(meta: list[TensorMeta], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: tensor} views into `flat` (the inverse of `pack`)."""
    offsets, _ = _offsets([m.nbytes for m in meta])
    return {m.name: flat[o : o + m.nbytes].view(DTYPES[m.dtype]).view(m.shape) for m, o in zip(meta, offsets)}


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _store(host: str, port: int, is_master: bool, timeout_s: float):
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        host, port, 2, is_master, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def local_address_towards(url_host: str, port: int) -> str:
    """This host's address on the route to `url_host` (what the server dials back to reach our TCP store)."""
    family = socket.AF_INET6 if ":" in url_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((url_host, port))  # UDP: no packet sent, only the route chosen
        return s.getsockname()[0]


class ChannelReceiver:
    """The server's end of one transfer's channel. Every collective runs on its own thread, in order (join, then one
    receive per announced bucket); `received` is called there with each complete bucket. The first failure (the
    sender died, a timeout) is kept in `error` and reported once through `on_error`; later receives are skipped."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        prefix: str,
        on_error: Callable[[str], None],
    ):
        from mindrl.platform import current_platform

        self.timeout_s = timeout_s
        self.device = current_platform().device()
        self.error: str | None = None
        self._on_error = on_error
        self._group = None
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mindrl-channel")
        self._thread.submit(self._run, "join", self._join, master_addr, master_port, prefix)

    def _join(self, addr: str, port: int, prefix: str) -> None:
        import torch.distributed as dist

        from mindrl.platform import current_platform

        store = dist.PrefixStore(prefix, _store(addr, port, False, self.timeout_s))
        self._group = current_platform().weight_channel_group(store, 1, 2, self.timeout_s)

    def _run(self, what: str, fn: Callable, *args: Any) -> None:
        if self.error is not None:
            return
        try:
            fn(*args)
        except Exception as e:  # the sender died or hung: gloo/nccl raise RuntimeError with the cause
            self.error = f"the weight channel failed during {what} ({type(e).__name__}: {str(e)[:300]})"
            self._group = None
            self._on_error(self.error)

    def receive(self, index: int, meta: list[TensorMeta], received: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Queue the receive of bucket `index` (the sender broadcasts it after this request is answered)."""
        flat = torch.empty(packed_bytes(meta), dtype=torch.uint8, device=self.device)

        def job() -> None:
            _broadcast(self._group, flat)
            received(unpack(meta, flat))

        self._thread.submit(self._run, f"bucket {index}", job)

    def drain(self) -> str | None:
        """Wait until every queued receive finished (each is bounded by the timeout); the error, if any."""
        try:
            self._thread.submit(lambda: None).result()
        except (concurrent.futures.CancelledError, RuntimeError):  # closed meanwhile (by a failure, or a new begin)
            return self.error or "the weight channel was closed before every bucket arrived"
        return self.error

    def close(self) -> None:
        """Drop the group; a receive still waiting fails by its own timeout (the thread is not joined)."""
        self._group = None
        self._thread.shutdown(wait=False, cancel_futures=True)


class ChannelSender:
    """The trainer's end: hosts the TCP store (a free port on the address that routes to the server), asks the
    server to join through `open` (an HTTP call returning once the server started joining), then joins as rank 0."""

    def __init__(self, server_host: str, server_port: int, timeout_s: float, prefix: str, open: Callable):
        import torch.distributed as dist

        from mindrl.platform import current_platform

        platform = current_platform()
        self.device = platform.device()
        addr = local_address_towards(server_host, server_port)
        raw = _store(addr, 0, True, timeout_s)
        open(addr, raw.port, platform.dist_backend)
        self._group = platform.weight_channel_group(dist.PrefixStore(prefix, raw), 0, 2, timeout_s)
        self._store = raw  # kept alive with the group

    def send(self, flat: torch.Tensor) -> None:
        _broadcast(self._group, flat)

    def close(self) -> None:
        self._group = None
        self._store = None
