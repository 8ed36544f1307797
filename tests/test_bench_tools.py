"""The issue-16 benchmarks answer --help, and bench_update.py runs a real one-step actor update on the tiny
model (one gloo rank), writes its JSON and removes the temporary folder it made. TRL and mindrl-train are not run here
(minutes each)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "tool", ["bench_vs_trl.py", "bench_trl_side.py", "bench_update.py", "bench_async.py", "bench_lora_rollout.py"]
)
def test_help(tool):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_bench_update_writes_json(tiny_models, tmp_path):
    from tools.bench_update import ModelShape, update_flops

    path = tmp_path / "update.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_update.py"), "--hf-dir", tiny_models["untied"],
           "--tp", "1", "--cores", "1", "--prompts", "2", "--n", "2", "--prompt-len", "6", "--response-len", "4",
           "--micro-batch-size", "2", "--iterations", "1", "--lora", "2", "--json", str(path)]  # fmt: skip
    log = tmp_path / "log.txt"
    scratch = tmp_path / "tmp"  # no --workdir: the tool's own temporary folder goes here, and must be gone after
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    # Output to a file and a session of its own: should the tool die with a rank still up, the rank neither
    # holds a pipe open (a hang) nor outlives the test.
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    stdout = log.read_text()
    assert rc == 0, stdout[-5000:]
    res = json.loads(path.read_text())
    # The peak is the best kernel's: torch.matmul's, on an x86 CPU oneDNN's, and where mindrl preloads its MKL vendor
    # shim into workers (AMD CPUs), torch.matmul's with it
    from mindrl.kernels import current_kernels

    fast = current_kernels()
    kernels = res["matmul"]["kernels"]
    assert res["peak_gflops"] == max(kernels.values()) > 0
    expected = {"torch.matmul"} | ({"onednn"} if fast.onednn_available else set())
    assert set(kernels) == expected | ({"torch.matmul+shim"} if fast.mkl_vendor_shim else set())
    (row,) = res["results"]
    assert row["tp"] == 1 and row["step_s"] > 0 and 0 < row["mfu"] < 1.5 and row["cpu_s"] > 0
    # --lora: a LoRA actor's updates, alternating with the full model's, timed the same way
    assert row["lora"]["r"] == 2 and row["lora"]["step_s"] > 0 and row["lora"]["cpu_s"] > 0
    assert "LoRA / full" in stdout
    shape = ModelShape.from_hf(tiny_models["untied"])
    assert row["flops"] == update_flops(shape, 4, 10)
    prof = row["profile"]
    assert set(prof) >= {"gemm", "elementwise", "optimizer", "communication", "python", "wall"}
    assert prof["gemm"] > 0 and prof["optimizer"] > 0
    # The profile's top ops: the ranks' megatron linears on oneDNN where that is on, else on MKL (on Intel, and with
    # the vendor shim preloaded on AMD, MKL is the faster and oneDNN is off): aten::mm (forward, input gradient)
    if fast.onednn_linear and not fast.mkl_vendor_shim:
        assert "mkldnn::_linear_pointwise" in stdout and "aten::mm " not in stdout, stdout[-5000:]
    else:
        assert "aten::mm " in stdout and "mkldnn::_linear_pointwise" not in stdout, stdout[-5000:]
    assert "TP1" in stdout and "MFU" in stdout
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("bench_update_")]


def test_bench_vs_trl_reads_the_stage_profiles(tmp_path, capsys):
    """--profile: the workers' summaries (rank 0 only) become `profile` in the run's results and a printed line."""
    from tools.bench_vs_trl import print_profile, read_profiles

    for stage, rank in (("actor_update", 0), ("actor_update", 1), ("actor_generate", 0)):
        d = tmp_path / stage / "iter_5"
        d.mkdir(parents=True, exist_ok=True)
        summary = {"stage": stage, "iteration": 5, "rank": rank, "wall_s": 2.0, "trace": str(d / f"rank_{rank}.json"),
                   "seconds": {"gemm": 1.0, "elementwise": 0.5, "optimizer": 0.1, "communication": 0.0, "python": 0.4},
                   "share": {"gemm": 0.5, "elementwise": 0.25, "optimizer": 0.05, "communication": 0.0, "python": 0.2}}  # fmt: skip
        (d / f"rank_{rank}.summary.json").write_text(json.dumps(summary))
    prof = read_profiles(str(tmp_path))
    assert sorted(prof) == ["actor_generate", "actor_update"]
    assert prof["actor_update"]["seconds"]["gemm"] == 1.0 and prof["actor_update"]["trace"].endswith("rank_0.json")
    print_profile(prof)
    assert "profile actor_update: 2.00 s; gemm 50%, elementwise 25%" in capsys.readouterr().out


def test_bench_soak_analysis():
    """bench_soak's analysis on synthetic samples: a flat run passes; growing time, RSS or fds fail."""
    from tools.bench_soak import Sample, analyze

    def run(n=40, time_growth=0.0, rss_per_it=0.0, fd_growth=0):
        times = [5.0] + [1.0 + time_growth * i for i in range(1, n)]  # the first iteration is warm-up
        samples = [Sample(t=i, iteration=i // 2, rss_mb=1000 + rss_per_it * (i // 2) + (i % 3), fds=100 + fd_growth * (i // 2),
                          threads=50, procs=6, shm=3) for i in range(2 * n)]  # fmt: skip
        return analyze(times, samples, window=10)

    flat = run()
    assert flat["passed"], flat["checks"]
    assert flat["first_window"] == [2, 11] and flat["last_window"] == [31, 40]
    assert flat["time_first_s"] == flat["time_last_s"] == 1.0  # the 5 s warm-up is excluded
    assert abs(flat["rss_slope_last_mb_per_100"]) < 10
    leak = run(rss_per_it=1.0)  # 1 MiB per iteration = 100 MiB per 100
    assert not leak["passed"] and not leak["checks"]["rss"]
    assert 90 < leak["rss_slope_last_mb_per_100"] < 110
    # the per-role breakdown names where a slope comes from
    leaky = [Sample(t=i, iteration=i, rss_mb=0, fds=0, threads=0, procs=2, shm=0,
                    rss_by_role={"driver": 500.0, "IntegratedWorker": 900.0 + 0.5 * i}) for i in range(40)]  # fmt: skip
    by_role = analyze([1.0] * 40, leaky, window=10)["rss_slope_last_by_role"]
    assert by_role["driver"] == 0 and 49 < by_role["IntegratedWorker"] < 51
    slow = run(time_growth=0.02)
    assert not slow["checks"]["time"] and slow["checks"]["rss"]
    assert not run(fd_growth=2)["checks"]["fds"]
    with pytest.raises(ValueError, match="at least 3"):
        analyze([1.0, 1.0], [], window=10)


