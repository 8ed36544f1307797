"""wandb and SwanLab as metrics sinks, with the real packages in their offline modes (no network, no login): the run's
files land where rl_config's *_save_dir says, the logged values are read back from those files with the packages'
own record formats, and closing leaves no process or thread behind. Config errors are found at load."""

from __future__ import annotations

import glob
import math
import struct
import sys
import threading

import psutil
import pytest
import torch

from mindrl.config import ConfigError
from mindrl.config.rl import ResourceConfig, RLSectionConfig
from mindrl.preflight import load_config
from mindrl.trainer.metrics import MetricsLogger
from mindrl.trainer.trackers import trackers_from_config
from tests.trainer.rl_helpers import straight_run

# Three iterations of metrics as the trainer logs them: tensors and floats, a NaN, and the name shapes mindrl uses
# ('/' groups, '@' in pass@k, '.' in the memory ledger's model.term).
STEPS = {
    1: {"reward/mean": torch.tensor(0.25), "actor/pg_loss": -1.5, "val/acc/pass@4": 0.5, "timing/all": 2.0},
    2: {"reward/mean": 0.5, "actor/pg_loss": float("nan"), "memory/device_bytes/update/actor.params": 1.5e9},
    3: {"reward/mean": 0.75, "actor/pg_loss": 0.125, "val/acc/pass@4": 0.75, "timing/all": 1.0},
}


def _expected() -> dict[tuple[int, str], float]:
    return {(it, k): float(v) for it, row in STEPS.items() for k, v in row.items()}


def _same(got: dict[tuple[int, str], float], want: dict[tuple[int, str], float]) -> bool:
    return got.keys() == want.keys() and all(
        (math.isnan(want[k]) and math.isnan(got[k])) or got[k] == want[k] for k in want
    )


class _Leaks:
    """The child processes and threads this test's process gained between enter and exit."""

    def __enter__(self):
        self.pids = {p.pid for p in psutil.Process().children(recursive=True)}
        self.threads = set(threading.enumerate())
        return self

    def __exit__(self, *exc):
        self.new_pids = [(p.pid, p.name()) for p in psutil.Process().children(recursive=True) if p.pid not in self.pids]
        self.new_threads = [t.name for t in threading.enumerate() if t not in self.threads and t.is_alive()]


def _rl(**keys) -> RLSectionConfig:
    """rl_config with `keys` (validated as at load)."""
    return RLSectionConfig(actor_resource=ResourceConfig(num_npus=1), n_samples_per_prompt=2, **keys)


def _log_steps(run_dir, rl: RLSectionConfig) -> _Leaks:
    with _Leaks() as leaks:
        with MetricsLogger(
            str(run_dir), 3, use_tensorboard=False, console=False, trackers=trackers_from_config(rl, str(run_dir)),
            config={"rl_config": {"use_wandb": rl.use_wandb, "use_swanlab": rl.use_swanlab}},
        ) as log:  # fmt: skip
            for it, row in STEPS.items():
                log.log(it, row)
    return leaks


# ------------------------------------------------------------------------------------------------ wandb
def _wandb_records(path: str):
    """The records of a `.wandb` file, parsed with wandb's own protobuf schema. The file is wandb's record log: a
    7-byte header (':W&B', magic 0xBEE1, version), then 32 KiB blocks of chunks, each with a 7-byte header (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), (ident, magic)
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def _wandb_history(run_file: str) -> dict[tuple[int, str], float]:
    out = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
        step = int(items.pop("_step"))
        for key, value in items.items():
            if not key.startswith("_"):
                out[(step, key)] = float(value)  # NaN is stored as the JSON token NaN
    return out


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """WANDB_MODE=offline, as a user sets it; wandb's own cache, config and debug logs in the test's tmp."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))


