"""The trainer's logging sinks (console, metrics.jsonl, TensorBoard, wandb/SwanLab, rollouts.jsonl) and the pure metric
helpers the loop calls; only the driver logs. Metric names: docs/metrics.md."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mindrl.config.placement import job_devices
from mindrl.trainer.trackers import TrackerRun, TrackerSpec, import_tracker, open_tracker
from mindrl.workers.results import DeviceLedger

logger = logging.getLogger("mindrl.trainer")

METRICS_FILE = "metrics.jsonl"
ROLLOUTS_FILE = "rollouts.jsonl"
TENSORBOARD_DIR = "tensorboard"

# The console line shows the first key present of each group, in this order.
_KL_KEYS = ("actor/reward_kl_penalty", "actor/kl_loss", "actor/ppo_kl")  # the KL to the reference first


# ------------------------------------------------------------------------------------------------ JSON lines
def _to_float(key: str, value: Any) -> float:
    """A metric as a Python float: tensors and numpy scalars come from workers, JSON and TensorBoard want floats."""
    if isinstance(value, bool | int | float):
        return float(value)
    if hasattr(value, "item"):
        try:
            return float(value.item())
        except (RuntimeError, ValueError, TypeError) as e:  # e.g. a tensor with more than one element
            raise TypeError(f"metric {key!r}: expected one number, got {type(value).__name__} ({e})") from e
    raise TypeError(f"metric {key!r}: expected a number or a one-element tensor, got {type(value).__name__}")


def _jsonable(value: Any) -> Any:
    """Rollout rows as strict JSON: tensors/arrays to lists, non-finite floats to null."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and numpy scalars
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fsync(f) -> None:
    """Flush to the OS and to disk: a killed job or a lost node must keep every iteration it reported."""
    f.flush()
    os.fsync(f.fileno())


def _read_jsonl(path: str) -> Iterator[tuple[int, str, dict | None]]:
    """(line number, raw line, parsed object or None when the line is not a JSON object with an int iteration)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
                row = None
            yield n, line, row


def _truncate_jsonl(path: str, last_kept: int, on_kept: Callable[[dict], None] | None = None) -> int:
    """Keep only the lines of `path` whose iteration is <= `last_kept`; returns how many lines were dropped.

    Why: a run resumed from the checkpoint of iteration `last_kept` re-runs the later iterations, and the file
    must not hold them twice. Unreadable lines (a line cut short by a crash) are dropped too, or the next
    append would glue onto them. The file is rewritten only if something is dropped, via a temporary file
    and os.replace, so a crash during the rewrite leaves the old file whole.
    """
    if not os.path.exists(path):
        return 0
    dropped, bad = 0, []
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for n, line, row in _read_jsonl(path):
            if row is None:
                bad.append(n)
            elif row["iteration"] > last_kept:
                dropped += 1
            else:
                out.write(line if line.endswith("\n") else line + "\n")
                if on_kept is not None:
                    on_kept(row)
        _fsync(out)
    if bad:
        logger.warning("%s: dropped %d unreadable line(s) (line numbers %s)", path, len(bad), bad[:10])
    if dropped:
        logger.info("%s: dropped %d line(s) of iterations after %d (resumed run)", path, dropped, last_kept)
    if dropped or bad:
        os.replace(tmp, path)
    else:
        os.remove(tmp)
    return dropped + len(bad)


def last_logged_iteration(run_dir: str) -> int:
    """The highest iteration in `run_dir/metrics.jsonl`, or 0 when there is none (no file, empty file)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        return 0
    return max((row["iteration"] for _, _, row in _read_jsonl(path) if row is not None), default=0)


