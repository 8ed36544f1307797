"""Thin command-line entry points (console scripts in setup.py)."""

from __future__ import annotations

import atexit
import gc

_FAST_EXIT = False


def fast_exit() -> None:
    """Freeze the garbage collector at interpreter exit, after every atexit handler registered later (Ray's,
    logging's, a run's writers): Python's final full collection over what a CLI loaded (torch, transformers, Ray...)
    then has nothing to traverse (docs/performance.md, start-up). Objects still in reference cycles then are left to
    the OS, as Python already does for any object alive at exit. Call it first in `main`; idempotent."""
    global _FAST_EXIT
    if not _FAST_EXIT:
        atexit.register(gc.freeze)
        _FAST_EXIT = True


def serve_until_interrupted(server) -> int:
    """Serves an http.server until Ctrl-C, then closes its socket; 0 (a CLI's exit status)."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
