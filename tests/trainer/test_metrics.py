"""The trainer's logging sinks and metric helpers (no Ray, no megatron): metrics.jsonl, resume truncation,
console line, TensorBoard, rollouts.jsonl, throughput/stats/timer, and the plot tool (wandb and SwanLab:
test_trackers.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import time

import numpy as np
import pytest
import torch

from mindrl.trainer.metrics import (
    MetricsLogger,
    RolloutLogger,
    Timer,
    format_eta,
    last_logged_iteration,
    stats_metrics,
    throughput_metrics,
)
from tools.plot_metrics import main as plot_main
from tools.plot_metrics import plot_metrics


def _lines(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _logger(run_dir, total=20, **kw) -> MetricsLogger:
    kw.setdefault("use_tensorboard", False)
    kw.setdefault("console", False)
    return MetricsLogger(str(run_dir), total, **kw)


# ------------------------------------------------------------------------------------------------ metrics.jsonl
def test_jsonl_rows_are_flushed_and_converted(tmp_path):
    log = _logger(tmp_path)
    log.log(1, {"reward/mean": torch.tensor(0.5), "actor/lr": np.float32(1e-6), "n": np.int64(3), "b": True})
    # Read while the logger is still open: a crash right now must not lose iteration 1.
    rows = _lines(tmp_path / "metrics.jsonl")
    assert rows == [{"iteration": 1, "reward/mean": 0.5, "actor/lr": pytest.approx(1e-6), "n": 3.0, "b": 1.0}]
    assert all(type(v) is float for k, v in rows[0].items() if k != "iteration")
    log.log(2, {"reward/mean": 0.75})
    log.close()
    log.close()  # idempotent
    assert [r["iteration"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2]
    with pytest.raises(RuntimeError, match="after close"):
        log.log(3, {})


def test_non_number_metric_names_the_key(tmp_path):
    with _logger(tmp_path) as log, pytest.raises(TypeError, match="'actor/bad'"):
        log.log(1, {"actor/bad": torch.ones(3)})


def test_nan_and_inf_are_null_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mindrl.trainer"), _logger(tmp_path) as log:
        log.log(1, {"a": float("nan"), "b": float("inf"), "c": -math.inf, "d": 1.0, "e": torch.tensor(float("nan"))})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"iteration": 1, "a": None, "b": None, "c": None, "d": 1.0, "e": None}
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and all(k in warning[0] for k in ("'a'", "'b'", "'c'", "'e'")) and "'d'" not in warning[0]


# ------------------------------------------------------------------------------------------------ resume
def test_resume_truncates_later_iterations(tmp_path):
    with _logger(tmp_path) as log:
        for it in range(1, 6):
            log.log(it, {"timing/all": float(it)})
    assert last_logged_iteration(str(tmp_path)) == 5

    with _logger(tmp_path, start_iteration=3) as log:
        assert [r["iteration"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        assert log._iteration_seconds == [1.0, 2.0, 3.0]  # the ETA is seeded from the kept iterations
        log.log(4, {"timing/all": 40.0})
    assert [r["iteration"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert _lines(tmp_path / "metrics.jsonl")[-1]["timing/all"] == 40.0
    assert last_logged_iteration(str(tmp_path)) == 4


def test_resume_drops_a_line_cut_short_by_a_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1, "a": 1.0}\n{"iteration": 2, "a": 2.0}\n{"iteration": 3, "a"')
    assert last_logged_iteration(str(tmp_path)) == 2
    with _logger(tmp_path, start_iteration=2) as log:
        log.log(3, {"a": 3.0})
    assert _lines(path) == [{"iteration": 1, "a": 1.0}, {"iteration": 2, "a": 2.0}, {"iteration": 3, "a": 3.0}]


def test_last_logged_iteration_without_a_file(tmp_path):
    assert last_logged_iteration(str(tmp_path / "nothing")) == 0


# ------------------------------------------------------------------------------------------------ console
def test_console_line_with_eta(tmp_path, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="mindrl.trainer"), _logger(tmp_path, console=True) as log:
        log.log(1, {"reward/mean": 0.1, "actor/ppo_kl": 0.01, "timing/all": 10.0})
        log.log(2, {"reward/mean": 0.2, "actor/ppo_kl": 0.02, "timing/all": 14.0})
        log.log(3, {"reward/mean": 0.412, "actor/kl_loss": 0.0031, "actor/ppo_kl": 0.5, "timing/all": 11.0})
    out = capsys.readouterr().out.splitlines()
    # median(10, 14, 11) = 11 s x 17 remaining iterations = 187 s
    assert out[-1] == "iter 3/20 | reward 0.412 | kl 0.0031 | 11.0 s | ETA 3m07s"
    assert out[0] == "iter 1/20 | reward 0.100 | kl 0.01 | 10.0 s | ETA 3m10s"
    assert [r.getMessage() for r in caplog.records if r.name == "mindrl.trainer"] == out


def test_console_line_fallbacks(tmp_path, capsys):
    with _logger(tmp_path, total=5) as log:
        assert log.console_line(1, {}) == "iter 1/5"
        line = log.console_line(2, {"acc_rewards/mean": 0.25, "actor/reward_kl_penalty": 0.125})
        assert line == "iter 2/5 | acc_reward 0.250 | kl 0.125"
        log.log(5, {"timing/all": 3.0})
    assert capsys.readouterr().out == ""  # console=False: the logger only


def test_format_eta():
    assert [format_eta(s) for s in (0, 42.4, 185, 3723, -5)] == ["0s", "42s", "3m05s", "1h02m03s", "0s"]


# ------------------------------------------------------------------------------------------------ tensorboard
def _tb_scalars(run_dir, tag) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _f32(x: float):
    return pytest.approx(x, rel=1e-6)  # TensorBoard stores float32


def test_tensorboard_scalars_are_readable_and_resume_purges(tmp_path):
    with _logger(tmp_path, use_tensorboard=True) as log:
        for it in (1, 2, 3):
            log.log(it, {"reward/mean": it / 10})
        # flushed per iteration: readable before close
        assert _tb_scalars(tmp_path, "reward/mean") == [(1, _f32(0.1)), (2, _f32(0.2)), (3, _f32(0.3))]
    time.sleep(1.1)  # event file names carry the second they were created; keep the resumed file sorted last
    with _logger(tmp_path, use_tensorboard=True, start_iteration=1) as log:
        log.log(2, {"reward/mean": 0.9})
    assert _tb_scalars(tmp_path, "reward/mean") == [(1, _f32(0.1)), (2, _f32(0.9))]


# ------------------------------------------------------------------------------------------------ rollouts
def test_rollout_logger_interval(tmp_path):
    rows = [{"prompt": "1+1=", "response": "2", "acc": 1.0, "reward": torch.tensor(1.0), "ids": torch.tensor([1, 2])}]
    logger = RolloutLogger(str(tmp_path), interval=2)
    assert [logger.maybe_log(it, rows) for it in (1, 2, 3, 4)] == [False, True, False, True]
    got = _lines(tmp_path / "rollouts.jsonl")
    assert [r["iteration"] for r in got] == [2, 4]
    assert got[0] == {"iteration": 2, "prompt": "1+1=", "response": "2", "acc": 1.0, "reward": 1.0, "ids": [1, 2]}

    logger = RolloutLogger(str(tmp_path), interval=2, start_iteration=3)  # resume after iteration 3
    assert [r["iteration"] for r in _lines(tmp_path / "rollouts.jsonl")] == [2]
    logger.maybe_log(4, [{"reward": float("nan"), "acc": None}])
    assert _lines(tmp_path / "rollouts.jsonl")[-1] == {"iteration": 4, "reward": None, "acc": None}


def test_rollout_logger_disabled(tmp_path):
    for interval in (0, -1):
        assert not RolloutLogger(str(tmp_path / "run"), interval).maybe_log(0, [{"a": 1}])
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ helpers
def test_throughput_formula():
    timing = {"timing/all": 100.0, "timing/update": 40.0, "timing/rollout": 25.0}
    got = throughput_metrics(
        response_length_mean=300.0,
        prompt_length_mean=100.0,
        global_batch_size=32,
        n_samples_per_prompt=8,
        world_size=16,
        timing=timing,
    )
    # (300 + 100) * 32 * 8 / 16 = 6400 tokens per device
    assert got == {"e2e_tps": pytest.approx(64.0), "update_tps": pytest.approx(160.0), "vllm_tps": pytest.approx(256.0)}
    partial = throughput_metrics(
        response_length_mean=1.0,
        prompt_length_mean=1.0,
        global_batch_size=1,
        n_samples_per_prompt=1,
        world_size=1,
        timing={"timing/all": 2.0, "timing/update": 0.0},
    )
    assert partial == {"e2e_tps": 1.0}  # no timing, no number: never a division by zero


def test_stats_metrics():
    assert stats_metrics("response_length", torch.tensor([3, 1, 2])) == {
        "response_length/mean": 2.0,
        "response_length/max": 3.0,
        "response_length/min": 1.0,
    }
    assert stats_metrics("x", [0.5, 1.5]) == {"x/mean": 1.0, "x/max": 1.5, "x/min": 0.5}
    assert stats_metrics("x", []) == {}
    with pytest.raises(ValueError, match="1-D"):
        stats_metrics("x", torch.zeros(2, 2))


def test_timer_nests_overlaps_and_adds():
    timer = Timer()
    with timer("all"):
        with timer("rollout"):
            time.sleep(0.02)
        with timer("rollout"):
            time.sleep(0.01)
    timer.add("rule_reward", 1.5)
    timer.add("timing/rule_reward", 0.5)
    t = timer.timing
    assert set(t) == {"timing/all", "timing/rollout", "timing/rule_reward"}
    assert t["timing/all"] >= t["timing/rollout"] >= 0.03 and t["timing/rule_reward"] == 2.0

    shared: dict[str, float] = {"timing/x": 1.0}
    Timer(shared).add("x", 1.0)
    assert shared == {"timing/x": 2.0}


# ------------------------------------------------------------------------------------------------ plot tool
def test_plot_metrics_png(tmp_path, capsys):
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for it in range(1, 11):
            row = {
                "iteration": it,
                "reward/mean": it / 10,
                "acc_rewards/mean": it / 20,
                "response_length/mean": 100.0 + it,
                "response_length/max": 200.0,
                "response_length/min": 10.0,
                "actor/ppo_kl": None if it == 5 else 0.01 * it,  # a non-finite value logged as null
                "e2e_tps": 50.0,
            }
            f.write(json.dumps(row) + "\n")
    assert plot_main([str(tmp_path), "--smooth", "3"]) == 0
    png = tmp_path / "metrics.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    out = tmp_path / "sub" / "x.png"
    assert plot_metrics(str(tmp_path), str(out)) == str(out) and out.stat().st_size > 0


def test_plot_metrics_pass_at_k_panel(tmp_path):
    from tools.plot_metrics import pass_at_k

    rows = [{"iteration": it, "reward/mean": 0.1} for it in range(1, 9)]
    for it in (0, 2, 4, 6, 8):  # evaluated iterations: greedy mean and pass@1, 2, 4
        rows.append({"iteration": it, "val/acc/mean": it / 10, "val/acc/pass@1": it / 20, "val/acc/pass@4": it / 10,
                     "val/acc/pass@2": None if it == 4 else it / 15, "val/response_length/mean": 9.0})  # fmt: skip
    with (tmp_path / "metrics.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    curves = pass_at_k(rows)
    assert list(curves) == ["acc"] and sorted(curves["acc"]) == [0, 2, 4, 6, 8]
    assert curves["acc"][8] == [(1, 0.4), (2, 8 / 15), (4, 0.8)] and curves["acc"][4] == [(1, 0.2), (4, 0.4)]
    with_panel = plot_metrics(str(tmp_path), str(tmp_path / "with.png"))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if "val/acc/pass@1" not in r))
    without = plot_metrics(str(tmp_path), str(tmp_path / "without.png"))
    from PIL import Image

    assert Image.open(with_panel).size[1] > Image.open(without).size[1]  # a fourth row: the pass@k panel


def test_plot_metrics_errors_name_the_file(tmp_path, capsys):
    assert plot_main([str(tmp_path)]) == 1
    assert str(tmp_path / "metrics.jsonl") in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="metrics.jsonl holds no iterations"):
        plot_metrics(str(tmp_path))


def test_plot_metrics_help(capsys):
    with pytest.raises(SystemExit) as e:
        plot_main(["--help"])
    assert e.value.code == 0 and "--smooth" in capsys.readouterr().out
