"""Shared by the trainer's end-to-end tests: tiny assets (policy, critic, a preprocessed task), configs pointing at
them, and a train-and-read-back helper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*cmd: str) -> None:
    subprocess.run(
        cmd, check=True, cwd=ROOT, capture_output=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    )


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """A tiny policy (megatron checkpoint), a critic from its trunk, and a comparison task preprocessed."""
    d = tmp_path_factory.mktemp("ppo_assets")
    py = sys.executable
    _run(py, "tools/make_tiny_model.py", "--out", str(d / "hf"))
    # A random (not zero) value head: advantages then carry signal, not whitened rounding noise.
    _run(
        py,
        "tools/make_critic_from_lm.py",
        "--hf-dir",
        str(d / "hf"),
        "--out",
        str(d / "hf_critic"),
        "--head-std",
        "0.05",
    )
    _run(py, "-m", "mindrl.cli.convert", "hf2mcore", "--hf-dir", str(d / "hf"), "--save-dir", str(d / "actor"))
    _run(py, "-m", "mindrl.cli.convert", "hf2mcore", "--hf-dir", str(d / "hf_critic"), "--save-dir", str(d / "critic"),
         "--orm")  # fmt: skip
    rows = [{"problem": f"Which is larger: {a} or {b}?", "answer": str(max(a, b))} for a in range(1, 9) for b in (3, 7)]
    (d / "task.json").write_text(json.dumps(rows))
    _run("bash", "examples/data/preprocess_data.sh", "deepscaler", f"input={d / 'task.json'}",
         f"tokenizer_name_or_path={d / 'hf'}", f"output_prefix={d / 'data' / 'train'}", "workers=1",
         "prompt_type=qwen")  # fmt: skip
    return d


def _config(name: str, assets, run_dir, *overrides: str, actor_load=None, critic_load=None):
    from mindrl.config import load_config

    paths = [
        f"actor_config.load={actor_load or assets / 'actor'}",
        f"actor_config.save={run_dir / 'ckpt_actor'}",
        f"megatron_training.data_path={assets / 'data' / 'train'}",
        f"megatron_training.tokenizer_name_or_path={assets / 'hf'}",
        f"rl_config.integrated_mode_config.ref_model_load_path={assets / 'actor'}",
        f"rl_config.run_dir={run_dir}",
        "rl_config.log_rollouts_interval=1",
    ]
    if name.startswith("ppo"):
        paths += [
            f"critic_config.load={critic_load or assets / 'critic'}",
            f"critic_config.save={run_dir / 'ckpt_critic'}",
        ]
    return load_config(name, overrides=[*paths, *overrides])


def _train(cfg):
    from mindrl.trainer.ppo_trainer import train

    run_dir, results = train(cfg)
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    rollouts = [json.loads(x) for x in open(os.path.join(run_dir, "rollouts.jsonl"))]
    return run_dir, results, lines, rollouts


def ray_processes() -> list[str]:
    """Live Ray processes on this host. Zombies are dead (they hold nothing): a process orphaned by a killed parent
    is re-parented to PID 1, which in a container without an init may never reap it."""
    out = subprocess.run(["pgrep", "-f", "ray::|raylet|gcs_server"], capture_output=True, text=True).stdout.split()
    live = []
    for pid in out:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            live.append(pid)
    return live


def wait_for_no_ray(timeout_s: float) -> list[str]:
    """[] once no live Ray process is left, else those still alive after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (procs := ray_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return procs
