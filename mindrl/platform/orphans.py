"""Helper processes that must not outlive their starter (a parent killed by SIGKILL cannot stop them, so they watch for
it and exit), and the helpers megatron's checkpoint writer would start that mindrl does without."""

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


def write_buckets_in_process(
    transform_list: list, use_msc: bool, rank: int, write_buckets: list, global_results_queue: Any
) -> None:
    """Stands in for megatron's `FileSystemWriterAsync.write_preloaded_data_multiproc`, which forks one process per
    checkpoint file and waits on a joinable queue without a timeout. A rank is multithreaded (gloo, OpenMP, vLLM's
    engine when it runs in the same process), and a child forked while another thread holds a lock it needs never
    starts; a child that dies before it reports leaves the wait unanswered too. Either way the save hangs. Here each
    file is written by a thread of the saving process, through megatron's own per-file writer (the bytes on disk are
    the same), and a writer's exception reaches `retrieve_write_results` as in megatron, which raises it on every
    save."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()  # megatron's writer marks its task done on this queue
    kwargs = {"use_msc": True} if use_msc else {}

    def write(index: int, bucket) -> None:
        done.put(index)
        FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, results, done, True, **kwargs)

    with ThreadPoolExecutor(max(1, len(write_buckets)), thread_name_prefix="mindrl-ckpt-write") as pool:
        list(pool.map(write, range(len(write_buckets)), write_buckets))
    written: dict = {}
    while not results.empty():
        index, result = results.get()
        if isinstance(result, Exception):
            global_results_queue.put(result)
            return
        written[index] = result
    global_results_queue.put(written)
