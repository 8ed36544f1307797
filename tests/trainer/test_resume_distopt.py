"""Exact resume through the trainer with megatron's distributed optimizer (as the shipped 32B configs train):
PPO with a critic and an adaptive KL controller, actor and critic at TP1 x DP2 with their Adam state sharded over
DP. 4 iterations straight equal a resume (finetune: false) from that run's own iteration-2 checkpoint for 2, metric for
metric (1e-6) and bit for bit in the final actor weights; and a resume of the same checkpoint on half the devices
(world 2 -> 1) samples the same rollouts and matches within 1e-5. (A run that stopped at its train_iters and is
extended is test_resume.py's case; here the stop is a mid-run checkpoint, which saves a third trainer run.)"""

from __future__ import annotations

import math
import shutil

import pytest

from tests.trainer.rl_helpers import _config, _train, assert_same_checkpoints

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


_STRAIGHT: dict = {}


def _straight_and_split(assets, tmp_path_factory, tmp_path):
    """The straight 4-iteration run (once per module) and a fresh copy of it as it stood after iteration 2's save
    (iteration 4 not written yet; metrics.jsonl and rollouts.jsonl are cut back to the resumed iteration by the
    resume itself)."""
    from mindrl.checkpoint import mcore_ckpt

    if not _STRAIGHT:
        run_dir = tmp_path_factory.mktemp("distopt_straight")
        cfg = _config("ppo_tiny_cpu", assets, run_dir, "megatron_training.train_iters=4", *DISTOPT, *EVERY2, *EXTRA)
        _, _, lines, rollouts = _train(cfg)
        _STRAIGHT.update(dir=run_dir, lines=lines, rollouts=rollouts)
    split_dir = tmp_path / "split"
    shutil.copytree(_STRAIGHT["dir"], split_dir)
    for role in ("actor", "critic"):
        shutil.rmtree(split_dir / f"ckpt_{role}" / "iter_0000004")
        mcore_ckpt.write_tracker(str(split_dir / f"ckpt_{role}"), 2)
    return _STRAIGHT["lines"], _STRAIGHT["rollouts"], split_dir


def _samples(rollouts: list[dict], after: int) -> list[tuple]:
    """What the policy sampled in the iterations after `after` (every sample: log_rollouts_interval is 1)."""
    return [(r["iteration"], r["prompt"], r["response"]) for r in rollouts if r["iteration"] > after]


def _resume(assets, split_dir, *overrides):
    cfg = _config(
        "ppo_tiny_cpu", assets, split_dir, "megatron_training.train_iters=4", *DISTOPT, *EVERY2, *EXTRA, *RESUME,
        *overrides, actor_load=split_dir / "ckpt_actor", critic_load=split_dir / "ckpt_critic",
    )  # fmt: skip
    return _train(cfg)


def test_ppo_resume_with_the_distributed_optimizer_is_exact(assets, tmp_path_factory, tmp_path):
    straight, straight_rollouts, split_dir = _straight_and_split(assets, tmp_path_factory, tmp_path)
    _, results, split, rollouts = _resume(assets, split_dir)
    assert [r.iteration for r in results] == [3, 4]
    assert [m["iteration"] for m in split] == [1, 2, 3, 4]
    assert _samples(rollouts, 2) == _samples(straight_rollouts, 2) != []
    worst = 0.0
    for a, b in zip(straight[2:], split[2:]):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        worst = max([worst] + [abs(a[k] - b[k]) for k in a])
        bad = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6)}
        assert not bad, bad
    print(f"max abs metric difference over the resumed iterations: {worst:.3g}")
    # Final state: the same tensors, weights and the distributed optimizer's state, bit for bit.
    for role in ("actor", "critic"):
        assert_same_checkpoints(_STRAIGHT["dir"] / f"ckpt_{role}", split_dir / f"ckpt_{role}", tmp_path)


def test_ppo_resume_on_half_the_devices(assets, tmp_path_factory, tmp_path):
    """The user who resumes on half the nodes: saved at actor/critic TP1 x DP2 (distributed optimizer over 2 ranks,
    2 rollout engines), resumed on 1 device (TP1 x DP1, one engine). The model-space optimizer state reshards onto
    the one rank (tests/workers/test_distopt_resume.py proves that bit for bit); the per-rank RNG states cannot be
    mapped onto another world size and are not restored (a warning says so), yet the rollouts sample exactly what
    the straight run sampled, because every prompt's sampling seed derives from (seed, iteration, dataset row), not
    from an engine's stream. The metrics of the resumed iterations match the straight run within 1e-5 (the DP2 vs
    DP1 gradient reduction order is the only difference)."""
    straight, straight_rollouts, split_dir = _straight_and_split(assets, tmp_path_factory, tmp_path)
    one = [
        "rl_config.actor_resource.num_npus=1", "rl_config.critic_resource.num_npus=1",
        "generate_config.infer_tensor_parallel_size=1",
    ]  # fmt: skip
    _, results, split, rollouts = _resume(assets, split_dir, *one)
    assert [r.iteration for r in results] == [3, 4]
    assert _samples(rollouts, 2) == _samples(straight_rollouts, 2) != []
    worst = 0.0
    for a, b in zip(straight[2:], split[2:]):
        # throughput per device, the per-rank micro-batch plan's token counts and the distributed optimizer's share
        # of a device (memory/) depend on the world size
        a, b = ({k: v for k, v in _comparable(m).items() if not k.startswith(("perf/", "memory/"))} for m in (a, b))
        assert a.keys() == b.keys()
        worst = max([worst] + [abs(a[k] - b[k]) for k in a])
        bad = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-5)}
        assert not bad, bad
    print(f"resumed on 1 device: max abs metric difference over the resumed iterations {worst:.3g}")
