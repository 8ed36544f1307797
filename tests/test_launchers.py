"""The cluster launchers: --help, the loopback refusal, the head's join timeout, and a real two-node Ray cluster on
one machine (head 127.0.0.1, worker node 127.0.0.2) training the tiny PPO config with a rank on each node."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from mindrl.launch import free_port
from tests.procs import own_shm_segments
from tests.trainer.rl_helpers import assets, wait_for_no_ray  # noqa: F401  (assets: the trainer tests' fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
LAUNCHERS = [
    "examples/ray_train.sh",
    "examples/ppo/ppo_trainer_qwen25_32b.sh",
    "examples/grpo/grpo_trainer_qwen25_7b.sh",
    "examples/grpo/grpo_trainer_qwen25_32b.sh",
]
SETTINGS = ["NNODES", "NPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "SOCKET_IFNAME", "CURRENT_IP", "NODE_IPS",
            "JOIN_TIMEOUT", "HEAD_GONE_GRACE", "OBJECT_STORE_MEMORY", "MINDRL_RUNTIME_ENV", "RAY_AUTH_MODE",
            "LOOPBACK_CLUSTER"]  # fmt: skip


@pytest.mark.parametrize("script", LAUNCHERS)
def test_help(script):
    r = subprocess.run(["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "NNODES" in r.stdout
    if script == "examples/ray_train.sh":
        assert not [s for s in SETTINGS if s not in r.stdout]
        assert "testing only" in r.stdout.lower()


def test_multi_node_on_loopback_is_refused():
    env = {**os.environ, "NNODES": "2", "MASTER_ADDR": "127.0.0.1"}
    r = subprocess.run(["bash", "examples/ray_train.sh", "ppo_qwen25_32b_A3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert "MASTER_ADDR=127.0.0.1 is a loopback address but NNODES=2" in r.stderr
    assert "LOOPBACK_CLUSTER=1" in r.stderr


def _cluster_env(port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(NNODES="2", NPUS_PER_NODE="1", LOOPBACK_CLUSTER="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OBJECT_STORE_MEMORY=str(256 * 1024 * 1024), TOKENIZERS_PARALLELISM="false")  # fmt: skip
    env.update(extra)
    return env


def test_head_times_out_naming_who_joined():
    """NNODES=2 and no worker: the head gives up after JOIN_TIMEOUT, says how many joined, stops its own Ray."""
    port = free_port()
    t0 = time.monotonic()
    r = subprocess.run(["bash", "examples/ray_train.sh", "ppo_tiny_cpu"], cwd=ROOT, capture_output=True, text=True,
                       env=_cluster_env(port, CURRENT_IP="127.0.0.1", JOIN_TIMEOUT="3"), timeout=120)  # fmt: skip
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"within JOIN_TIMEOUT=3s 1 of 2 nodes joined \(1 of 2 CPU devices\): \S+", r.stderr), r.stderr
    assert took < 60, took
    assert not wait_for_no_ray(30)


def test_sigterm_stops_the_launchers_own_ray(tmp_path):
    """SIGTERM while the head waits for nodes: it stops the wait and its Ray at once and exits 143."""
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(["bash", "examples/ray_train.sh", "ppo_tiny_cpu"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=_cluster_env(free_port(), CURRENT_IP="127.0.0.1"))  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "waiting for nodes" not in open(log.name).read():
            assert head.poll() is None and time.monotonic() < deadline, open(log.name).read()
            time.sleep(0.5)
        t0 = time.monotonic()
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=60) == 143, open(log.name).read()
        assert time.monotonic() - t0 < 30
    finally:
        if head.poll() is None:
            head.kill()
    assert "terminated: stopping this node" in open(log.name).read()
    assert not wait_for_no_ray(30)


def _start_foreign_ray(log, port: int) -> subprocess.Popen:
    """A Ray head this test starts on other ports (not the launcher's): it must survive the launchers. It starts
    beside the launchers (its start takes ~15 s of wall); _wait_started says when it runs."""
    cmd = [RAY, "start", "--head", "--block", "--disable-usage-stats", "--include-dashboard=false",
           "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
           "--ray-client-server-port", str(free_port()), "--object-store-memory", str(128 * 1024 * 1024)]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_started(proc: subprocess.Popen, log, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in open(log.name).read():
        assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow  # two Ray nodes, 2 actor + 2 critic ranks with vLLM engines: ~2 min
def test_two_node_loopback_cluster(assets, tmp_path):  # noqa: F811
    port = free_port()
    run_dir = tmp_path / "run"
    overrides = [
        f"actor_config.load={assets / 'actor'}", f"actor_config.save={run_dir / 'ckpt_actor'}",
        f"critic_config.load={assets / 'critic'}", f"critic_config.save={run_dir / 'ckpt_critic'}",
        f"megatron_training.data_path={assets / 'data' / 'train'}",
        f"megatron_training.tokenizer_name_or_path={assets / 'hf'}",
        f"rl_config.integrated_mode_config.ref_model_load_path={assets / 'actor'}",
        f"rl_config.run_dir={run_dir}", "megatron_training.train_iters=1",
    ]  # fmt: skip
    # The workers must see a variable of the runtime env file (proved by the separate runtime-env test); here the
    # launcher's MINDRL_RUNTIME_ENV path reaches the trainer.
    env_file = tmp_path / "runtime_env.yaml"
    env_file.write_text("env_vars:\n  TOKENIZERS_PARALLELISM: 'false'\n  MINDRL_LAUNCH_PROBE: 'two-node'\n")
    common = dict(NODE_IPS="127.0.0.1 127.0.0.2", JOIN_TIMEOUT="120", HEAD_GONE_GRACE="3",
                  MINDRL_RUNTIME_ENV=str(env_file))  # fmt: skip
    foreign_log = open(tmp_path / "foreign.log", "w")
    worker_log, head_log = open(tmp_path / "worker.log", "w"), open(tmp_path / "head.log", "w")
    foreign_port = free_port()
    foreign = _start_foreign_ray(foreign_log, foreign_port)
    worker = head = None
    try:
        worker = subprocess.Popen(["bash", "examples/ray_train.sh", "ppo_tiny_cpu"], cwd=ROOT, stdout=worker_log,
                                  stderr=subprocess.STDOUT, env=_cluster_env(port, CURRENT_IP="127.0.0.2", **common))  # fmt: skip
        head = subprocess.Popen(["bash", "examples/ray_train.sh", "ppo_tiny_cpu", *overrides], cwd=ROOT,
                                stdout=head_log, stderr=subprocess.STDOUT,
                                env=_cluster_env(port, CURRENT_IP="127.0.0.1", **common))  # fmt: skip
        # the foreign head runs before the launchers stop theirs (the training takes a minute)
        _wait_started(foreign, foreign_log)
        head.wait(timeout=400)
        head_out = open(head_log.name).read()
        assert head.returncode == 0, head_out[-6000:]
        assert worker.wait(timeout=120) == 0, open(worker_log.name).read()[-4000:]
        worker_out = open(worker_log.name).read()
        assert "joined the Ray cluster at 127.0.0.1" in worker_out and "the head at 127.0.0.1" in worker_out
        assert "all 2 node(s) joined with 2 CPU device(s)" in head_out
        placement = re.search(r"placement: rank->node 0->(\S+) 1->(\S+) \((\d) node\(s\)\)", head_out)
        assert placement, head_out[-6000:]
        assert placement.group(3) == "2" and "127.0.0.2" in placement.groups()[:2], placement.group(0)
        assert "from " + str(env_file) in head_out  # the trainer read the launcher's runtime env file
        lines = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
        assert [m["iteration"] for m in lines] == [1] and lines[0]["actor/skipped_updates"] == 0
        # The foreign Ray head (not the launcher's) is alive: the launchers stopped only their own nodes.
        assert foreign.poll() is None, open(foreign_log.name).read()
        socket.create_connection(("127.0.0.1", foreign_port), timeout=5).close()  # its GCS still answers
    finally:
        if head is not None and head.poll() is None:
            head.send_signal(signal.SIGTERM)
            head.wait(timeout=90)
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=90)
        _stop(foreign)
    assert not wait_for_no_ray(30)
    assert not own_shm_segments()
