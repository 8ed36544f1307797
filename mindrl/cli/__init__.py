"""Thin command-line entry points (console scripts in setup.py)."""

from __future__ import annotations

import atexit
import gc

_FAST_EXIT = False


def fast_exit() -> None:
    """At interpreter exit, after every other atexit handler (this one, registered first, runs last), freeze the
    garbage collector: Python's last full collection over the modules a CLI loaded (torch, transformers, Ray...)
    then has nothing to traverse (0.5-1 s per process exit). Objects still alive then are left to the OS, as for
    any object Python does not collect at exit; files, loggers and Ray are closed by their own handlers before."""
    global _FAST_EXIT
    if not _FAST_EXIT:
        atexit.register(gc.freeze)
        _FAST_EXIT = True
