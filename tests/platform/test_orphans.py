"""mindrl.platform.orphans: the checkpoint writer's results-queue server ends with its owner, even a SIGKILLed one,
and leaves nothing behind (no process, no socket folder under the temporary directory)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.procs import alive

OWNER = """
from mindrl.platform.orphans import checkpoint_results_queue
queue = checkpoint_results_queue()
assert checkpoint_results_queue() is queue  # one server per process
queue.put(7)
assert queue.get() == 7
print(queue._manager._process.pid, flush=True)
import time
time.sleep(120)
"""


def test_results_queue_server_ends_with_its_killed_owner(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        server = int(owner.stdout.readline())
        assert alive(server)
    finally:
        owner.kill()
        owner.wait(30)
    deadline = time.monotonic() + 30
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(server), "the queue's server outlived its owner"
    assert not list(tmp_path.iterdir()), f"left behind: {sorted(p.name for p in tmp_path.iterdir())}"
