"""The cluster launchers answer --help and refuse a multi-node run on loopback addresses before starting
anything (the multi-node path itself needs a cluster)."""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHERS = [
    "examples/ray_train.sh",
    "examples/ppo/ppo_trainer_qwen25_32b.sh",
    "examples/grpo/grpo_trainer_qwen25_7b.sh",
    "examples/grpo/grpo_trainer_qwen25_32b.sh",
]


@pytest.mark.parametrize("script", LAUNCHERS)
def test_help(script):
    r = subprocess.run(["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "NNODES" in r.stdout


def test_multi_node_on_loopback_is_refused():
    env = {**os.environ, "NNODES": "2", "MASTER_ADDR": "127.0.0.1"}
    r = subprocess.run(["bash", "examples/ray_train.sh", "ppo_qwen25_32b_A3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert "MASTER_ADDR=127.0.0.1 is a loopback address but NNODES=2" in r.stderr
