"""One gloo transport device per process, shared by every gloo process group of that process.

torch gives each gloo process group its own TCP device, and each device runs an event-loop thread that wakes every
10 ms (gloo's `epoll_wait` timeout) whether or not anything is sent. Megatron's parallel state and vLLM's group
coordinators make dozens of groups per process (34 in a TP1 integrated worker), so the process wakes about 3,400
times a second. On a CPU host those wake-ups land on the cores the training's OpenMP threads occupy: each one
preempts a thread that its partner then waits for at the next barrier. A gloo device is built to carry many contexts
(its pairs are matched by sequence number on one listener, and one loop serves them all), so every group of the
process uses the same device here: one loop thread, about 100 wake-ups a second.

`GLOO_SOCKET_IFNAME` is honoured as torch honours it: one device per listed interface, shared the same way.
"""

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
