"""The benchmarks' working folder: the one the user named (kept), else a temporary one removed when the tool exits.

Models, checkpoints and logs of one benchmark run are a few hundred MB; a tool that made its own folder under /tmp must
not leave it behind (run after run, they filled /tmp)."""

from __future__ import annotations

import atexit
import shutil
import tempfile


def scratch_dir(given: str | None, prefix: str) -> str:
    """`given` when set; otherwise a new temporary folder, deleted at interpreter exit (normal or by an exception)."""
    if given:
        return given
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
