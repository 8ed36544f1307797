#!/usr/bin/env python
"""Asynchronous RL benchmark (issue 48): tokens/s of `mindrl-train` synchronous vs rl_config.async_mode one_step_off
vs bounded (fed by sampler actors on the Ray transport, the default, or `mindrl-sampler` processes over ZeroMQ on
loopback; once per --samplers count), with the trainer's idle fraction and the staleness of what it trained.

Each mode is one `mindrl-train` run of --warmup + --iterations iterations (nothing saved until the run's end); its
metrics.jsonl gives, per measured iteration (the warm-up ones dropped), and as medians over them:

- tokens/s: the trained batch's tokens (prompt + response, as e2e_tps counts them, summed over the devices) per second
  of the trainer's step (`timing/all`; in bounded it includes the wait for the samplers' groups);
- idle: the fraction of the step the update waited for generation: `async/trainer_idle_s / timing/all` in the async
  modes, `timing/rollout_total / timing/all` in the synchronous one (its update waits for the whole rollout);
- staleness: `async/staleness/mean` and the largest `async/staleness/max` (0 in the synchronous mode);
- bounded: the samplers' generation tokens/s (`async/sampler_tps/*`, summed) and the groups refused as stale.

The samplers share the host with the trainer: on a small CPU host they take cores from it, so bounded's figure is
the whole job's on that host, not the trainer's alone.

    python tools/bench_async.py --config-name grpo_tiny_cpu --samplers 1,2 --iterations 4 --warmup 1 --json /tmp/a.json
    python tools/bench_async.py --modes sync,bounded --samplers 2 --transport zmq --config-name grpo_tiny_cpu \\
        megatron_training.tokenizer_name_or_path=DIR ...   # any further overrides go to every run
    python tools/bench_async.py --preset vs_trl --workdir outputs/bench_async_32m   # the ~32M model of bench_vs_trl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = ("sync", "one_step_off", "bounded")
TRANSPORTS = ("ray", "zmq")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_async.py",
        description="tokens/s, the trainer's idle fraction and staleness of mindrl-train synchronous vs "
        "async_mode one_step_off vs bounded (with mindrl-sampler processes on loopback); prints a table, "
        "medians over --iterations after --warmup.",
    )
    p.add_argument("--config-name", default="grpo_tiny_cpu", help="the RL config (default: grpo_tiny_cpu)")
    p.add_argument("--preset", choices=("vs_trl",), default=None,
                   help="vs_trl: tools/bench_vs_trl.py's ~32M Qwen2 GRPO (its model, prompts, checkpoint and config, "
                   "built in --workdir; TP1 on one rank, --vs-trl-prompts x 4 samples x 64 new tokens) instead of "
                   "--config-name")  # fmt: skip
    p.add_argument("--vs-trl-prompts", type=int, default=16, help="vs_trl: prompts per step")
    p.add_argument("--config-path", default=None, help="a directory of configs (as mindrl-train's)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--iterations", type=int, default=4, help="measured iterations per mode")
    p.add_argument("--warmup", type=int, default=1, help="iterations run first and not measured")
    p.add_argument("--samplers", default="2",
                   help="samplers in bounded, comma-separated counts (one bounded run per count, e.g. 1,2)")  # fmt: skip
    p.add_argument("--transport", choices=TRANSPORTS, default="ray",
                   help="bounded's samplers: ray (rl_config.async_samplers actors in the trainer's cluster, the "
                   "default) or zmq (mindrl-sampler processes on loopback)")  # fmt: skip
    p.add_argument("--sampler-threads", type=int, default=1,
                   help="torch threads per mindrl-sampler process (OMP_NUM_THREADS; actors use 1)")  # fmt: skip
    p.add_argument("--sampler-engine", choices=("hf", "vllm"), default="hf", help="their engine (default: hf)")
    p.add_argument("--sampler-model", default=None,
                   help="HF dir the samplers build their engine from (default: the config's tokenizer_name_or_path; "
                   "its weights are replaced by the trainer's before anything is sampled)")  # fmt: skip
    p.add_argument("--max-staleness", type=int, default=1, help="rl_config.max_staleness of the async modes")
    p.add_argument("--workdir", default=None, help="run dirs and logs (default: a temporary folder, removed after)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one mode's run may take")
    p.add_argument("--json", default=None, help="write the per-mode results here")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    return p


# ------------------------------------------------------------------------------------------------ summary
def tokens_per_step(m: dict, n_rows: int) -> float:
    """The trained batch's prompt + response tokens (its mean lengths times its rows)."""
    return (m["response_length/mean"] + m["prompt_length/mean"]) * n_rows