# ------------------------------------------------------------------------------------------------ console
def format_eta(seconds: float) -> str:
    """`3m05s`, `1h02m03s`, `42s`: compact enough to sit at the end of every console line."""
    s = max(0, round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def _reward_field(metrics: Mapping[str, float]) -> tuple[str, float] | None:
    """reward/mean, else the first verifier's `{name}_rewards/mean` (labelled with the verifier's name)."""
    if "reward/mean" in metrics:
        return "reward", metrics["reward/mean"]
    for k, v in metrics.items():
        if k.endswith("_rewards/mean"):
            return k.split("/", 1)[0][:-1], v  # "acc_rewards/mean" -> "acc_reward"
    return None


def _val_field(metrics: Mapping[str, float]) -> tuple[str, float] | None:
    """The first verifier's held-out greedy mean (`val/<verifier>/mean`), labelled `val <verifier>`."""
    for k, v in metrics.items():
        parts = k.split("/")
        if len(parts) == 3 and parts[0] == "val" and parts[2] == "mean" and parts[1] not in _VAL_NOT_VERIFIERS:
            return f"val {parts[1]}", v
    return None


_VAL_NOT_VERIFIERS = ("reward", "response_length", "sampled_response_length")


# ------------------------------------------------------------------------------------------------ sinks
class MetricsLogger:
    """Per-iteration metrics to the console, `run_dir/metrics.jsonl`, TensorBoard and the trackers (wandb, SwanLab).

    Every `log` call is flushed (and fsynced) before it returns, so a crash loses nothing that was logged.

    Resume: `start_iteration` is the iteration the run restarts after (the checkpoint's iteration; 0 for a
    fresh run). Lines of metrics.jsonl with a later iteration are removed on open, so the resumed run appends
    without duplicates; TensorBoard events with a later step are hidden through SummaryWriter's `purge_step`; each
    tracker starts a new run whose steps go on from the checkpoint's iteration.
    A fresh run (start_iteration=0) in an old run dir therefore starts from an empty metrics.jsonl (an earlier run's
    row 0, its evaluation before training, goes too). The ETA is seeded with the timing/all of the kept iterations.

    The console line goes to the `mindrl.trainer` logger (INFO) and, when `console` is true, also to stdout,
    because Ray drivers are often run with logging left unconfigured.
    """

    def __init__(
        self,
        run_dir: str,
        total_iterations: int,
        use_tensorboard: bool = True,
        trackers: Sequence[TrackerSpec] = (),
        config: dict | None = None,
        console: bool = True,
        start_iteration: int = 0,
    ):
        self.run_dir = run_dir
        self.total_iterations = total_iterations
        self.console = console
        self._iteration_seconds: list[float] = []
        self._tb = None
        self._trackers: list[TrackerRun] = []
        self._file = None
        packages = [import_tracker(spec) for spec in trackers]  # first: a missing package fails before any file

        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)

        def seed_eta(row: dict) -> None:
            if isinstance(row.get("timing/all"), int | float):
                self._iteration_seconds.append(float(row["timing/all"]))

        try:
            # a fresh run keeps nothing, not even an earlier run's evaluation before training (iteration 0)
            last_kept = start_iteration if start_iteration > 0 else -1
            _truncate_jsonl(self.path, last_kept, seed_eta)
            self._file = open(self.path, "a", encoding="utf-8")  # closed in close()
            if use_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, TENSORBOARD_DIR), purge_step=last_kept + 1)
            for spec, package in zip(trackers, packages, strict=True):
                self._trackers.append(open_tracker(spec, package, config))
        except BaseException:
            self.close()  # do not leave a tracker run (and its processes) open behind a failed construction
            raise

    # -------------------------------------------------------------------------------------------- logging
    def log(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        """Write one iteration to every sink. Non-finite values become JSON null (with a warning naming them)."""
        if self._file is None:
            raise RuntimeError("MetricsLogger.log() after close()")
        values = {k: _to_float(k, v) for k, v in metrics.items() if k != "iteration"}

        bad = [k for k, v in values.items() if not math.isfinite(v)]
        if bad:
            logger.warning("iteration %d: non-finite metrics written as null to %s: %s", iteration, METRICS_FILE, bad)
        row = {"iteration": iteration, **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        _fsync(self._file)

        if self._tb is not None:
            for k, v in values.items():  # TensorBoard draws NaN/Inf honestly, so they go in as they are
                self._tb.add_scalar(k, v, iteration)
            self._tb.flush()
        for tracker in self._trackers:  # NaN/Inf as they are, like TensorBoard
            tracker.log(values, iteration)

        if "timing/all" in values and math.isfinite(values["timing/all"]):
            self._iteration_seconds.append(values["timing/all"])
        line = self.console_line(iteration, values)
        logger.info("%s", line)
        if self.console:
            print(line, file=sys.stdout, flush=True)

    def console_line(self, iteration: int, values: Mapping[str, float]) -> str:
        """`iter 3/20 | reward 0.412 | kl 0.0031 | 12.4 s | ETA 3m05s`; fields whose metric is absent are left out.

        The ETA uses the median iteration time so far, so one slow iteration (the first, with its
        compilation and warm-up) does not swing it.
        """
        parts = [f"iter {iteration}/{self.total_iterations}"]
        reward = _reward_field(values)
        if reward is not None:
            parts.append(f"{reward[0]} {reward[1]:.3f}")
        val = _val_field(values)
        if val is not None:
            parts.append(f"{val[0]} {val[1]:.3f}")
        kl = next((values[k] for k in _KL_KEYS if k in values), None)
        if kl is not None:
            parts.append(f"kl {kl:.3g}")
        if "timing/all" in values:
            parts.append(f"{values['timing/all']:.1f} s")
        if self._iteration_seconds:
            remaining = max(0, self.total_iterations - iteration)
            parts.append(f"ETA {format_eta(statistics.median(self._iteration_seconds) * remaining)}")
        return " | ".join(parts)

    # -------------------------------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._file is not None:
            _fsync(self._file)
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception:  # one tracker failing to finish must not keep the others (and their processes) open
                logger.exception("closing %s failed", type(tracker).__name__)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RolloutLogger:
    """Sampled rollouts (prompt, response, per-verifier and total reward, ...) to `run_dir/rollouts.jsonl`
    every `interval` iterations (`interval <= 0` disables it): the one place to read what the policy writes.

    `start_iteration`, when given, truncates rows of later iterations as MetricsLogger does on resume. It
    defaults to None (append, keep everything) so that forgetting it never deletes rollout history.
    """

    def __init__(self, run_dir: str, interval: int, start_iteration: int | None = None):
        self.run_dir = run_dir
        self.interval = interval
        self.path = os.path.join(run_dir, ROLLOUTS_FILE)
        if interval > 0:
            os.makedirs(run_dir, exist_ok=True)
            if start_iteration is not None:
                _truncate_jsonl(self.path, start_iteration)

    def maybe_log(self, iteration: int, rows: Iterable[Mapping[str, Any]]) -> bool:
        """Append `rows` (each tagged with `iteration`) when the interval says so; returns whether it wrote."""
        if self.interval <= 0 or iteration % self.interval:
            return False
        with open(self.path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"iteration": iteration, **_jsonable(row)}, allow_nan=False) + "\n")
            _fsync(f)
        return True


