"""What a run leaves on its host if its driver is killed, recorded in the run dir while the run lives: its engines'
shared memory and the temporary folder of its rule-reward processes. The next run in the same dir removes them."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil

logger = logging.getLogger("mindrl.trainer")

SHM_RECORD = ".engine_shm.json"
"""In the run dir while the run's engines live: their /dev/shm names, removed by the next run if this one was
killed (a SIGKILLed driver cannot clean up; Ray's reaper stops the workers, not their shared memory)."""

SHM_PREFIXES = ("mindrl", "psm_")  # our engines' TP segments; vLLM's message-queue buffers (Python's default names)

TEMP_RECORD = ".reward_tmp.json"
"""In the run dir while the run's driver lives: {"host", "path"} of its multiprocessing temporary folder (pymp-*,
where the rule-reward verifier pool's forkserver keeps its socket), removed by the next run on that host if this one
was killed (a killed process runs no exit handler)."""


def _read_record(path: str) -> list | None:
    try:
        with open(path) as f:
            found = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return []
    return found if isinstance(found, list) else []


def remove_leftovers(run_dir: str) -> None:
    """What a previous run in `run_dir` that did not shut down (a SIGKILLed driver) left behind and recorded: its
    engines' shared memory and its rule-reward temporary folder (this host's)."""
    import socket

    from mindrl.rollout.vllm_engine import remove_shm_segments

    path = os.path.join(run_dir, SHM_RECORD)
    idents = _read_record(path)
    if idents is not None:
        for ident in idents:
            if isinstance(ident, str) and ident.startswith(SHM_PREFIXES):
                remove_shm_segments(ident)
        logger.info("removed the shared memory of a previous run in %s that did not shut down", run_dir)
        os.remove(path)
    path = os.path.join(run_dir, TEMP_RECORD)
    folders = _read_record(path)
    if folders is not None:
        host = socket.gethostname()
        for entry in folders:
            folder = entry.get("path") if isinstance(entry, dict) else None
            # only what the record can have named: an absolute multiprocessing folder
            if not (isinstance(folder, str) and os.path.isabs(folder) and os.path.basename(folder).startswith("pymp-")):
                continue
            if entry.get("host") == host:
                shutil.rmtree(folder, ignore_errors=True)
                logger.info("removed the rule-reward temporary folder %s of a previous run in %s that did not "
                            "shut down", folder, run_dir)  # fmt: skip
            else:
                logger.info("a previous run in %s left its rule-reward temporary folder %s on host %s",
                            run_dir, folder, entry.get("host"))  # fmt: skip
        os.remove(path)


def record_shm(run_dir: str, idents: set[str]) -> None:
    """The engines' shared-memory names into SHM_RECORD, for the next run should this one be killed."""
    with open(os.path.join(run_dir, SHM_RECORD), "w") as f:
        json.dump(sorted(idents), f)


def remove_shm(run_dir: str, idents: set[str]) -> None:
    """At shutdown: the segments of engines whose process was killed (this host's), then their record."""
    from mindrl.rollout.vllm_engine import remove_shm_segments

    for ident in idents:
        remove_shm_segments(ident)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(run_dir, SHM_RECORD))


def record_temp(run_dir: str, host: str, path: str) -> None:
    """The rule-reward temporary folder into TEMP_RECORD. Not worth failing the run over (e.g. a full disk)."""
    try:
        with open(os.path.join(run_dir, TEMP_RECORD), "w") as f:
            json.dump([{"host": host, "path": path}], f)
    except OSError as e:
        logger.warning("could not record the rule-reward temporary folder %s: %s", path, e)


def forget_temp(run_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(run_dir, TEMP_RECORD))
