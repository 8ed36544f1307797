"""Helper processes that must not outlive the process that started them: a parent killed by SIGKILL (the OOM
killer, kill -9, a killed test) cannot stop its children, so they watch for it and exit on their own; and one
helper megatron would start that mindrl does without."""

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
    """Stands in for megatron's `filesystem_async._get_write_results_queue`, which starts a spawned
    multiprocessing Manager (a server process, never stopped) once per process to carry the write results back.
    mindrl saves synchronously: the writer's results are put and taken in the saving process itself (megatron's
    `execute_sync`), so a plain thread-safe queue carries them, and there is no server to outlive a killed worker,
    and none to start. Starting it cost several seconds per save on a busy machine (a fresh interpreter per rank),
    and each put a round trip through it. An asynchronous save would have to send this queue to another process:
    it cannot be pickled, so that fails at once rather than losing the results."""
    global _results_queue
    with _queue_lock:
        if _results_queue is None:
            import queue

            _results_queue = queue.Queue()
        return _results_queue