def summarize(lines: list[dict], mode: str, warmup: int, n_rows: int) -> dict:
    """Medians over the iterations after `warmup` of one mode's metrics.jsonl rows."""
    measured = [m for m in lines if m["iteration"] > warmup]
    if not measured:
        raise ValueError(f"{mode}: no iteration after the {warmup} warm-up one(s) in metrics.jsonl")
    step = [m["timing/all"] for m in measured]
    tps = [tokens_per_step(m, n_rows) / m["timing/all"] for m in measured]
    idle_key = "timing/rollout_total" if mode == "sync" else "async/trainer_idle_s"
    idle = [m.get(idle_key, 0.0) / m["timing/all"] for m in measured]
    out = {
        "mode": mode,
        "iterations": len(measured),
        "step_s": statistics.median(step),
        "tokens_per_s": statistics.median(tps),
        "idle_frac": statistics.median(idle),
        "staleness_mean": statistics.median(m.get("async/staleness/mean", 0.0) for m in measured),
        "staleness_max": max(m.get("async/staleness/max", 0.0) for m in measured),
        "dropped_stale": sum(m.get("async/dropped_stale", 0.0) for m in measured),
        "reward_mean": statistics.median(m["reward/mean"] for m in measured if "reward/mean" in m)
        if any("reward/mean" in m for m in measured)
        else None,
    }
    samplers = [sum(v for k, v in m.items() if k.startswith("async/sampler_tps/")) for m in measured]
    if mode == "bounded":
        out["sampler_tps"] = statistics.median(samplers)
    return out


def table(rows: list[dict]) -> str:
    head = f"{'mode':<13} {'iters':>5} {'step s':>8} {'tokens/s':>9} {'idle':>6} {'stale mean':>10} {'stale max':>9}"
    lines = [head + f" {'sampler tok/s':>13}", "-" * (len(head) + 14)]
    for r in rows:
        sampler = f"{r['sampler_tps']:13.1f}" if "sampler_tps" in r else f"{'-':>13}"
        name = r["mode"] + (f" x{r['samplers']}" if "samplers" in r else "")
        lines.append(f"{name:<13} {r['iterations']:>5} {r['step_s']:8.3f} {r['tokens_per_s']:9.1f} "
                     f"{r['idle_frac']:6.2f} {r['staleness_mean']:10.2f} {r['staleness_max']:9.0f} {sampler}")  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ runs
def _env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def mode_overrides(mode: str, args, run_dir: str, ports: tuple[int, int] | None, samplers: int = 0) -> list[str]:
    out = [
        f"megatron_training.train_iters={args.warmup + args.iterations}",
        "megatron_training.save_interval=0",
        f"actor_config.save={os.path.join(run_dir, 'ckpt_actor')}",
        f"rl_config.run_dir={run_dir}",
        "rl_config.use_tensorboard=false",
    ]
    if mode != "sync":
        out += [f"rl_config.async_mode={mode}", f"rl_config.max_staleness={args.max_staleness}"]
    if mode == "bounded" and args.transport == "ray":
        out += ["rl_config.async_transport=ray", f"rl_config.async_samplers={samplers}",
                f"rl_config.async_sampler_engine={args.sampler_engine}", f"rl_config.async_timeout_s={args.timeout:g}"]  # fmt: skip
    elif mode == "bounded":
        out += ["rl_config.async_transport=zmq", "rl_config.async_host=127.0.0.1", f"rl_config.async_data_port={ports[0]}",
                f"rl_config.async_sync_port={ports[1]}", f"rl_config.async_timeout_s={args.timeout:g}"]  # fmt: skip
    return out


def start_samplers(cfg, args, ports, log_dir: str, count: int) -> list[tuple[subprocess.Popen, object]]:
    mt, rl, s = cfg.megatron_training, cfg.rl_config, cfg.generate_config.sampling_config
    model = args.sampler_model or mt.tokenizer_name_or_path
    procs = []
    for k in range(count):
        cmd = [sys.executable, "-m", "mindrl.cli.sampler", "--sampler-id", f"s{k}", "--host", "127.0.0.1",
               "--data-port", str(ports[0]), "--sync-port", str(ports[1]), "--model", model,
               "--data-path", mt.data_path, "--max-prompt-length", str(rl.max_prompt_length),
               "--n", str(rl.n_samples_per_prompt), "--max-tokens", str(s.max_tokens),
               "--temperature", str(s.temperature), "--top-p", str(s.top_p), "--seed", str(mt.seed),
               "--engine", args.sampler_engine, "--timeout", "30"]  # fmt: skip
        log = open(os.path.join(log_dir, f"sampler-s{k}.log"), "w")  # noqa: SIM115 (closed in stop_samplers)
        env = {**_env(), "OMP_NUM_THREADS": str(args.sampler_threads)}
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def stop_samplers(procs) -> None:
    for p, _ in procs:
        if p.poll() is None:
            p.terminate()
    for p, log in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()


