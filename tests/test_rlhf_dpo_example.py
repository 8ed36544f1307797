"""examples/rlhf/train_dpo_cpu.sh in a short form, as from a fresh clone (its own defaults under ./outputs): the data,
the model, a few DPO steps with the SFT term; checks the plumbing (files, the printed accuracy, the last line)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.procs import project_view

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "examples/rlhf/train_dpo_cpu.sh"


def test_train_dpo_cpu_help():
    r = subprocess.run(["bash", SCRIPT, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "DPO_ITERS" in r.stdout and "run dir: PATH" in r.stdout, r.stderr
    r = subprocess.run(["bash", SCRIPT, "bogus"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


@pytest.mark.slow
def test_train_dpo_cpu_short_form(tmp_path):
    view = project_view(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RLHF", "RUN_DIR", "LOAD", "REF_MODEL")}
    # the script's `python` where the project has no .venv of its own: this interpreter's
    env.update(DPO_ITERS="4", PREF_FTX="0.1", PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"])
    r = subprocess.run(["bash", SCRIPT], cwd=view, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "run dir: ./outputs/dpo_tiny_cpu"
    pattern = re.compile(r"^DPO held-out reward accuracy: (\S+), margin (\S+)$")
    acc = [float(m.group(1)) for m in map(pattern.match, lines) if m]
    assert acc and 0.0 <= acc[-1] <= 1.0
    out = tmp_path / "project" / "outputs"
    assert (out / "rlhf" / "ckpt" / "dpo" / "latest_checkpointed_iteration.txt").is_file()
    rows = [json.loads(line) for line in open(out / "dpo_tiny_cpu" / "metrics.jsonl")]
    assert [m["iteration"] for m in rows] == [1, 2, 3, 4]
    assert all(m["dpo/sft_loss"] > 0 for m in rows) and "dpo/val_rewards/accuracy" in rows[-1]
    config = json.load(open(out / "dpo_tiny_cpu" / "dpo_config.json"))
    assert '"pref_ftx": 0.1' in json.dumps(config)