def test_wandb_offline_run_goes_to_wandb_save_dir(tmp_path, wandb_offline):
    save_dir = tmp_path / "wandb_files"
    rl = _rl(use_wandb=True, wandb_project="mindrl-test", wandb_exp_name="ppo", wandb_save_dir=str(save_dir))
    leaks = _log_steps(tmp_path / "run", rl)
    (run_file,) = glob.glob(str(save_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert not (tmp_path / "run" / "wandb").exists()  # not the run dir: where wandb_save_dir says
    assert _same(_wandb_history(run_file), _expected()), _wandb_history(run_file)
    runs = [r.run for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].project == "mindrl-test" and runs[0].display_name == "ppo"
    assert leaks.new_pids == [] and leaks.new_threads == [], (leaks.new_pids, leaks.new_threads)


def test_wandb_save_dir_defaults_to_the_run_dir(tmp_path, wandb_offline):
    _log_steps(tmp_path / "run", _rl(use_wandb=True))
    (run_file,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert _same(_wandb_history(run_file), _expected())


# ------------------------------------------------------------------------------------------------ SwanLab
def _swanlab_scalars(run_file: str) -> dict[tuple[int, str], float]:
    """The scalars mindrl logged to a `.swanlab` file, read with SwanLab's own reader and record schema (what
    `swanlab sync` uploads); SwanLab's own system metrics (`__swanlab__.cpu.pct`, ...) left out."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader, out = DataStoreReader(), {}
    reader.open(run_file)
    try:
        for raw in reader:
            record = Record()
            record.ParseFromString(raw)
            if record.HasField("scalar") and not record.scalar.key.startswith("__swanlab__"):  # not its CPU monitor
                out[(record.scalar.step, record.scalar.key)] = record.scalar.value.number
    finally:
        reader.close()
    return out


def test_swanlab_offline_run_goes_to_swanlab_save_dir(tmp_path):
    pytest.importorskip("swanlab")
    save_dir = tmp_path / "swanlab_files"
    rl = _rl(use_swanlab=True, swanlab_mode="offline", swanlab_project="mindrl-test",
                         swanlab_exp_name="grpo", swanlab_save_dir=str(save_dir))  # fmt: skip
    leaks = _log_steps(tmp_path / "run", rl)
    (run_file,) = glob.glob(str(save_dir / "run-*" / "run-*.swanlab"))
    got = _swanlab_scalars(run_file)
    assert _same(got, _expected()), got
    assert leaks.new_pids == [] and leaks.new_threads == [], (leaks.new_pids, leaks.new_threads)


def test_swanlab_save_dir_defaults_under_the_run_dir(tmp_path):
    pytest.importorskip("swanlab")
    rl = _rl(use_swanlab=True, swanlab_mode="offline", swanlab_project="mindrl-test")
    _log_steps(tmp_path / "run", rl)
    (run_file,) = glob.glob(str(tmp_path / "run" / "swanlog" / "run-*" / "run-*.swanlab"))
    assert _same(_swanlab_scalars(run_file), _expected())


def test_cloud_without_login_fails_at_start_and_closes_the_other_tracker(tmp_path, wandb_offline, monkeypatch):
    """SwanLab cloud with no API key fails at once (never an interactive login prompt, no network), and the wandb
    run opened before it is finished with its service process stopped."""
    pytest.importorskip("swanlab")
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab_home"))  # no saved login of the user's
    monkeypatch.chdir(tmp_path)  # nor one in the working directory's .swanlab
    rl = _rl(use_wandb=True, use_swanlab=True, swanlab_mode="cloud", swanlab_project="p")
    with _Leaks() as leaks, pytest.raises(RuntimeError, match="no API key"):
        MetricsLogger(str(tmp_path / "run"), 3, use_tensorboard=False, trackers=trackers_from_config(rl, "run"))
    assert glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))  # wandb had started
    assert leaks.new_pids == [] and leaks.new_threads == [], (leaks.new_pids, leaks.new_threads)


@pytest.mark.slow  # reads the straight GRPO run (shared): Ray and worker processes, unless another test started it
def test_swanlab_gets_every_metric_of_a_trainer_run(assets, tmp_path_factory):
    """The trainer opens SwanLab from its config (rl_helpers.TRACKED) and every metric of every iteration arrives as
    metrics.jsonl has it (null there: NaN here)."""
    run = straight_run("grpo", assets, tmp_path_factory)
    (run_file,) = glob.glob(str(run.run_dir / "swanlog" / "run-*" / "run-*.swanlab"))
    want = {(row["iteration"], k): (math.nan if v is None else v) for row in run.lines for k, v in row.items()}
    want = {k: v for k, v in want.items() if k[1] != "iteration"}
    assert len(want) > 100 and _same(_swanlab_scalars(run_file), want)


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("kind", ["wandb", "swanlab"])
def test_missing_package_names_the_key_before_touching_disk(tmp_path, monkeypatch, kind):
    monkeypatch.setitem(sys.modules, kind, None)  # makes `import <kind>` raise ImportError
    rl = _rl(**{f"use_{kind}": True, "swanlab_mode": "offline", "swanlab_project": "p"})
    with pytest.raises(ImportError, match=rf"rl_config\.use_{kind} is true but the `{kind}` package"):
        MetricsLogger(str(tmp_path / "run"), 3, use_tensorboard=False, trackers=trackers_from_config(rl, "x"))
    assert not (tmp_path / "run").exists()


def _load_errors(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        load_config("ppo_tiny_cpu", overrides=list(overrides), check_paths=False)
    return {i.key: i.message for i in e.value.issues}


@pytest.mark.parametrize("kind", ["wandb", "swanlab"])
def test_missing_package_is_a_load_error(monkeypatch, kind):
    monkeypatch.setitem(sys.modules, kind, None)
    extra = ["rl_config.swanlab_mode=offline", "rl_config.swanlab_project=p"] if kind == "swanlab" else []
    issues = _load_errors(f"rl_config.use_{kind}=true", *extra)
    assert f"the `{kind}` package is not installed" in issues[f"rl_config.use_{kind}"], issues


def test_swanlab_mode_and_project_are_checked_at_load():
    issues = _load_errors("rl_config.use_swanlab=true")
    mode = issues["rl_config.swanlab_mode"]
    assert "it is unset" in mode and "offline, local, cloud" in mode, mode
    assert "is required with use_swanlab" in issues["rl_config.swanlab_project"]
    issues = _load_errors("rl_config.use_swanlab=true", "rl_config.swanlab_mode=ofline", "rl_config.swanlab_project=p")
    mode = issues["rl_config.swanlab_mode"]
    assert "'ofline'" in mode and "did you mean 'offline'" in mode, mode
    for mode in ("offline", "cloud", "online"):  # MindSpeed-RL's cloud and swanlab's own spelling of it
        cfg = load_config("ppo_tiny_cpu", overrides=["rl_config.use_swanlab=true", f"rl_config.swanlab_mode={mode}",
                                                     "rl_config.swanlab_project=p"], check_paths=False)  # fmt: skip
        assert cfg.rl_config.swanlab_mode == mode


def test_swanlab_local_without_its_dashboard_is_a_load_error(monkeypatch):
    pytest.importorskip("swanlab")
    monkeypatch.setitem(sys.modules, "swanboard", None)
    issues = _load_errors("rl_config.use_swanlab=true", "rl_config.swanlab_mode=local", "rl_config.swanlab_project=p")
    assert "swanlab[dashboard]" in issues["rl_config.swanlab_mode"], issues


def test_bad_wandb_mode_is_a_load_error(monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offlne")
    issues = _load_errors("rl_config.use_wandb=true")
    assert "WANDB_MODE='offlne'" in issues["rl_config.use_wandb"], issues
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert load_config("ppo_tiny_cpu", overrides=["rl_config.use_wandb=true"], check_paths=False).rl_config.use_wandb
