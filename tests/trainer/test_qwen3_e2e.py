"""A tiny Qwen3 (QK norm, head_dim 64 != hidden/heads, `qwen3` template) through mindrl-train's code path: a short PPO
run (actor, reference, critic from its trunk, vLLM) on the tiny config at TP2 with configs/model/tiny_qwen3.yaml.
The GRPO family on Qwen3 is test_dapo_e2e's (its DAPO runs train the tiny Qwen3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.rl_helpers import _config, _train, checkpoint_tensors
from tests.trainer.test_ppo_e2e import PPO_ONLY, REQUIRED, _check_metrics, _no_leftovers

pytestmark = pytest.mark.slow  # each run starts Ray and worker processes that import vLLM and megatron

QWEN3 = ["model=tiny_qwen3", "megatron_training.model=tiny_qwen3", "actor_config.model=tiny_qwen3"]


def _qk_norms(ckpt: Path, scratch) -> dict:
    """The q/k norm weights of the newest iteration, stacked over layers ([layers, head_dim]), without optimizer state."""
    tensors = checkpoint_tensors(ckpt, scratch)
    return {
        k: v for k, v in tensors.items() if not k.startswith("optim/") and ("q_layernorm" in k or "k_layernorm" in k)
    }


def test_tiny_qwen3_trains(qwen3_assets, tmp_path):
    overrides = [*QWEN3, "critic_config.model=tiny_qwen3", "megatron_training.train_iters=2",
                 "megatron_training.save_interval=2", "rl_config.use_tensorboard=false"]  # fmt: skip
    cfg = _config("ppo_tiny_cpu", qwen3_assets, tmp_path, *overrides)
    assert cfg.model.qk_layernorm and cfg.model.head_dim == 64 and cfg.rl_config.needs_critic
    run_dir, results, lines, rollouts = _train(cfg)
    assert len(lines) == 2
    _check_metrics(lines, cfg, REQUIRED + PPO_ONLY)
    # The prompts end with Qwen3's empty thought (thinking off, as MindSpeed-RL's qwen3 template).
    assert all(r["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for r in rollouts)
    # Training reached the q/k norms, and they stay one tensor per layer (their TP ranks agree, or the second
    # iteration's engine-vs-actor logprobs above would not).
    start, trained = _qk_norms(qwen3_assets / "actor", tmp_path), _qk_norms(Path(run_dir) / "ckpt_actor", tmp_path)
    assert sorted(trained) == sorted(start) and len(trained) == 2  # q and k, each over the 2 layers
    assert all(trained[k].shape == (2, 64) and not trained[k].equal(start[k]) for k in trained)
    _no_leftovers()
