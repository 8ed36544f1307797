"""Shared by the trainer's end-to-end tests: tiny assets (policy, critic, a preprocessed task), configs pointing at
them, and a train-and-read-back helper."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
