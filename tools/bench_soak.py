#!/usr/bin/env python
"""Soak test: the tiny PPO run (configs/ppo_tiny_cpu.yaml through mindrl-train) for N iterations, checking
that nothing in the loop grows with the iteration number (per-iteration time, memory, fds, threads, /dev/shm).

Builds its own assets in --workdir as examples/quickstart_cpu.sh does, minus the SFT warm start (the base
model is the actor and the reference; the critic is its trunk + a value head), then runs mindrl-train while
sampling the whole process tree (the driver, Ray's daemons and workers): summed RSS, open fds, threads, and
the entries in /dev/shm. From metrics.jsonl (`timing/all`) and those samples it compares the first and the
last --window iterations: median iteration time, and a linear fit of RSS in MiB per 100 iterations. Prints a
table with pass/fail against the thresholds; `--json PATH` writes the same numbers.

    python tools/bench_soak.py --iterations 200 --json /tmp/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.proc_tree import TreeSampler  # noqa: E402


@dataclass
class Sample:
    """One look at the process tree, tagged with the iterations finished so far."""

    t: float  # seconds since the run started
    iteration: int  # rows in metrics.jsonl when sampled
    rss_mb: float  # summed RSS of the tree
    fds: int  # open file descriptors, summed
    threads: int  # threads, summed
    procs: int  # processes in the tree
    shm: int  # entries in /dev/shm (machine-wide)
    rss_by_role: dict[str, float] = field(default_factory=dict)  # summed RSS (MiB) per role (see `role_of`)


@dataclass
class Thresholds:
    """Pass/fail limits of `analyze`."""

    time_ratio: float = 1.15  # last window's median iteration time / first window's
    rss_mb_per_100: float = 20.0  # RSS slope over the last window, MiB per 100 iterations
    fds_growth: int = 16  # max over the last window - max over the first window
    threads_growth: int = 8
    shm_growth: int = 2


def _fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 when fewer than 2 distinct xs)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0


def analyze(iter_times: list[float], samples: list[Sample], window: int = 50,
            thresholds: Thresholds | None = None) -> dict:  # fmt: skip
    """Compare the first and the last `window` iterations (the very first iteration is warm-up: excluded).
    iter_times[i] is iteration i+1's wall time; samples carry the iteration count they were taken at.
    Returns the figures, a `checks` dict of name -> bool, and `passed`."""
    th = thresholds or Thresholds()
    n = len(iter_times)
    if n < 3:
        raise ValueError(f"need at least 3 iterations to compare first and last windows, got {n}")
    w = max(1, min(window, (n - 1) // 2))
    first_it, last_it = (2, 1 + w), (n - w + 1, n)  # 1-based, inclusive
    first_t = iter_times[first_it[0] - 1 : first_it[1]]
    last_t = iter_times[last_it[0] - 1 : last_it[1]]

    def in_window(lo_hi: tuple[int, int]) -> list[Sample]:
        # a sample at count k was taken while iteration k+1 ran
        return [s for s in samples if lo_hi[0] <= s.iteration + 1 <= lo_hi[1]]

    s_first, s_last = in_window(first_it), in_window(last_it)

    def slope(ss: list[Sample], role: str | None = None) -> float:
        ys = [s.rss_mb if role is None else s.rss_by_role.get(role, 0.0) for s in ss]
        return 100.0 * _fit_slope([float(s.iteration) for s in ss], ys)

    def peak(ss: list[Sample], key: str) -> int:
        return max((getattr(s, key) for s in ss), default=0)

    out = {
        "iterations": n,
        "window": w,
        "first_window": list(first_it),
        "last_window": list(last_it),
        "time_first_s": statistics.median(first_t),
        "time_last_s": statistics.median(last_t),
        "rss_first_mb": statistics.median([s.rss_mb for s in s_first]) if s_first else 0.0,
        "rss_last_mb": statistics.median([s.rss_mb for s in s_last]) if s_last else 0.0,
        "rss_slope_first_mb_per_100": slope(s_first),
        "rss_slope_last_mb_per_100": slope(s_last),
        # where a slope comes from: each role's own slope over the last window (roles seen in it)
        "rss_slope_last_by_role": {r: slope(s_last, r) for r in sorted({r for s in s_last for r in s.rss_by_role})},
        "rss_last_by_role_mb": {
            r: statistics.median([s.rss_by_role.get(r, 0.0) for s in s_last])
            for r in sorted({r for s in s_last for r in s.rss_by_role})
        },
        "samples_first": len(s_first),
        "samples_last": len(s_last),
    }
    out["time_ratio"] = out["time_last_s"] / out["time_first_s"] if out["time_first_s"] > 0 else float("inf")
    for key in ("fds", "threads", "shm", "procs"):
        out[f"{key}_first"], out[f"{key}_last"] = peak(s_first, key), peak(s_last, key)
    checks = {
        "time": out["time_ratio"] <= th.time_ratio,
        "rss": out["rss_slope_last_mb_per_100"] <= th.rss_mb_per_100,
        "fds": out["fds_last"] - out["fds_first"] <= th.fds_growth,
        "threads": out["threads_last"] - out["threads_first"] <= th.threads_growth,
        "shm": out["shm_last"] - out["shm_first"] <= th.shm_growth,
        "samples": len(s_first) >= 2 and len(s_last) >= 2,
    }
    out["thresholds"] = asdict(th)
    out["checks"] = checks
    out["passed"] = all(checks.values())
    return out


# ------------------------------------------------------------------------------------------- sampling
class SoakSampler(TreeSampler):
    """Samples a process and its descendants every `interval` seconds (psutil), tagging each sample with the
    number of rows in `metrics_path` at the time."""

    def __init__(self, pid: int, metrics_path: str, interval: float = 0.5) -> None:
        self.metrics_path = metrics_path
        self.samples: list[Sample] = []
        self._t0 = time.monotonic()
        super().__init__(pid, interval)

    def _iterations(self) -> int:
        try:
            with open(self.metrics_path, "rb") as f:
                return f.read().count(b"\n")
        except OSError:
            return 0

    def sample(self, procs: list) -> None:
        import psutil

        rss = fds = threads = 0
        by_role: dict[str, float] = {}
        for p in procs:
            try:
                with p.oneshot():
                    r = p.memory_info().rss
                    rss += r
                    fds += p.num_fds()
                    threads += p.num_threads()
                    role = self.role(p)
                    by_role[role] = by_role.get(role, 0.0) + r / 2**20
            except psutil.Error:  # exited between listing and reading
                pass
        try:
            shm = len(os.listdir("/dev/shm"))
        except OSError:
            shm = 0
        it = self._iterations()
        self.samples.append(
            Sample(time.monotonic() - self._t0, it, rss / 2**20, fds, threads, len(procs), shm, by_role)
        )

    def stop(self) -> list[Sample]:
        super().stop()
        return self.samples


# ------------------------------------------------------------------------------------------- the run
def _run(cmd: list[str], what: str) -> None:
    print(f"  {what}", flush=True)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(
            f"{what} failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )


def make_assets(work: str) -> None:
    """Tiny model, synthetic task, preprocessed RL split, megatron actor (TP2) and critic (TP2, --orm)."""
    py = sys.executable
    if os.path.exists(os.path.join(work, "assets.done")):
        print(f"assets: reusing {work}", flush=True)
        return
    print(f"assets: building in {work}", flush=True)
    _run([py, "tools/make_tiny_model.py", "--out", f"{work}/hf"], "tiny model")
    _run([py, "tools/make_quickstart_data.py", "--out", f"{work}/raw"], "synthetic task")
    _run(["bash", "examples/data/preprocess_data.sh", "deepscaler", f"input={work}/raw/rl.json",
          f"tokenizer_name_or_path={work}/hf", f"output_prefix={work}/data/train", "prompt_type=qwen",
          "workers=1"], "preprocess")  # fmt: skip
    _run([py, "-m", "mindrl.cli.convert", "hf2mcore", "--hf-dir", f"{work}/hf", "--save-dir", f"{work}/ckpt/actor",
          "--tp", "1", "--pp", "1", "--overwrite"], "convert actor")  # fmt: skip
    _run([py, "tools/make_critic_from_lm.py", "--hf-dir", f"{work}/hf", "--out", f"{work}/hf_critic"], "critic")
    _run([py, "-m", "mindrl.cli.convert", "hf2mcore", "--hf-dir", f"{work}/hf_critic", "--save-dir",
          f"{work}/ckpt/critic", "--tp", "2", "--pp", "1", "--orm", "--overwrite"], "convert critic")  # fmt: skip
    open(os.path.join(work, "assets.done"), "w").close()


def run_soak(work: str, iterations: int, interval: float, extra: list[str]) -> tuple[list[dict], list[Sample], int]:
    """mindrl-train on ppo_tiny_cpu for `iterations`, the tree sampled; returns (metrics rows, samples, rc)."""
    run_dir = os.path.join(work, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(os.path.join(work, "ckpt", "out_actor"), ignore_errors=True)
    shutil.rmtree(os.path.join(work, "ckpt", "out_critic"), ignore_errors=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    cmd = [sys.executable, "-m", "mindrl.cli.train", "--config-name", "ppo_tiny_cpu",
           f"actor_config.load={work}/ckpt/actor", f"actor_config.save={work}/ckpt/out_actor",
           f"critic_config.load={work}/ckpt/critic", f"critic_config.save={work}/ckpt/out_critic",
           f"rl_config.integrated_mode_config.ref_model_load_path={work}/ckpt/actor",
           f"megatron_training.data_path={work}/data/train", f"megatron_training.tokenizer_name_or_path={work}/hf",
           f"megatron_training.train_iters={iterations}", "megatron_training.save_interval=0",
           f"rl_config.run_dir={run_dir}", *extra]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    log_path = os.path.join(work, "train.log")
    print(f"train: {iterations} iterations, log {log_path}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        sampler = SoakSampler(proc.pid, metrics, interval)
        last = -1
        while proc.poll() is None:
            time.sleep(2.0)
            s = sampler.samples[-1] if sampler.samples else None
            if s and s.iteration != last and (s.iteration % 10 == 0 or s.iteration == iterations):
                last = s.iteration
                print(f"  it {s.iteration:4d}/{iterations}  {time.monotonic() - t0:6.0f} s  rss {s.rss_mb:7.0f} MiB  "
                      f"fds {s.fds:4d}  threads {s.threads:4d}  procs {s.procs:3d}  /dev/shm {s.shm}", flush=True)  # fmt: skip
        rc = proc.wait()
        samples = sampler.stop()
    rows = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return rows, samples, rc


def print_table(res: dict) -> None:
    a, b = res["first_window"], res["last_window"]
    print(f"\n{'':22s} {f'it {a[0]}-{a[1]}':>14s} {f'it {b[0]}-{b[1]}':>14s}  check")
    mark = {True: "pass", False: "FAIL"}
    c, th = res["checks"], res["thresholds"]
    print(f"{'median it time (s)':22s} {res['time_first_s']:14.3f} {res['time_last_s']:14.3f}  "
          f"{mark[c['time']]} (ratio {res['time_ratio']:.3f} <= {th['time_ratio']})")  # fmt: skip
    print(f"{'RSS median (MiB)':22s} {res['rss_first_mb']:14.0f} {res['rss_last_mb']:14.0f}")
    print(f"{'RSS slope (MiB/100 it)':22s} {res['rss_slope_first_mb_per_100']:14.1f} "
          f"{res['rss_slope_last_mb_per_100']:14.1f}  {mark[c['rss']]} (<= {th['rss_mb_per_100']})")  # fmt: skip
    for key, lim in (("fds", "fds_growth"), ("threads", "threads_growth"), ("shm", "shm_growth")):
        print(f"{key + ' (max)':22s} {res[key + '_first']:14d} {res[key + '_last']:14d}  "
              f"{mark[c[key]]} (growth <= {th[lim]})")  # fmt: skip
    print(f"{'processes (max)':22s} {res['procs_first']:14d} {res['procs_last']:14d}")
    if res.get("rss_slope_last_by_role"):
        print(f"RSS by role over it {b[0]}-{b[1]} (median MiB, slope MiB/100 it):")
        for role, slope in sorted(res["rss_slope_last_by_role"].items(), key=lambda kv: -kv[1]):
            print(f"  {role:20s} {res['rss_last_by_role_mb'][role]:9.0f} {slope:9.1f}")
    print(f"samples: {res['samples_first']} / {res['samples_last']}  ->  {'PASS' if res['passed'] else 'FAIL'}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=200, help="RL iterations (default 200)")
    p.add_argument("--window", type=int, default=50, help="iterations per compared window (default 50)")
    p.add_argument("--workdir", default=os.path.join(ROOT, "outputs", "bench_soak"),
                   help="assets and the run dir (assets are reused when present)")  # fmt: skip
    p.add_argument("--interval", type=float, default=0.5, help="seconds between process-tree samples")
    p.add_argument("--max-time-ratio", type=float, default=Thresholds.time_ratio)
    p.add_argument("--max-rss-slope", type=float, default=Thresholds.rss_mb_per_100, help="MiB per 100 iterations")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    p.add_argument("overrides", nargs="*", help="extra mindrl-train key=value overrides")
    a = p.parse_args(argv)
    if a.iterations < 3:
        p.error("--iterations must be >= 3")
    os.makedirs(a.workdir, exist_ok=True)
    make_assets(a.workdir)
    rows, samples, rc = run_soak(a.workdir, a.iterations, a.interval, a.overrides)
    if rc != 0 or len(rows) < 3:
        raise SystemExit(f"mindrl-train exited {rc} after {len(rows)} iterations; see {a.workdir}/train.log")
    th = Thresholds(time_ratio=a.max_time_ratio, rss_mb_per_100=a.max_rss_slope)
    res = analyze([r["timing/all"] for r in rows], samples, a.window, th)
    res["reshard_first_s"] = statistics.median(
        r.get("timing/reshard_to_infer", 0.0) for r in rows[1 : 1 + res["window"]]
    )
    res["reshard_last_s"] = statistics.median(r.get("timing/reshard_to_infer", 0.0) for r in rows[-res["window"] :])
    print_table(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**res, "samples": [asdict(s) for s in samples]}, f, indent=1)
        print(f"wrote {a.json}")
    return res


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