def test_bench_soak_roles():
    from tools.proc_tree import role_of

    assert role_of("python", ["python", "-m", "mindrl.cli.train"], is_root=True) == "driver"
    assert role_of("ray::Integrated", ["ray::IntegratedWorker.update_actor"], is_root=False) == "IntegratedWorker"
    assert role_of("ray::IDLE", ["ray::IDLE"], is_root=False) == "IDLE"
    starting = ["/x/python", "/x/site-packages/ray/_private/workers/default_worker.py", "--node-ip-address=1"]
    assert role_of("python", starting, is_root=False) == "ray worker (starting)"
    assert role_of("raylet", ["/x/ray/core/src/ray/raylet/raylet", "--a"], is_root=False) == "ray raylet"
    raylet = ["/x/ray/core/src/ray/raylet/raylet", "--python_worker_command=/x/python /x/ray/default_worker.py"]
    assert role_of("raylet", raylet, is_root=False) == "ray raylet"  # its command line names the workers' script
    agent = ["/x/python", "-u", "/x/site-packages/ray/dashboard/agent.py", "--a"]
    assert role_of("python", agent, is_root=False) == "ray agent"
    forkserver = ["python", "-c", "from multiprocessing.forkserver import main"]
    assert role_of("python", forkserver, is_root=False) == "multiprocessing forkserver"
    with_ray_path = [*forkserver, "{'sys_path': ['/venv/lib/python3.11/site-packages/ray/thirdparty_files']}"]
    assert role_of("python", with_ray_path, is_root=False) == "multiprocessing forkserver"
    assert role_of("sh", ["sh", "-c", "sleep 1"], is_root=False) == "other"


