"""Thin command-line entry points (console scripts in setup.py)."""

from __future__ import annotations

import atexit
import gc
from http.server import ThreadingHTTPServer

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


class ToolServer(ThreadingHTTPServer):
    """The tool services' HTTP server (mindrl-sandbox, mindrl-retrieval): a thread per request, and a listen backlog
    that holds an agent loop's concurrent calls. http.server's backlog of 5 drops the connections beyond it, whose
    clients resend after a second: with 16 concurrent calls, 7 of 96 took >= 0.9 s (median 0.085 s); none does at
    128 (max 0.26 s, loaded 2-core host)."""

    request_queue_size = 128
    daemon_threads = True


def serve_until_interrupted(server) -> int:
    """Serves an http.server until Ctrl-C, then closes its socket; 0 (a CLI's exit status)."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
