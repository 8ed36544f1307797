"""examples/grpo/grpo_smollm2_cpu.sh in a short form: the real SmolLM2 (the session's cached model), data, conversion,
GRPO for 2 small iterations with evaluation before / during / after, the printed paths, val metrics and eval JSONL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "examples/grpo/grpo_smollm2_cpu.sh"
ITERS, VAL_PROMPTS = 2, 8
SHRINK = [  # a smaller batch and shorter answers than the recipe's, so that CI takes minutes
    "megatron_training.global_batch_size=4", "rl_config.mini_batch_size=4", "rl_config.n_samples_per_prompt=4",
    "generate_config.sampling_config.max_tokens=16",
]  # fmt: skip


def _run(args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_recipe_help_and_bad_arguments():
    r = subprocess.run(["bash", SCRIPT, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage: bash examples/grpo/grpo_smollm2_cpu.sh")
    r = subprocess.run(["bash", SCRIPT, "--nope"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument '--nope'" in r.stderr
    r = subprocess.run(["bash", SCRIPT], cwd=ROOT, env={**os.environ, "ITERS": "x"}, capture_output=True, text=True)
    assert r.returncode == 2 and "ITERS must be a positive integer, got 'x'" in r.stderr
    r = subprocess.run(["bash", SCRIPT], cwd=ROOT, env={**os.environ, "MAX_VALUE": "0"}, capture_output=True, text=True)
    assert r.returncode == 2 and "MAX_VALUE must be a positive integer, got '0'" in r.stderr


@pytest.mark.slow
def test_recipe_short_form(smollm2_hf, tmp_path):
    out, run_dir = tmp_path / "assets", tmp_path / "run"
    env = {
        **os.environ, "VENV": os.path.dirname(os.path.dirname(sys.executable)),
        "MINDRL_MODEL_CACHE": os.path.dirname(os.path.dirname(smollm2_hf)),  # the session's model, no download
        "OUT": str(out), "RUN_DIR": str(run_dir), "EVAL_INTERVAL": "1", "VAL_PROMPTS": str(VAL_PROMPTS),
    }  # fmt: skip
    r = _run(["--iters", str(ITERS), *SHRINK], env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == f"run dir: {run_dir}"
    assert f"actor checkpoint: {out / 'ckpt' / 'grpo_actor'}" in lines
    assert (out / "ckpt" / "grpo_actor" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)

    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["iteration"] for m in rows] == list(range(ITERS + 1))  # row 0: the evaluation before training
    for m in rows:  # evaluated before, after every iteration (EVAL_INTERVAL=1) and at the end
        assert m["val/num_prompts"] == VAL_PROMPTS and 0.0 <= m["val/gsm8k/mean"] <= 1.0
    assert all(0.0 <= m["gsm8k_rewards/mean"] <= 1.0 for m in rows[1:])
    for it, m in enumerate(rows):  # the written responses are the metric's
        resp = [json.loads(line) for line in open(run_dir / "eval" / f"iter_{it:07d}.jsonl")]
        assert len(resp) == VAL_PROMPTS and all(x["sample"] == -1 and x["iteration"] == it for x in resp)
        assert "<|im_start|>assistant\n" in resp[0]["prompt"]  # SmolLM2's chat template
        # one line each: the config's stop string "\n" ends a response (its token, kept, is the response's last)
        assert all("\n" not in x["response"].rstrip("\n") for x in resp)
        assert sum(x["gsm8k"] for x in resp) / VAL_PROMPTS == pytest.approx(m["val/gsm8k/mean"])
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert (out / "raw" / "args.txt").read_text().split()[-2:] == ["--max-value", "20"]  # the recipe's operands
    problems = json.load(open(out / "raw" / "test.json"))
    assert max(int(n) for row in problems for n in re.findall(r"\d+", row["problem"])) <= 20
    summary = next(line for line in lines if line.startswith("held-out accuracy "))
    assert f"in {ITERS} iterations" in summary