def test_bench_soak_help():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_soak.py"), "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0 and "usage:" in out.stdout and "/dev/shm" in out.stdout


def test_bench_vs_trl_floor_terms():
    """The floor's memory term: decode_kv_bytes counts each decode step's cached K and V over every layer (the
    prefill gives the first token); read_bandwidth times a real read of a buffer."""
    from tools.bench_update import ModelShape, last_level_cache_bytes, read_bandwidth
    from tools.bench_vs_trl import decode_kv_bytes

    shape = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=97)
    # 3 new tokens after a 5-token prompt: steps 1 and 2 read 6 and 7 positions; a position is K + V of 2 layers x 2
    # KV heads x 16 dims in fp32 = 512 bytes; 3 rows.
    assert decode_kv_bytes(shape, rows=3, prompt_len=5, new_tokens=3) == 3 * 512 * (6 + 7)
    assert decode_kv_bytes(shape, rows=3, prompt_len=5, new_tokens=1) == 0  # the prefill's token only
    # The benchmark's long shape: 64 rows, 30 + 256 tokens, 16 KiB per position.
    assert decode_kv_bytes(ModelShape(), 64, 30, 256) == 64 * 16384 * sum(30 + j for j in range(1, 256))
    assert last_level_cache_bytes() >= 0
    gbps = read_bandwidth(1, nbytes=8 << 20, seconds=0.01)
    assert 0.1 < gbps < 10_000


_SHARER = """
import os, sys, time
buf = bytearray(64 << 20)  # touched: zero-filled by bytearray
for i in range(0, len(buf), 4096):
    buf[i] = 1
pid = os.fork()  # the child maps the parent's 64 MiB copy-on-write and never writes it
if pid == 0:
    time.sleep(30)
    os._exit(0)
print("ready", flush=True)
time.sleep(30)
"""


