"""One gloo transport device per process, shared by all its gloo groups (`GLOO_SOCKET_IFNAME` honoured as torch does):
torch's one per group means an event-loop thread each, preempting the OpenMP threads (docs/performance.md)."""

from __future__ import annotations

import datetime
import os
import threading

import torch.distributed.distributed_c10d as c10d

_LOCK = threading.Lock()
_DEVICES: list = []
_TORCH_GLOO = c10d.ProcessGroupGloo


def _shared_devices() -> list:
    with _LOCK:
        if not _DEVICES:
            names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
            if names:
                _DEVICES.extend(_TORCH_GLOO.create_device(interface=name) for name in names)
            else:
                _DEVICES.append(_TORCH_GLOO.create_default_device())
        return list(_DEVICES)


class SharedDeviceGloo(_TORCH_GLOO):
    """torch's ProcessGroupGloo on the process's shared devices (2 worker threads per device, as torch's). A caller
    that passes torch's own options (its other constructor) gets exactly those."""

    def __init__(self, store, rank, size, timeout: datetime.timedelta = c10d.default_pg_timeout):
        if isinstance(timeout, _TORCH_GLOO._Options):
            super().__init__(store, rank, size, timeout)
            return
        options = _TORCH_GLOO._Options()
        options._devices = _shared_devices()
        options._threads = 2 * len(options._devices)
        options._timeout = timeout
        super().__init__(store, rank, size, options)


def share_one_device() -> None:
    """Make every gloo process group created from now on in this process use the shared device(s). Idempotent."""
    c10d.ProcessGroupGloo = SharedDeviceGloo