def run_mode(mode: str, args, workdir: str, count: int = 0) -> list[dict]:
    """One mindrl-train run of `mode` (bounded: with `count` samplers); its metrics.jsonl rows."""
    from mindrl.launch import free_port
    from mindrl.preflight import load_config

    run_dir = os.path.join(workdir, f"{mode}_x{count}" if mode == "bounded" else mode)
    os.makedirs(run_dir, exist_ok=True)
    zmq = mode == "bounded" and args.transport == "zmq"
    ports = (free_port(), free_port()) if zmq else None
    overrides = [*args.overrides, *mode_overrides(mode, args, run_dir, ports, count)]
    samplers = []
    if zmq:
        cfg = load_config(args.config_name, args.config_path, overrides)
        samplers = start_samplers(cfg, args, ports, run_dir, count)
    cmd = [sys.executable, "-m", "mindrl.cli.train", "--config-name", args.config_name]
    if args.config_path:
        cmd += ["--config-path", args.config_path]
    t0 = time.perf_counter()
    try:
        with open(os.path.join(run_dir, "train.log"), "w") as log:
            rc = subprocess.run([*cmd, *overrides], cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode  # fmt: skip
    finally:
        stop_samplers(samplers)
    if rc != 0:
        with open(os.path.join(run_dir, "train.log")) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{mode}: mindrl-train exited {rc}:\n{tail}")
    name = f"{mode} x{count}" if mode == "bounded" else mode
    print(f"{name}: {args.warmup + args.iterations} iterations in {time.perf_counter() - t0:.0f} s", flush=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def prepare_vs_trl(work: str, args) -> tuple[str, str]:
    """tools/bench_vs_trl.py's ~32M GRPO set up in `work` (model, prompts, TP1 checkpoint, config; each kept if
    there): its (config path, config name). Its `format` reward on random-word prompts, 64 new tokens."""
    from types import SimpleNamespace

    from mindrl.data.preprocess import dataset_prefix
    from tools import bench_vs_trl as vs
    from tools.bench_update import ModelShape, make_model

    shape, new_tokens = ModelShape(), vs.SHAPES["short"]
    a = SimpleNamespace(model="tiny", prompt_len=30, iterations=args.iterations + args.warmup - 1, profile=False,
                        prompts=args.vs_trl_prompts, n=4, lr=1e-6, reward="format", temperature=1.0,
                        mindrl_micro_batch_size=16, rollout_compile=False)  # fmt: skip
    hf = make_model(os.path.join(work, "hf"), shape)
    data = os.path.join(work, "data", "train")
    if not os.path.exists(dataset_prefix(data, "input_ids") + ".idx"):
        _, ids = vs.build_prompts(hf, a.prompts * 8, a.prompt_len)
        vs.write_mindrl_dataset(data, ids)
    ckpt = os.path.join(work, "mcore_tp1")
    if not os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
        subprocess.run([sys.executable, "-m", "mindrl.cli.convert", "hf2mcore", "--hf-dir", hf, "--save-dir", ckpt,
                        "--tp", "1", "--pp", "1", "--overwrite"], check=True, cwd=ROOT, env=_env(),
                       stdout=subprocess.DEVNULL)  # fmt: skip
    vs._mindrl_config(a, work, shape, new_tokens, 0.0, tp=1, world=1)
    return os.path.join(work, "configs"), "bench_grpo"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"bench_async.py: --modes: unknown {bad}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    try:
        counts = [int(x) for x in args.samplers.split(",") if x.strip()]
    except ValueError:
        counts = []
    if args.iterations < 1 or args.warmup < 0 or not counts or min(counts) < 1:
        print(f"bench_async.py: --iterations must be >= 1, --warmup >= 0, --samplers counts >= 1 (got "
              f"{args.samplers!r})", file=sys.stderr)  # fmt: skip
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_async_")
    if args.preset == "vs_trl":
        args.config_path, args.config_name = prepare_vs_trl(os.path.abspath(workdir), args)
    from mindrl.config import ConfigError
    from mindrl.preflight import load_config

    try:
        cfg = load_config(args.config_name, args.config_path, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"bench_async.py: {e}", file=sys.stderr)
        return 2
    n_rows = cfg.megatron_training.global_batch_size * cfg.rl_config.n_samples_per_prompt
    rows = []
    try:
        for mode in modes:
            for count in counts if mode == "bounded" else [0]:
                r = summarize(run_mode(mode, args, workdir, count), mode, args.warmup, n_rows)
                if mode == "bounded":
                    r["samplers"] = count
                rows.append(r)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"{args.preset or args.config_name}: medians over {args.iterations} iteration(s) after {args.warmup} "
          f"warm-up; bounded: {args.sampler_engine} samplers over {args.transport}")  # fmt: skip
    print(table(rows))
    if args.json:
        result = {"config_name": args.config_name, "preset": args.preset, "overrides": args.overrides,
                  "iterations": args.iterations, "warmup": args.warmup, "samplers": counts,
                  "transport": args.transport, "sampler_engine": args.sampler_engine,
                  "sampler_threads": args.sampler_threads,
                  "max_staleness": args.max_staleness, "cpu_count": os.cpu_count(), "modes": rows}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