# ------------------------------------------------------------------------------------------------ helpers
def throughput_metrics(
    *,
    response_length_mean: float,
    prompt_length_mean: float,
    global_batch_size: int,
    n_samples_per_prompt: int,
    world_size: int,
    timing: Mapping[str, float],
) -> dict[str, float]:
    """Tokens per second per device, MindSpeed-RL's definitions (docs/zh/algorithms/ppo.md):

        tokens = (response_length/mean + prompt_length/mean) * global_batch_size * n_samples_per_prompt
        e2e_tps = tokens / world_size / timing/all
        update_tps = tokens / world_size / timing/update
        vllm_tps = tokens / world_size / timing/rollout

    `world_size` is every device of the job (in integrated mode: the actor's). Mean lengths, never the max:
    a max-length throughput flatters the numbers. A metric whose timing is absent or zero is left out.
    """
    tokens = (response_length_mean + prompt_length_mean) * global_batch_size * n_samples_per_prompt / world_size
    out = {}
    for name, key in (("e2e_tps", "timing/all"), ("update_tps", "timing/update"), ("vllm_tps", "timing/rollout")):
        seconds = timing.get(key)
        if seconds is not None and seconds > 0:
            out[name] = tokens / seconds
    return out


def iteration_throughput(cfg, metrics: Mapping[str, float]) -> dict[str, float]:
    """`throughput_metrics` of one RL iteration from its metrics (lengths and timings) and the run's config."""
    return throughput_metrics(
        response_length_mean=metrics["response_length/mean"],
        prompt_length_mean=metrics["prompt_length/mean"],
        global_batch_size=cfg.rl_config.train_batch_size,  # the prompts trained on (dynamic sampling: kept ones)
        n_samples_per_prompt=cfg.rl_config.n_samples_per_prompt,
        world_size=job_devices(cfg),  # every device of the job (separate placement: all groups')
        timing=metrics,
    )