def test_tree_memory_tells_shared_pages_apart():
    """A parent with 64 MiB of touched heap and a forked child sharing it: the summed RSS counts those pages twice,
    the summed PSS once, and neither process alone holds them (USS) while both are alive."""
    from tools.proc_tree import TreeMemory

    proc = subprocess.Popen([sys.executable, "-c", _SHARER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        mem = TreeMemory(proc.pid, interval=0.1, shared_every=2)
        import time

        time.sleep(1.0)
        out = mem.stop()
    finally:
        proc.kill()
        proc.wait()
    roles = out["by_role"]
    assert set(roles) == {"driver", "other"} and roles["other"]["procs"] == 1
    mib = 64
    # the shared 64 MiB: in both RSS sums, once in the PSS sum, in no USS
    assert out["peak_rss_mb"] - out["peak_pss_mb"] >= mib * 0.95
    assert roles["other"]["peak_rss_mb"] >= mib and roles["other"]["peak_uss_mb"] < mib / 4
    assert roles["driver"]["peak_uss_mb"] < mib / 4
    assert out["samples"] >= 5 and out["sampler_cpu_s"] >= 0


def test_proc_tree_command_reports_the_tree_and_each_step(tmp_path):
    """`tools/proc_tree.py -- COMMAND`: a shell running two steps one after another, the second holding 128 MiB: the
    tree's peak and the second step's hold it, the first step's does not; COMMAND's exit status comes back."""
    hold = "import sys, time; x = bytearray(128 << 20); time.sleep(1.0); sys.exit(3)"
    path = tmp_path / "mem.json"
    script = f"sleep 0.6; {sys.executable} -c '{hold}'; exit $?"  # not the last command: bash would exec it
    cmd = [sys.executable, os.path.join(ROOT, "tools", "proc_tree.py"), "--interval", "0.1", "--json", str(path),
           "--", "bash", "-c", script]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 3, out.stderr
    mem = json.load(open(path))
    steps = mem["peak_rss_mb_by_step"]
    assert mem["returncode"] == 3 and mem["peak_rss_mb"] >= 128
    assert steps["sleep"] < 128 <= steps[os.path.basename(sys.executable)], steps
    assert "whole tree (peak of the sums)" in out.stderr


def test_bench_async_summary_and_table():
    """bench_async.py's medians after the warm-up, idle fractions (the rollout's share in the synchronous mode) and
    table, on hand-written metrics.jsonl rows (the tool's runs are tests/trainer/test_bench_async.py's)."""
    from tools.bench_async import summarize, table

    def row(it, step, idle, stale, **extra):
        return {"iteration": it, "timing/all": step, "response_length/mean": 10.0, "prompt_length/mean": 30.0,
                "reward/mean": 0.5, "async/trainer_idle_s": idle, "async/staleness/mean": stale,
                "async/staleness/max": stale, "timing/rollout_total": 2 * idle, **extra}  # fmt: skip

    lines = [row(1, 100.0, 50.0, 0.0), row(2, 2.0, 1.0, 1.0), row(3, 4.0, 1.0, 1.0), row(4, 8.0, 1.0, 0.5)]
    s = summarize(lines, "one_step_off", warmup=1, n_rows=4)
    assert s["iterations"] == 3 and s["step_s"] == 4.0
    assert s["tokens_per_s"] == 160 / 4.0  # (10 + 30) tokens x 4 rows per step: 80, 40, 20 tokens/s
    assert s["idle_frac"] == 0.25 and s["staleness_mean"] == 1.0 and s["staleness_max"] == 1.0
    assert summarize(lines, "sync", warmup=1, n_rows=4)["idle_frac"] == 0.5  # the rollout's share
    b = summarize(
        [row(2, 2.0, 1.0, 1.0, **{"async/sampler_tps/s0": 3.0, "async/sampler_tps/s1": 4.0})], "bounded", 1, 4
    )
    assert b["sampler_tps"] == 7.0
    b["samplers"] = 2  # main() labels each bounded run with its sampler count
    text = table([s, b])
    assert text.splitlines()[2].startswith("one_step_off") and text.splitlines()[3].startswith("bounded x2")
    assert "7.0" in text.splitlines()[3]
    with pytest.raises(ValueError, match="no iteration after the 5 warm-up"):
        summarize(lines, "sync", warmup=5, n_rows=4)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bench_vs_trl_dtype_reaches_the_mindrl_config(tmp_path, dtype):
    """--dtype bf16 is megatron_training.bf16 with vLLM in bfloat16 on mindrl's side (and fp32 both off)."""
    from types import SimpleNamespace

    import yaml

    from tools.bench_update import ModelShape
    from tools.bench_vs_trl import _mindrl_config

    a = SimpleNamespace(model="tiny", prompt_len=30, iterations=1, profile=False, prompts=4, n=2, lr=1e-6,
                        mindrl_micro_batch_size=8, reward="format", temperature=1.0, rollout_compile=False,
                        dtype=dtype)  # fmt: skip
    with open(_mindrl_config(a, str(tmp_path), ModelShape(), 64, 0.0, 1, 1)) as f:
        cfg = yaml.safe_load(f)
    assert cfg["megatron_training"]["bf16"] is (dtype == "bf16")
    assert cfg["generate_config"]["dtype"] == ("bfloat16" if dtype == "bf16" else "float32")
