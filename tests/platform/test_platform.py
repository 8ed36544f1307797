"""Platform detection, the megatron CPU shim, and the rank pool's failure handling."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

from mindrl.launch import RankError, RankPool
from mindrl.platform import current_platform
from tests.platform import dist_fns
from tests.procs import check_in_fresh_process

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _platform_in_subprocess(env_value: str) -> subprocess.CompletedProcess:
    code = "from mindrl.platform import current_platform as c; p = c(); print(p.name, p.dist_backend, p.ray_resource)"
    env = dict(os.environ, MINDRL_PLATFORM=env_value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)


def test_cpu_host_detects_cpu_with_gloo():
    p = current_platform()
    assert (p.name, p.dist_backend, p.ray_resource) == ("cpu", "gloo", "CPU")
    assert p.device() == torch.device("cpu") and not p.has_sleep_mode


def test_forced_platform_and_bad_value():
    assert _platform_in_subprocess("npu").stdout.split() == ["npu", "hccl", "NPU"]
    assert _platform_in_subprocess("cuda").stdout.split() == ["cuda", "nccl", "GPU"]
    bad = _platform_in_subprocess("tpu")
    assert bad.returncode != 0 and "MINDRL_PLATFORM='tpu' is not one of npu, cuda, cpu" in bad.stderr


def test_cpu_shim_adapts_megatron_only():
    check_in_fresh_process("tests.platform.shim_checks", "megatron_only")


def test_optimizer_type_checks_are_adapted_where_megatron_calls_them():
    """megatron.core.optimizer.optimizer imports clip_grad_by_total_norm_fp32 by name: its copy must be wrapped."""
    check_in_fresh_process("tests.platform.shim_checks", "optimizer_type_checks")


def test_no_device_branching_outside_platform():
    """Only mindrl/platform may name npu / cuda / cpu devices (house rule)."""
    pattern = re.compile(r"""["'](npu|cuda|hccl|nccl)["']|torch\.(cuda|npu)\b|torch_npu""")
    offenders = []
    for path in (ROOT / "mindrl").rglob("*.py"):
        if "platform" in path.relative_to(ROOT / "mindrl").parts[:1]:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "device branching outside mindrl/platform:\n" + "\n".join(offenders)


def test_rank_pool_runs_collectives(pool):
    assert pool.run(dist_fns.allreduce_rank, 1) == [10.0] * 4  # sum(1 + rank) over 4 ranks
    assert pool.run(dist_fns.megatron_imported) == [True] * 4  # the default pool's ranks are megatron ranks


def test_rank_pool_surfaces_a_failing_rank_without_hanging():
    with RankPool(2, timeout_s=120, megatron=False) as own:  # not the shared pool: this test tears its pool down
        assert own.run(dist_fns.megatron_imported) == [False, False]  # torch.distributed alone: no megatron import
        with pytest.raises(ValueError, match="boom on 1") as info:
            own.run(dist_fns.fail_on_rank, 1)
        assert isinstance(info.value.__cause__, RankError) and "rank 1 failed" in str(info.value.__cause__)
        assert own.closed  # torn down: the healthy rank was stuck in a barrier


def test_rank_pool_reports_a_dead_rank():
    with RankPool(2, timeout_s=120, megatron=False) as p:
        with pytest.raises(RankError, match=r"rank 1 died \(exit code 3\)"):
            p.run(dist_fns.exit_on_rank, 1, 3)


def test_rank_pool_that_times_out_reports_where_each_rank_and_its_children_were():
    with RankPool(2, timeout_s=5, megatron=False) as p:
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"ranks \[0, 1\] did not answer within 5 s") as info:
            p.run(dist_fns.hang_in_a_forked_child, 1)
        assert time.monotonic() - t0 < 60
        assert p.closed
    msg = str(info.value)
    rank0, rank1 = msg.split("--- rank 0")[1].split("--- rank 1")
    assert "in barrier" in rank0 and "in hang_in_a_forked_child" in rank0  # all threads, innermost first
    rank1, child = rank1.split("--- a child of rank 1")
    assert "in join" in rank1 and "in _child_waits_for_its_parent" in child  # the rank, then its forked child
    assert not os.path.exists(p._stacks_dir)


