"""`mindrl.cli.fast_exit` (every CLI's first call): the interpreter's final garbage collection is skipped, while every
atexit handler registered after it (Ray's, logging's flush, ...) still runs first."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, gc, logging, sys
from mindrl.cli import fast_exit

if sys.argv[2] == "fast":
    fast_exit()
    fast_exit()  # once is enough: a second call registers nothing

log = logging.getLogger("probe")
log.addHandler(logging.FileHandler(sys.argv[1]))  # flushed and closed by logging's own atexit handler
log.warning("last line")

@atexit.register
def later():  # registered after fast_exit, so it runs before the freeze
    print("later handler: frozen", gc.get_freeze_count(), flush=True)

class Cycle:
    def __del__(self):
        print("collected at exit", flush=True)

gc.disable()  # no automatic collection before the exit: only the final one can find the cycle
c = Cycle()
c.self = c
del c
"""


def _run(tmp_path, mode: str) -> str:
    log = tmp_path / f"{mode}.log"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log), mode], capture_output=True, text=True, check=True, timeout=120
    )
    assert log.read_text() == "last line\n"
    return out.stdout


def test_handlers_run_then_the_final_collection_is_skipped(tmp_path):
    assert _run(tmp_path, "plain") == "later handler: frozen 0\ncollected at exit\n"  # Python's final collection
    assert _run(tmp_path, "fast") == "later handler: frozen 0\n"
