"""mindrl.platform.orphans' checkpoint results queue: after `apply()`, megatron's filesystem writer saves without
the multiprocessing Manager server it would start once per process and never stop (a SIGKILLed worker used to
leave it running forever, and starting it cost seconds per rank): a real save leaves no process and nothing in the
temporary directory, and loads back exactly."""

from __future__ import annotations

import os
import subprocess
import sys

SAVE = """
import os, sys, psutil, torch, torch.distributed as dist
from mindrl.platform import current_platform
current_platform().apply()
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
w = torch.randn(64, 32)
for i in range(2):  # the second save reuses the queue
    os.makedirs(sys.argv[1] + str(i))
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w * i, replica_id=0)}, sys.argv[1] + str(i))
    assert not psutil.Process().children(recursive=True), psutil.Process().children(recursive=True)
    got = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 32))}, sys.argv[1] + str(i))
    assert torch.equal(got["w"], w * i)
q = fa._get_write_results_queue()
assert q is fa._get_write_results_queue() and q.empty()  # one per process, every result taken
dist.destroy_process_group()
print("saved", type(q).__module__, type(q).__name__)
"""


def test_megatron_saves_leave_no_helper_process_or_temp_files(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    args = [str(tmp_path / "ckpt"), str(tmp_path / "store")]
    out = subprocess.run([sys.executable, "-c", SAVE, *args], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "saved queue Queue"
    # (torch's inductor makes its cache folder there; multiprocessing's would be pymp-*)
    left = sorted(p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor"))
    assert not left, f"left behind: {left}"