def test_layout_switches_do_not_leak_process_groups(pool):
    """Each megatron layout creates ~dozens of gloo groups (3 threads each): switching must free them."""
    counts = pool.run(dist_fns.switch_layouts, [(1, 1), (2, 1), (1, 2), (2, 2)] * 3)[0]
    # No growth from the 2nd to the 3rd round (a leak adds dozens of threads per round). Not equality: the
    # pool's ranks are shared, and threads an earlier test started may still be winding down.
    assert all(third <= second for second, third in zip(counts[4:8], counts[8:12])), counts


def test_a_ranks_gloo_groups_share_one_event_loop(pool):
    """Megatron's groups (~20 per rank here) run on one gloo device: one event-loop thread, which wakes 100 times a
    second, instead of one per group (torch's default: about 2,100 wake-ups a second per rank, which preempt the
    training's threads on a CPU host)."""
    results = pool.run(dist_fns.gloo_loops_and_wakeups, 2, 1.0)
    for loops, groups, wakeups_per_s in results:
        assert groups >= 10 and loops == 1, results
        assert wakeups_per_s < 10 * groups, results  # one loop per group: >= 100 per group


def test_shared_gloo_devices_follow_gloo_socket_ifname(monkeypatch):
    """GLOO_SOCKET_IFNAME names the interfaces as for torch's own devices: collectives run over the named one."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with RankPool(2, timeout_s=120) as own:
        assert own.run(dist_fns.allreduce_rank, 1) == [3.0, 3.0]
        assert [loops for loops, _, _ in own.run(dist_fns.gloo_loops_and_wakeups, 2, 0.1)] == [1, 1]
        # torch's options constructor is passed through: the caller's own device, not the shared one
        assert own.run(dist_fns.gloo_group_with_own_options) == [(2.0, 1), (2.0, 1)]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,nosuchif0")
    with pytest.raises(RuntimeError, match="nosuchif0"):
        RankPool(2, timeout_s=120).close()


def test_ranks_exit_when_the_pool_process_is_killed(tmp_path):
    """kill -9 of the process that owns a RankPool (an OOM, a killed test) must not leave its ranks behind,
    even while they sit in a collective or a long call."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    script = (
        "from mindrl.launch import RankPool\n"
        "from tests.platform import dist_fns\n"
        f"RankPool(2, megatron=False).run(dist_fns.report_pid_then_block, {str(tmp_path / 'pid')!r})\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=os.getcwd())
    try:
        files = [tmp_path / f"pid.{r}" for r in range(2)]
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text() for f in files):
            assert driver.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in files]
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=15)
        assert not alive, f"ranks {[p.pid for p in alive]} outlived their pool"
    finally:
        if driver.poll() is None:
            driver.kill()


