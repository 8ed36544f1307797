"""tools/check_learning.py: the first-window vs last-window rise, its errors, its CLI, and the quickstart script's exit
status through it (`--check-only` on a recorded run whose reward does not rise: no trainer started)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tools.check_learning import Bound, NotLearning, ToolUse, assert_rises, measure, read_rows, tool_use

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "acc_for_ppo_rewards/mean"


def _write(run_dir, values, key=KEY):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i, v in enumerate(values, 1):
            f.write(json.dumps({"iteration": i, key: v}) + "\n")
    return run_dir


def test_measure_and_bound():
    rows = [{"iteration": i, KEY: v} for i, v in enumerate([0.0, 0.5, 1.0, 0.5, 0.75, 1.0], 1)]
    r = measure(rows, KEY, 2)
    assert (r.first, r.last, r.rows, r.window) == (0.25, 0.875, 6, 2) and r.rise == pytest.approx(0.625)
    assert assert_rises(rows, Bound((KEY,), 2, 0.625)).rise == pytest.approx(0.625)
    with pytest.raises(NotLearning, match=r"first-2 mean 0\.250 -> last-2 mean 0\.875 \(6 iterations\): rise "
                       r"\+0\.625, bound \+0\.700: FAILED: the reward did not rise"):  # fmt: skip
        assert_rises(rows, Bound((KEY,), 2, 0.7))


def test_a_loss_falls():
    rows = [{"sft/loss": v} for v in (2.0, 1.8, 1.0, 0.6)]
    assert assert_rises(rows, Bound(("sft/loss",), 2, 1.0, falls=True)).gain(falls=True) == pytest.approx(1.1)
    with pytest.raises(NotLearning, match=r"sft/loss first-2 mean 1\.900 -> last-2 mean 0\.800 \(4 iterations\): fall "
                       r"\+1\.100, bound \+1\.200: FAILED: the loss did not fall"):  # fmt: skip
        assert_rises(rows, Bound(("sft/loss",), 2, 1.2, falls=True))
    with pytest.raises(NotLearning, match="rise -1.100"):  # a loss that falls is not a reward that rises
        assert_rises(rows, Bound(("sft/loss",), 2, 0.0))


def test_measure_skips_rows_without_the_key_and_takes_the_first_key_present():
    rows = [{"iteration": 1, "val/x/mean": 0.2}, {"iteration": 2}, {"iteration": 3, "val/x/mean": None},
            {"iteration": 4, "val/x/mean": 0.6}]  # fmt: skip
    r = measure(rows, ("val/y/mean", "val/x/mean"), 1)
    assert (r.key, r.first, r.last, r.rows) == ("val/x/mean", 0.2, 0.6, 2)


@pytest.mark.parametrize(
    "rows, keys, window, error",
    [
        ([{"iteration": 1}], (KEY,), 1, f"no row holds {KEY} \\(1 rows\\)"),
        ([{KEY: 0.1}] * 9, (KEY,), 5, f"9 rows hold {KEY}, fewer than 2 windows of 5"),
        ([{KEY: 0.1}] * 9, (KEY,), 0, "window must be >= 1, got 0"),
    ],
)
def test_measure_errors(rows, keys, window, error):
    with pytest.raises(ValueError, match=error):
        measure(rows, keys, window)


def test_an_agent_runs_tools_are_checked_too():
    """The tools are used (calls per episode) and answer (the share of call blocks without an error observation),
    over the last window; the reward's rise alone does not pass."""
    rows = [{KEY: r, "agent/tool_calls_mean": c, "agent/tool_calls": 32 * c, "agent/tool_errors": e}
            for r, c, e in [(0.0, 0.5, 8), (0.0, 0.5, 8), (1.0, 1.0, 2), (1.0, 1.0, 0)]]  # fmt: skip
    ok, text = tool_use(rows, ToolUse(2, 0.9, 0.95))
    assert ok and "calls per episode 1.00 (bound 0.90), answered without an error 0.969 (bound 0.950): ok" in text
    assert assert_rises(rows, Bound((KEY,), 2, 0.5, tools=ToolUse(2, 0.9, 0.95))).rise == 1.0
    with pytest.raises(NotLearning, match=r"answered without an error 0\.969 \(bound 0\.990\): FAILED"):
        assert_rises(rows, Bound((KEY,), 2, 0.5, tools=ToolUse(2, 0.9, 0.99)))
    assert not tool_use(rows, ToolUse(3, 0.9, 0.5))[0]  # the first of the three called half the time
    with pytest.raises(ValueError, match="2 rows hold agent/tool_calls_mean, .* fewer than 3"):
        tool_use(rows[:2], ToolUse(3, 0.9, 0.5))


def test_the_retool_quickstarts_check_fails_a_run_whose_tools_are_not_used(tmp_path, capsys):
    from tools.check_learning import BOUNDS, main

    key, (rise, window) = "retool_reward_rewards/mean", (BOUNDS["quickstart-retool"].min_rise, 5)
    run = tmp_path / "run"
    run.mkdir()
    for calls, name in ((1.0, "used"), (0.5, "unused")):
        rows = [{key: 0.0 if i < window else rise, "agent/tool_calls_mean": calls, "agent/tool_calls": 32 * calls,
                 "agent/tool_errors": 0.0} for i in range(2 * window)]  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert main([str(run), "--run", "quickstart-retool"]) == (0 if name == "used" else 1), name
    assert "tool calls per episode 0.50 (bound 0.75)" in capsys.readouterr().err


def test_read_rows_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl: no such file"):
        read_rows(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n{"iter\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        read_rows(str(tmp_path))


def test_cli(tmp_path):
    tool = [sys.executable, os.path.join(ROOT, "tools", "check_learning.py")]
    r = subprocess.run([*tool, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "quickstart-ppo" in r.stdout and "--min-rise" in r.stdout, r.stderr
    run = _write(tmp_path / "run", [0.5] * 5 + [0.9] * 5)
    r = subprocess.run([*tool, str(run), "--window", "5", "--min-rise", "0.3"], capture_output=True, text=True)
    assert r.returncode == 0 and "rise +0.400, bound +0.300: ok" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([*tool, str(run), "--window", "5", "--min-rise", "0.5"], capture_output=True, text=True)
    assert r.returncode == 1 and "rise +0.400, bound +0.500: FAILED" in r.stderr, r.stdout + r.stderr
    r = subprocess.run([*tool, str(run), "--window", "6", "--min-rise", "0.5"], capture_output=True, text=True)
    assert r.returncode == 2 and "fewer than 2 windows of 6" in r.stderr, r.stderr
    loss = _write(tmp_path / "loss", [2.0] * 5 + [1.5] * 5, key="sft/loss")
    r = subprocess.run([*tool, str(loss), "--key", "sft/loss", "--window", "5", "--min-rise", "0.4", "--falls"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and "fall +0.500, bound +0.400: ok" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([*tool, str(run)], capture_output=True, text=True)
    assert r.returncode == 2 and "give --run, or both --window and --min-rise" in r.stderr, r.stderr
