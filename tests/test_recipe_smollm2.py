"""examples/grpo/grpo_smollm2_cpu.sh in a short form: the real SmolLM2 (the session's cached model), data, conversion,
a short SFT warm start, GRPO for a few small iterations with evaluation before and after (standard decoding), the
export to HF evaluated by mindrl-eval (the general-instructions check off: tests/test_general_check.py), the printed
paths and figures; against the
untuned model the exported one answers more problems and stops sooner."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "examples/grpo/grpo_smollm2_cpu.sh"
ITERS, SFT_ITERS, VAL_PROMPTS = 2, 8, 32
SHRINK = [  # a smaller batch than the recipe's, so that CI takes minutes
    "megatron_training.global_batch_size=8", "rl_config.mini_batch_size=8", "rl_config.n_samples_per_prompt=4",
    "actor_config.lr=5e-5", "actor_config.lr_decay_style=constant", "sft:megatron_training.log_interval=1",
    "sft:megatron_training.micro_batch_size=8", "sft:megatron_training.global_batch_size=8",
]  # fmt: skip


def _run(args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_recipe_help_and_bad_arguments():
    r = subprocess.run(["bash", SCRIPT, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage: bash examples/grpo/grpo_smollm2_cpu.sh")
    r = subprocess.run(["bash", SCRIPT, "--nope"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument '--nope'" in r.stderr
    for name, value, message in [
        ("ITERS", "x", "ITERS must be a positive integer, got 'x'"),
        ("MAX_VALUE", "0", "MAX_VALUE must be a positive integer, got '0'"),
        ("MAX_VALUE", "100", "MAX_VALUE must be at most 99"),
        ("SFT_TARGET", "x", "SFT_TARGET must be columns or equation, got 'x'"),
        ("VAL_SET", "x", "VAL_SET must be heldout or test, got 'x'"),
        ("SFT_ITERS", "-1", "SFT_ITERS must be a non-negative integer, got '-1'"),
        ("GENERAL_MIX", "x", "GENERAL_MIX must be a non-negative integer, got 'x'"),
        ("GENERAL_SAMPLES", "-1", "GENERAL_SAMPLES must be a non-negative integer, got '-1'"),
    ]:
        env = {**os.environ, name: value}
        r = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
        assert r.returncode == 2 and message in r.stderr, (name, value, r.stderr)


def test_recipe_modes_write_apart():
    """The full fine-tune and the LoRA run (`lora`) share OUT, so none of what one writes is the other's: its SFT
    checkpoint (a LoRA SFT saves adapters the full run cannot load), GRPO actor, export, logs and run dirs."""

    def paths(*mode: str) -> dict[str, str]:
        r = subprocess.run(["bash", SCRIPT, *mode, "--paths", "--out", "/o"], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return dict(line.split(": ", 1) for line in r.stdout.splitlines())

    full, lora = paths(), paths("lora")
    assert full.keys() == lora.keys() and len(full) == 7, full
    assert full["sft checkpoint"] == "/o/ckpt/actor_sft" and lora["sft checkpoint"] == "/o/ckpt/actor_lora_sft"
    assert not set(full.values()) & set(lora.values()), (full, lora)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole recipe (training, export, two mindrl-eval engines): over 900 s on shared cores
def test_recipe_short_form(smollm2_hf, tmp_path):
    """The short form trains on the training generator's task with operands <= 20 and is evaluated on its test
    split under standard decoding: the untuned model (mindrl-eval), GRPO's start (the SFT model) and end, the exported
    model (mindrl-eval); the bounds come from the paired (same-problem) spread measured in the run."""
    out, run_dir = tmp_path / "assets", tmp_path / "run"
    env = {
        **os.environ, "VENV": os.path.dirname(os.path.dirname(sys.executable)),
        "MINDRL_MODEL_CACHE": os.path.dirname(os.path.dirname(smollm2_hf)),  # the session's model, no download
        "OUT": str(out), "RUN_DIR": str(run_dir), "EVAL_INTERVAL": str(ITERS), "VAL_PROMPTS": str(VAL_PROMPTS),
        "VAL_SET": "test", "MAX_VALUE": "20", "SFT_ITERS": str(SFT_ITERS), "SFT_TARGET": "equation",
        "GENERAL_MIX": "0",  # arithmetic-only SFT whatever the default: the mix costs a generation pass
        "GENERAL_SAMPLES": "0",  # no general-instructions check (tests/test_general_check.py tests the tool)
    }  # fmt: skip
    r = _run(["--iters", str(ITERS), *SHRINK], env, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-3:-1] == [f"actor checkpoint: {out / 'ckpt' / 'grpo_actor'}", f"run dir: {run_dir}"]
    final = re.fullmatch(r"exported model (\S+): the training generator's test split accuracy (\S+) over (\d+) "
                         r"problems \(untuned (\S+), GRPO start (\S+), in training (\S+); (.*)\)", lines[-1])  # fmt: skip
    assert final, lines[-1]
    assert final[1] == str(out / "ckpt" / "grpo_hf") and int(final[3]) == VAL_PROMPTS
    assert final[7].startswith("standard decoding: greedy, ends at the end token [2] or 48 tokens")
    assert (out / "ckpt" / "grpo_actor" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)

    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["iteration"] for m in rows] == list(range(ITERS + 1))  # row 0: the evaluation before training
    assert [m["iteration"] for m in rows if "val/gsm8k/mean" in m] == [0, ITERS]
    evals, lengths = {}, {}
    for it in (0, ITERS):
        resp = [json.loads(line) for line in open(run_dir / "eval" / f"iter_{it:07d}.jsonl")]
        assert len(resp) == VAL_PROMPTS and all(x["sample"] == -1 and x["iteration"] == it for x in resp)
        assert resp[0]["prompt"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        # standard decoding: no stop string; a response ends at <|im_end|> (not in the text) or at 48 tokens
        assert {x["finish_reason"] for x in resp} <= {"stop", "length"}
        assert all(x["response_length"] == 48 for x in resp if x["finish_reason"] == "length")
        assert sum(x["gsm8k"] for x in resp) / VAL_PROMPTS == pytest.approx(rows[it]["val/gsm8k/mean"])
        evals[it] = {x["index"]: x["gsm8k"] for x in resp}
        lengths[it] = {x["index"]: x["response_length"] for x in resp}
    # the exported directory, evaluated by mindrl-eval, against the trainer's last evaluation: the same problems
    exported = {x["index"]: x["gsm8k"] for x in map(json.loads, open(run_dir / "exported_test.jsonl"))}
    assert exported.keys() == evals[ITERS].keys()
    # the goal: the exported figure within +-0.03 of the in-training one (a problem is 1/32 here: the same count). The
    # same weights decoded greedily by a fresh engine have scored problem for problem as in training in every run
    # measured (docs/real_model.md); a near-tie may still flip under another prefill split, so the count is checked.
    assert abs(sum(exported.values()) - sum(evals[ITERS].values())) / VAL_PROMPTS <= 0.03, (exported, evals[ITERS])

    def printed(x: float) -> str:  # the figures are printed with 3 decimals (0.0625 -> "0.062": round half to even)
        return f"{x:.3f}"

    assert final[2] == printed(sum(exported.values()) / VAL_PROMPTS)
    assert final[5] == printed(rows[0]["val/gsm8k/mean"])
    assert final[6] == printed(rows[-1]["val/gsm8k/mean"])
    assert (out / "ckpt" / "actor_sft" / "latest_checkpointed_iteration.txt").read_text().strip() == str(SFT_ITERS)
    # the untuned model on the same problems, by mindrl-eval under standard decoding
    base_rows = [json.loads(line) for line in open(next((out).glob("base_eval_test_*.jsonl")))]
    base = {x["index"]: x["gsm8k"] for x in base_rows}
    base_len = {x["index"]: x["response_length"] for x in base_rows}
    assert base.keys() == exported.keys()
    assert final[4] == printed(sum(base.values()) / VAL_PROMPTS)
    # Against the untuned model, the exported one (SFT, then GRPO) answers "the answer, then <|im_end|>": the greedy
    # responses shorten, and the accuracy rises, each by more than twice the standard error of the paired
    # (same-problem) differences measured here (for the accuracy, McNemar's sqrt(discordant) / N).
    shorter = [base_len[i] - lengths[ITERS][i] for i in base_len]
    mean = sum(shorter) / VAL_PROMPTS
    sd = math.sqrt(sum((d - mean) ** 2 for d in shorter) / (VAL_PROMPTS - 1))
    assert mean > 2 * sd / math.sqrt(VAL_PROMPTS), (mean, sd)
    rise = (sum(exported.values()) - sum(base.values())) / VAL_PROMPTS
    discordant = sum(base[i] != exported[i] for i in base)
    assert rise > 2 * math.sqrt(discordant) / VAL_PROMPTS, (rise, discordant)
    assert not (run_dir / "general_check.json").exists()
    assert "ordinary instructions: not checked (GENERAL_SAMPLES=0)" in lines
    assert (run_dir / "metrics.png").stat().st_size > 0
    problems = json.load(open(out / "raw" / "test.json"))
    assert max(int(n) for row in problems for n in re.findall(r"\d+", row["problem"])[-2:]) <= 20  # after distractors
