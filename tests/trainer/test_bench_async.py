"""tools/bench_async.py end to end on the tiny GRPO: the synchronous mode and bounded with one `mindrl-sampler`, one
warm-up and one measured iteration each; it prints the table and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.trainer.rl_helpers import ROOT

pytestmark = pytest.mark.slow


def test_bench_async_runs_sync_and_bounded(assets, tmp_path):
    out = tmp_path / "async.json"
    paths = [f"actor_config.load={assets / 'actor'}", f"megatron_training.data_path={assets / 'data' / 'train'}",
             f"megatron_training.tokenizer_name_or_path={assets / 'hf'}",
             f"rl_config.integrated_mode_config.ref_model_load_path={assets / 'actor'}"]  # fmt: skip
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_async.py"), "--modes", "sync,bounded", "--samplers",
           "1", "--iterations", "1", "--warmup", "1", "--workdir", str(tmp_path / "work"), "--timeout", "600",
           "--json", str(out), *paths]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["modes"]}
    assert set(rows) == {"sync", "bounded"}
    for r in rows.values():
        assert r["iterations"] == 1 and r["tokens_per_s"] > 0 and 0 <= r["idle_frac"] <= 1
    assert rows["sync"]["staleness_max"] == 0 and 0 <= rows["bounded"]["staleness_max"] <= 1
    assert rows["bounded"]["sampler_tps"] > 0
    assert "bounded" in proc.stdout and "tokens/s" in proc.stdout