def test_stale_stack_dump_folders_of_dead_pools_are_swept(tmp_path):
    """A rank pool killed before its close leaves <tmp>/mindrl-stacks-<pid>-*: the next pool removes the folders whose
    pid is gone, and keeps those of live processes (this one's own pools) and names without a pid."""
    from mindrl.launch import STACKS_PREFIX, sweep_stale_stacks_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{STACKS_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{STACKS_PREFIX}{os.getpid()}-def"
    old_style = tmp_path / f"{STACKS_PREFIX}x1y2z3"
    other = tmp_path / "unrelated"
    for d in (dead, live, old_style, other):
        d.mkdir()
        (d / "rank0.txt").write_text("stack")
    assert sweep_stale_stacks_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and old_style.exists() and other.exists()
    with RankPool(1, megatron=False) as p:
        assert os.path.basename(p._stacks_dir).startswith(f"{STACKS_PREFIX}{os.getpid()}-")


@pytest.mark.parametrize(
    "name",
    [
        "MINDRL_CPU_KERNELS",
        "MINDRL_ROLLOUT_C_SAMPLER",
        "MINDRL_ROLLOUT_C_LINEAR",
        "MINDRL_PREFIX_SHARING",
        "MINDRL_RESHARD_SHM",
    ],
)
def test_on_off_switches_take_0_or_1_and_name_a_bad_value(monkeypatch, name):
    """mindrl's on/off environment switches (one reader, `env_switch`): unset or 1 on, 0 off, a misspelt value an error
    that names the variable, not a feature silently left on."""
    from mindrl.platform import env_switch

    monkeypatch.delenv(name, raising=False)
    assert env_switch(name)
    monkeypatch.setenv(name, " 0 ")
    assert not env_switch(name)
    monkeypatch.setenv(name, "false")
    with pytest.raises(ValueError, match=f"{name}='false' must be 0 or 1"):
        env_switch(name)


def test_one_class_per_device_kind():
    """Each kind answers for itself; the facts the rest of mindrl reads differ between the CPU and the devices."""
    from mindrl.platform import CpuPlatform, CudaPlatform, NpuPlatform

    cpu, cuda, npu = CpuPlatform(), CudaPlatform(), NpuPlatform()
    assert [(p.name, p.dist_backend, p.ray_resource) for p in (cpu, cuda, npu)] == [
        ("cpu", "gloo", "CPU"),
        ("cuda", "nccl", "GPU"),
        ("npu", "hccl", "NPU"),
    ]
    assert cpu.ray_actor_options(0.5) == {"num_cpus": 0.5}
    assert cuda.ray_actor_options(0.5) == {"num_cpus": 0, "num_gpus": 0.5}
    assert npu.ray_actor_options(0.5) == {"num_cpus": 0, "resources": {"NPU": 0.5}}
    assert (cpu.planner_device, cuda.planner_device, npu.planner_device) == (None, "h100", "910b")
    assert cpu.is_cpu and not cuda.is_cpu and not npu.is_cpu and not cpu.has_sleep_mode and npu.has_sleep_mode
    assert set(cpu.worker_env) == {"MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MINDRL_BLOCKED_IMPORTS"}
    assert cuda.worker_env == {}
    assert cpu.rollout_kv_cache_bytes() == 1 << 30 and cuda.rollout_kv_cache_bytes() is None
    assert cpu.fused_adam and not cuda.fused_adam and cpu.shares_gloo_device and not npu.shares_gloo_device


def test_a_cpu_worker_keeps_triton_out():
    """A process with the CPU platform's worker env imports megatron-core and vLLM without triton (no CPU backend;
    ~70 MiB of RSS); megatron then knows it has none. pyarrow (Ray's serializers for Ray Data's tables, ~25 MiB) is
    kept out too: `import pyarrow` raises ModuleNotFoundError, the error Ray skips those serializers on; and wandb
    (megatron's inference context imports it when installed; trackers run in the driver). megatron's jit_fuser is
    lazy in any process that imported mindrl first: the import pulls in no torch._inductor."""
    from mindrl.platform import CpuPlatform

    code = (
        "import sys, mindrl, megatron.core.utils as u, vllm.entrypoints.llm\n"
        "try:\n    import pyarrow\nexcept ModuleNotFoundError:\n    pyarrow = None\n"
        "inductor = 'torch._inductor' in sys.modules\n"
        "print(sys.modules.get('triton', 'absent'), u.HAVE_TRITON, pyarrow, sys.modules.get('wandb', 'absent'), inductor)"
    )
    env = {**os.environ, "MINDRL_BLOCKED_IMPORTS": CpuPlatform().worker_env["MINDRL_BLOCKED_IMPORTS"]}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["None", "False", "None", "None", "True"]  # vLLM imports torch._inductor
    code = "import sys, mindrl, megatron.core.models.gpt, megatron.core.jit as j; print(j.jit_fuser.__name__, 'torch._inductor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["lazy_compile", "False"], out.stderr[-2000:]
