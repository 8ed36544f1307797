"""The Ray workers' environment: configs/envs/runtime_env.yaml (or MINDRL_RUNTIME_ENV) merged with the user's
environment and an explicit runtime_env; malformed files named; a Ray worker sees the file's variables."""

from __future__ import annotations

import os
import sys

import pytest

from mindrl.kernels import current_kernels
from mindrl.workers.runtime_env import ENV_VAR, REQUIRED, RuntimeEnvError, build_runtime_env, default_path


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "env.yaml"
    path.write_text(text)
    return str(path)


def test_shipped_file_is_read_by_default():
    env = build_runtime_env(environ={})
    assert env.path == default_path() and os.path.isfile(env.path)
    vars_ = env.runtime_env["env_vars"]
    assert vars_["HCCL_HOST_SOCKET_PORT_RANGE"] == "auto" and vars_["HCCL_NPU_SOCKET_PORT_RANGE"] == "auto"
    assert vars_["TOKENIZERS_PARALLELISM"] == "false"
    assert all(vars_[k] == v for k, v in REQUIRED.items())
    assert all(isinstance(v, str) for v in vars_.values())


def test_precedence_platform_then_file_then_environment_then_explicit_then_required(tmp_path):
    path = _file(tmp_path, "env_vars:\n  A: from_file\n  B: from_file\n  C: from_file\n  FLAG: true\n  N: 8\n")
    environ = {ENV_VAR: path, "B": "from_env", "C": "from_env", "E": "from_env", "UNRELATED": "x"}
    explicit = {"env_vars": {"C": "explicit", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "working_dir": "/w"}
    defaults = {"P": "platform", "A": "platform", "E": "platform"}
    env = build_runtime_env(explicit, environ, defaults=defaults)
    assert env.runtime_env["env_vars"] == {
        "P": "platform",  # a platform default nobody overrides
        "E": "from_env",  # the user's environment wins over a platform default
        "A": "from_file",  # only in the file
        "B": "from_env",  # the user's environment wins over the file
        "C": "explicit",  # an explicit runtime_env wins over both
        "FLAG": "true",  # YAML booleans and numbers become the strings the user wrote
        "N": "8",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # required by mindrl, whatever the caller says
    }
    assert "UNRELATED" not in env.runtime_env["env_vars"]  # the environment only overrides the file's keys
    assert env.runtime_env["working_dir"] == "/w"  # other runtime_env keys pass through
    assert env.from_environ == ["B", "C", "E"] and "3 taken from this environment" in env.describe()
    assert env.from_platform == ["P"] and "platform defaults P" in env.describe()


def test_empty_setting_disables_the_file():
    env = build_runtime_env(environ={ENV_VAR: ""})
    assert env.path is None and env.runtime_env["env_vars"] == {**current_kernels().worker_env, **REQUIRED}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("env_vars:\n  A: [1, 2]\n", "env_vars.A: the value must be a string or number"),
        ("env_vars:\n  A:\n", "env_vars.A: the value must be a string or number"),
        ("env_vars:\n  BAD-NAME: x\n", "env_vars.BAD-NAME: not a valid environment variable name"),
        ("env_vars: [A, B]\n", "'env_vars' must be a mapping"),
        ("pip: [numpy]\nenv_vars: {}\n", "unsupported key(s) ['pip']"),
        ("- A\n", "expected a mapping with 'env_vars'"),
        ("env_vars: {A: 'x'\n", "not valid YAML"),
        (
            "env_vars:\n  VLLM_ENABLE_V1_MULTIPROCESSING: '1'\n",
            "env_vars.VLLM_ENABLE_V1_MULTIPROCESSING='1': mindrl requires",
        ),
    ],
)
def test_malformed_file_names_file_and_key(tmp_path, text, expected):
    path = _file(tmp_path, text)
    with pytest.raises(RuntimeEnvError) as e:
        build_runtime_env(environ={ENV_VAR: path})
    assert path in str(e.value) and expected in str(e.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(RuntimeEnvError, match=f"{tmp_path}/nope.yaml \\({ENV_VAR}\\): cannot read it"):
        build_runtime_env(environ={ENV_VAR: str(tmp_path / "nope.yaml")})


def test_a_ray_worker_sees_the_file(tmp_path, monkeypatch, capfd):
    """start_ray hands the merged variables to Ray: a task on a worker process reads them, and the platform's
    defaults are in the environment the worker was started with (glibc's MALLOC_* are read at process start only).
    The private cluster keeps TASK_EVENTS_KEPT task events in its GCS (Ray's default 100,000 grows it for thousands
    of iterations) and prestarts no idle worker processes; its log monitor runs as a thread of the driver, which
    still prints what a worker prints."""
    import time

    import psutil
    import ray

    from mindrl.workers.group import TASK_EVENTS_KEPT, start_ray, stop_ray

    monkeypatch.setenv(ENV_VAR, _file(tmp_path, "env_vars:\n  MINDRL_PROBE_A: file\n  MINDRL_PROBE_B: file\n"))
    monkeypatch.setenv("MINDRL_PROBE_B", "user")
    for k in current_kernels().worker_env:
        monkeypatch.delenv(k, raising=False)
    had_arrow = "pyarrow" in sys.modules
    assert start_ray(None, 1)
    try:
        # Ray's serializers for Arrow tables were made without pyarrow, which is importable again (parquet data)
        ray.get(ray.put([1]))
        assert had_arrow or "pyarrow" not in sys.modules
        assert sys.modules.get("pyarrow", "absent") is not None

        @ray.remote(num_cpus=0)
        def probe() -> tuple:
            kept = ray._config.task_events_max_num_task_in_gcs()
            with open("/proc/self/environ", "rb") as f:  # the environment at exec, not os.environ's later edits
                start = dict(v.decode().split("=", 1) for v in f.read().split(b"\0") if b"=" in v)
            print("MINDRL-PROBE-PRINTED", flush=True)
            return os.getpid(), os.environ.get("MINDRL_PROBE_A"), os.environ.get("MINDRL_PROBE_B"), kept, start

        pid, a, b, kept, start = ray.get(probe.remote(), timeout=120)
        assert pid != os.getpid() and (a, b) == ("file", "user")
        assert all(start.get(k) == v for k, v in current_kernels().worker_env.items()), start
        assert kept == TASK_EVENTS_KEPT < 100_000
        # Ray was told to prestart no idle Python workers (mindrl runs actors, each in a process of its own)
        config = _system_config()
        assert config["enable_worker_prestart"] is False and config["prestart_worker_first_driver"] is False
        assert not any("log_monitor.py" in " ".join(p.cmdline()) for p in psutil.Process().children(recursive=True))
        deadline, seen = time.monotonic() + 30, ""
        while "MINDRL-PROBE-PRINTED" not in seen and time.monotonic() < deadline:
            time.sleep(0.2)
            seen += "".join(capfd.readouterr())
        assert "MINDRL-PROBE-PRINTED" in seen
    finally:
        stop_ray()


def _system_config() -> dict:
    """The system config this driver's GCS was started with (its --config_list: base64 JSON), which it hands to every
    raylet."""
    import base64
    import json

    import psutil

    for p in psutil.Process().children(recursive=True):
        cmd = p.cmdline()
        if cmd and os.path.basename(cmd[0]) == "gcs_server":
            arg = next(a for a in cmd if a.startswith("--config_list="))
            return json.loads(base64.b64decode(arg.split("=", 1)[1]))
    raise AssertionError("no gcs_server under this driver")


def test_config_key_names_the_file_over_the_environment_setting(tmp_path):
    """rl_config.runtime_env_path (MindSpeed-RL's key) picks the file; MINDRL_RUNTIME_ENV is the fallback."""
    chosen = _file(tmp_path, "env_vars:\n  A: from_config_file\n")
    env = build_runtime_env(environ={ENV_VAR: default_path()}, path=chosen)
    assert env.path == chosen and env.runtime_env["env_vars"]["A"] == "from_config_file"
