"""mindrl.platform.orphans' checkpoint writer: after `apply()`, megatron's filesystem writer saves without the
multiprocessing Manager server it would start once per process and never stop (a SIGKILLed worker used to leave it
running forever, and starting it cost seconds per rank), and without forking a writer process per file (a fork of a
multithreaded rank can hang the save): a real save forks nothing, leaves no process and nothing in the temporary
directory, and loads back exactly; a writer's error ends the save with that error."""

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
def no_fork():
    raise AssertionError("the save forked")
os.fork = no_fork
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
w, v = torch.randn(64, 32), torch.randn(48, 16)
def sharded(a, b):
    return {"w": ShardedTensor.from_rank_offsets("w", a, replica_id=0),
            "v": ShardedTensor.from_rank_offsets("v", b, replica_id=0)}
for i in range(2):  # the second save reuses the queue
    os.makedirs(sys.argv[1] + str(i))
    dist_checkpointing.save(sharded(w * i, v * i), sys.argv[1] + str(i))
    files = sorted(f for f in os.listdir(sys.argv[1] + str(i)) if f.endswith(".distcp"))
    assert len(files) == 2, files  # two files, written by two threads
    assert not psutil.Process().children(recursive=True), psutil.Process().children(recursive=True)
    got = dist_checkpointing.load(sharded(torch.empty(64, 32), torch.empty(48, 16)), sys.argv[1] + str(i))
    assert torch.equal(got["w"], w * i) and torch.equal(got["v"], v * i)
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


FAILING_WRITE = """
import os, sys, torch, torch.distributed as dist
from mindrl.platform import current_platform
current_platform().apply()
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")
fa._write_item = full_disk
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
os.makedirs(sys.argv[1])
try:
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(8, 8), replica_id=0)}, sys.argv[1])
except BaseException as e:  # torch's CheckpointException is not an Exception
    chain, cause = [], e
    while cause is not None:
        chain.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    print("raised", " <- ".join(chain).replace("\\n", " "))
else:
    print("saved")
dist.destroy_process_group()
"""


def test_a_failing_checkpoint_write_raises_its_error_instead_of_hanging(tmp_path):
    args = [str(tmp_path / "ckpt"), str(tmp_path / "store")]
    out = subprocess.run([sys.executable, "-c", FAILING_WRITE, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("raised") and "No space left on device" in last, last
