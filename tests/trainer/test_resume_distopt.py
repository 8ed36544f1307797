"""Exact resume through the trainer with megatron's distributed optimizer (as the shipped 32B configs train):
PPO with a critic and an adaptive KL controller, actor and critic at TP1 x DP2 with their Adam state sharded over
DP. 4 iterations straight equal a resume (finetune: false) from that run's own iteration-2 checkpoint for 2, metric for
metric (1e-6) and bit for bit in the final actor weights. (A run that stopped at its train_iters and is extended is
test_resume.py's case; here the stop is a mid-run checkpoint, which saves a third trainer run.)"""

from __future__ import annotations

import math
import shutil
import sys

import pytest

from tests.trainer.rl_helpers import _config, _run, _train

pytestmark = pytest.mark.slow

DISTOPT = [
    "megatron_training.use_distributed_optimizer=true",
    *[f"{role}_config.tensor_model_parallel_size=1" for role in ("actor", "critic")],
]
EXTRA = ["rl_config.kl_ctrl_type=adaptive", "rl_config.kl_target=1e-9", "rl_config.kl_horizon=10"]
EVERY2 = ["megatron_training.save_interval=2", "rl_config.use_tensorboard=false"]
RESUME = [f"{role}_config.{k}" for role in ("actor", "critic") for k in
          ("finetune=false", "no_load_optim=false", "no_load_rng=false")]  # fmt: skip


def _comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("timing/") and not k.endswith("_tps")}


def test_ppo_resume_with_the_distributed_optimizer_is_exact(assets, tmp_path):
    name, common = "ppo_tiny_cpu", [*DISTOPT, *EVERY2, *EXTRA]
    _, _, straight, _ = _train(_config(name, assets, tmp_path / "straight", "megatron_training.train_iters=4", *common))
    # The run as it stood after iteration 2's save: iteration 4 not written yet (metrics.jsonl is cut back to the
    # resumed iteration by the resume itself).
    from mindrl.checkpoint import mcore_ckpt

    split_dir = tmp_path / "split"
    shutil.copytree(tmp_path / "straight", split_dir)
    for role in ("actor", "critic"):
        shutil.rmtree(split_dir / f"ckpt_{role}" / "iter_0000004")
        mcore_ckpt.write_tracker(str(split_dir / f"ckpt_{role}"), 2)
    cfg = _config(
        name, assets, split_dir, "megatron_training.train_iters=4", *common, *RESUME,
        actor_load=split_dir / "ckpt_actor", critic_load=split_dir / "ckpt_critic",
    )  # fmt: skip
    _, results, split, _ = _train(cfg)
    assert [r.iteration for r in results] == [3, 4]
    assert [m["iteration"] for m in split] == [1, 2, 3, 4]
    worst = 0.0
    for a, b in zip(straight[2:], split[2:]):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        worst = max([worst] + [abs(a[k] - b[k]) for k in a])
        bad = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6)}
        assert not bad, bad
    print(f"max abs metric difference over the resumed iterations: {worst:.3g}")
    from safetensors.torch import load_file

    exported = []
    for d in (tmp_path / "straight", split_dir):
        _run(sys.executable, "-m", "mindrl.cli.convert", "mcore2hf", "--load-dir", str(d / "ckpt_actor"),
             "--save-dir", str(tmp_path / d.name / "hf"), "--overwrite")  # fmt: skip
        exported.append(load_file(str(tmp_path / d.name / "hf" / "model.safetensors")))
    assert exported[0].keys() == exported[1].keys()
    assert all(exported[0][k].equal(exported[1][k]) for k in exported[0])
