"""Exact resume: N iterations straight equal N/2, stop, resume (load: the run's own checkpoints, finetune: false)
for N/2, metric for metric (1e-6) and bit for bit in the final weights; the resume lands on an epoch boundary of
the prompt sampler (16 prompts, 8 per iteration)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from tests.trainer.rl_helpers import _config, _run, _train

pytestmark = pytest.mark.slow

EXTRA = {
    "ppo": ["rl_config.kl_ctrl_type=adaptive", "rl_config.kl_target=1e-9", "rl_config.kl_horizon=10"],
    "grpo": [],
}
RESUME = ["finetune=false", "no_load_optim=false", "no_load_rng=false"]


def _comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("timing/") and not k.endswith("_tps")}


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_resume_is_exact(assets, tmp_path, algo):
    name, extra = f"{algo}_tiny_cpu", EXTRA[algo]
    every2 = ["megatron_training.save_interval=2", "rl_config.use_tensorboard=false"]
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    _, _, straight, _ = _train(_config(name, assets, straight_dir, "megatron_training.train_iters=4", *every2, *extra))
    _train(_config(name, assets, split_dir, "megatron_training.train_iters=2", *every2, *extra))
    resume = [f"actor_config.{k}" for k in RESUME] + ([f"critic_config.{k}" for k in RESUME] if algo == "ppo" else [])
    cfg = _config(
        name, assets, split_dir, "megatron_training.train_iters=4", *every2, *extra, *resume,
        actor_load=split_dir / "ckpt_actor", critic_load=split_dir / "ckpt_critic",
    )  # fmt: skip
    _, results, split, _ = _train(cfg)
    assert [r.iteration for r in results] == [3, 4]  # only the second half ran
    assert [m["iteration"] for m in split] == [1, 2, 3, 4]  # metrics.jsonl appended, nothing duplicated
    for a, b in zip(straight[2:], split[2:]):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        bad = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6)}
        assert not bad, bad
    # Final weights: identical (both exported to HF from iteration 4).
    from safetensors.torch import load_file

    exported = []
    for d in (straight_dir, split_dir):
        _run(sys.executable, "-m", "mindrl.cli.convert", "mcore2hf", "--load-dir", str(d / "ckpt_actor"),
             "--save-dir", str(d / "hf"), "--overwrite")  # fmt: skip
        exported.append(load_file(str(d / "hf" / "model.safetensors")))
    assert exported[0].keys() == exported[1].keys()
    assert all(exported[0][k].equal(exported[1][k]) for k in exported[0])
    state = json.load(open(os.path.join(split_dir, "ckpt_actor", "iter_0000004", "trainer_state.json")))
    assert state["iteration"] == 4 and state["loader"]["sampler"]["consumed_samples"] == 32