def memory_metrics(per_device: Sequence[DeviceLedger]) -> dict[str, float]:
    """`memory/device_bytes/{phase}`: the bytes the trained models' state (weights, grads, optimizer) held on the
    device with the most in that phase, and `memory/device_bytes/{phase}/{model}.{term}` on that same device (they
    add up to it). `per_device[i]`: the merged ledgers of the workers on device i. The rollout engine's memory is
    not counted."""
    out: dict[str, float] = {}
    phases = list(dict.fromkeys(p for ledger in per_device for p in ledger.phases))
    for phase in phases:
        top = max(per_device, key=lambda ledger: ledger.total(phase))
        out[f"memory/device_bytes/{phase}"] = float(top.total(phase))
        for model, terms in sorted(top.phases.get(phase, {}).items()):
            for term, n in terms.items():
                out[f"memory/device_bytes/{phase}/{model}.{term}"] = float(n)
    return out


@contextmanager
def timed(timing: dict[str, float], key: str) -> Iterator[None]:
    """timing[key] = the seconds the block took."""
    t0 = time.perf_counter()
    yield
    timing[key] = time.perf_counter() - t0


def stats_metrics(prefix: str, values: torch.Tensor | Iterable[float]) -> dict[str, float]:
    """`{prefix}/mean`, `{prefix}/max`, `{prefix}/min` of a 1-D tensor or list; {} when it is empty (a mean of
    nothing would be a NaN that looks like a bug)."""
    v = torch.as_tensor(values if isinstance(values, torch.Tensor) else list(values)).double()
    if v.dim() != 1:
        raise ValueError(f"stats_metrics({prefix!r}): expected a 1-D tensor or list, got shape {tuple(v.shape)}")
    if v.numel() == 0:
        return {}
    return {f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


class Timer:
    """Accumulates wall-clock seconds per phase into `timing/<name>` keys of a dict.

        timer = Timer()
        with timer("all"):
            with timer("rollout"):
                ...
        timer.add("rule_reward", seconds_measured_in_a_worker)
        metrics.update(timer.timing)

    Each `with` measures on its own, so phases may nest or overlap; the same name entered twice adds up.
    """

    def __init__(self, timing: dict[str, float] | None = None):
        self.timing: dict[str, float] = {} if timing is None else timing

    @staticmethod
    def key(name: str) -> str:
        return name if name.startswith("timing/") else f"timing/{name}"

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` to `timing/<name>` (for times measured elsewhere, e.g. the slowest worker's)."""
        k = self.key(name)
        self.timing[k] = self.timing.get(k, 0.0) + float(seconds)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)
