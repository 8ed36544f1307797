"""Helper processes that must not outlive the process that started them: a parent killed by SIGKILL (the OOM
killer, kill -9, a killed test) cannot stop its children, so they watch for it and exit on their own."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

_results_queue: Any = None
_queue_lock = threading.Lock()


def exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """Start a daemon thread that ends this process once it is re-parented, i.e. once `parent` has died."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="mindrl-parent-watch", daemon=True).start()


def checkpoint_results_queue() -> Any:
    """Stands in for megatron's `filesystem_async._get_write_results_queue`: the same queue on a spawned
    multiprocessing Manager, whose server process megatron starts once per process and never stops; a killed
    worker left it running forever. This one exits with its owner, and leaves no socket file behind."""
    global _results_queue
    with _queue_lock:
        if _results_queue is None:
            import multiprocessing as mp
            from multiprocessing.managers import SyncManager

            # A loopback TCP address, not multiprocessing's default Unix socket: that lives in a pymp-* folder under
            # /tmp which the server removes only on a clean exit, and a server that ends with its killed owner
            # (exit_with_parent) left one behind each time.
            manager = SyncManager(address=("127.0.0.1", 0), ctx=mp.get_context("spawn"))
            manager.start(initializer=exit_with_parent, initargs=(os.getpid(),))
            _results_queue = manager.Queue()  # the proxy keeps its manager (and server) alive
        return _results_queue
