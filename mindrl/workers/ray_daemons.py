"""Ray's log monitor as a thread of the driver, for the private single-node cluster `group.start_ray` starts (one
Python process fewer: docs/performance.md, footprint)."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("mindrl.workers")

_POLL_S = 0.1  # Ray's log monitor process waits as long when no file has new lines


class DriverLogMonitor:
    """Ray's log monitor (it tails the workers' stdout / stderr files and publishes new lines, which this driver
    prints) run as a thread of the driver instead of a process of its own (~80 MiB of RSS for a loop over a few files).
    `start` stops Ray's process first; without Ray's LogMonitor class (another Ray) the process is left running."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, node) -> bool:
        try:
            from ray._private.log_monitor import LogMonitor, is_proc_alive
            from ray._raylet import GcsClient

            monitor = LogMonitor(
                node.node_ip_address,
                node.get_logs_dir_path(),
                GcsClient(address=node.gcs_address),
                is_proc_alive,
                gcs_address=node.gcs_address,
            )
            node.kill_log_monitor(check_alive=False)
        except Exception as exc:  # an older/newer Ray: its log monitor process keeps running
            logger.debug("Ray's log monitor stays a process (%s)", exc)
            return False
        self._thread = threading.Thread(target=self._run, args=(monitor,), name="mindrl-ray-log-monitor", daemon=True)
        self._thread.start()
        return True

    def _run(self, monitor) -> None:
        import time

        try:
            last_listed = time.time()
            while not self._stop.is_set():
                if monitor.should_update_filenames(last_listed):  # Ray's own loop (LogMonitor.run), stoppable
                    monitor.update_log_filenames()
                    last_listed = time.time()
                monitor.open_closed_files()
                if not monitor.check_log_files_and_publish_updates():
                    self._stop.wait(_POLL_S)
            monitor.check_log_files_and_publish_updates()  # the last lines written before the stop
        except Exception:  # never take the driver down: the workers' output still goes to their files
            import ray

            if self._stop.is_set() or not ray.is_initialized():  # Ray shut down under it (ray.shutdown, not stop_ray)
                return
            logger.warning(
                "the driver's Ray log monitor stopped; workers' output stays in Ray's log files", exc_info=True
            )

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
