"""Exact resume: N iterations straight equal N/2, stop, resume (load: the run's own checkpoints, finetune: false)
for N/2, metric for metric (1e-6) and bit for bit in the final weights; the resume lands on an epoch boundary of
the prompt sampler (16 prompts, 8 per iteration). PPO stops as a finished run of N/2 iterations that is extended;
GRPO (off-policy: 2 mini-batches x 2 epochs) stops at the straight run's own mid-run checkpoint (one trainer
run fewer)."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from tests.trainer.rl_helpers import (
    STRAIGHT_EXTRA,
    _config,
    _train,
    assert_same_checkpoints,
    half_run,
    straight_run,
)

pytestmark = pytest.mark.slow

EXTRA = STRAIGHT_EXTRA  # the straight runs' extra overrides (adaptive KL for PPO, off-policy GRPO)
RESUME = ["finetune=false", "no_load_optim=false", "no_load_rng=false"]
EVERY2 = ["megatron_training.save_interval=2", "rl_config.use_tensorboard=false"]
RESUME_ARGS = [f"{role}_config.{k}" for role in ("actor", "critic") for k in RESUME]


def _straight_and_half(algo, assets, tmp_path_factory, tmp_path):
    """(straight run's metrics, its dir, a fresh copy of the half run's dir): computed once per algorithm (the
    straight run is rl_helpers.straight_run, shared with test_ppo_e2e). PPO's half run is rl_helpers.half_run (a
    finished run of train_iters=2 to extend, shared with test_residency_e2e); GRPO's is the straight run as it stood after iteration 2's save (iteration 4 not
    written yet; the resume cuts metrics.jsonl back to iteration 2)."""
    straight = straight_run(algo, assets, tmp_path_factory)
    split_dir = tmp_path / "split"
    if algo == "ppo":
        shutil.copytree(half_run(assets, tmp_path_factory).run_dir, split_dir)
    else:
        from mindrl.checkpoint import mcore_ckpt

        shutil.copytree(straight.run_dir, split_dir)
        shutil.rmtree(split_dir / "ckpt_actor" / "iter_0000004")
        mcore_ckpt.write_tracker(str(split_dir / "ckpt_actor"), 2)
    return straight.lines, straight.run_dir, split_dir


def _comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("timing/") and not k.endswith("_tps")}


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_resume_is_exact(assets, tmp_path_factory, tmp_path, algo):
    name, extra, every2 = f"{algo}_tiny_cpu", EXTRA[algo], EVERY2
    straight, straight_dir, split_dir = _straight_and_half(algo, assets, tmp_path_factory, tmp_path)
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
    # Final state: the same tensors, weights and optimizer state, bit for bit in both runs' iteration 4.
    roles = ("actor", "critic") if algo == "ppo" else ("actor",)
    for role in roles:
        assert_same_checkpoints(straight_dir / f"ckpt_{role}", split_dir / f"ckpt_{role}", tmp_path)
    state = json.load(open(os.path.join(split_dir, "ckpt_actor", "iter_0000004", "trainer_state.json")))
    assert state["iteration"] == 4 and state["loader"]["sampler"]["consumed_samples"] == 32


# Ctrl-C (SIGINT) of mindrl-train mid-run: the last run of test_faults.py's kill -9 chain.


# ---- damaged checkpoints: fall back to the newest complete iteration, with a warning; never restart silently ---
def _truncate_a_shard(it_dir):
    shard = sorted(p for p in it_dir.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    return shard


DAMAGE = {
    "truncated shard": lambda it: _truncate_a_shard(it).name,
    "rank state missing": lambda it: (it / "rank_state" / "rank_1.pt").unlink() or "rank_1.pt",
    "trainer state garbage": lambda it: (it / "trainer_state.json").write_text('{"iterat') and "trainer_state.json",
    "iteration deleted": lambda it: shutil.rmtree(it) or "does not exist",
}


def _straight_copy(assets, tmp_path_factory, tmp_path):
    straight, straight_dir, _ = _straight_and_half("ppo", assets, tmp_path_factory, tmp_path)
    d = tmp_path / "damaged"
    shutil.copytree(straight_dir, d)
    return straight, d


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_iteration_falls_back_with_a_warning(assets, tmp_path_factory, tmp_path, damage, caplog):
    from mindrl.checkpoint.resume import find_resume

    _, d = _straight_copy(assets, tmp_path_factory, tmp_path)
    named = DAMAGE[damage](d / "ckpt_actor" / "iter_0000004")
    cfg = _config("ppo_tiny_cpu", assets, d, *RESUME_ARGS, actor_load=d / "ckpt_actor", critic_load=d / "ckpt_critic")
    with caplog.at_level("WARNING", logger="mindrl.checkpoint"):
        point = find_resume(cfg)
    assert point.iteration == 2 and point.actor_dir.endswith("iter_0000002")
    assert point.critic_dir.endswith(os.path.join("ckpt_critic", "iter_0000002"))
    assert "resuming from iteration 2, not the newest" in caplog.text and named in caplog.text


def test_critic_behind_the_actor_resumes_both_from_their_common_iteration(assets, tmp_path_factory, tmp_path):
    """A crash between the actor's and the critic's tracker update leaves the critic one save behind."""
    from mindrl.checkpoint import mcore_ckpt
    from mindrl.checkpoint.resume import find_resume

    _, d = _straight_copy(assets, tmp_path_factory, tmp_path)
    mcore_ckpt.write_tracker(str(d / "ckpt_critic"), 2)
    cfg = _config("ppo_tiny_cpu", assets, d, *RESUME_ARGS, actor_load=d / "ckpt_actor", critic_load=d / "ckpt_critic")
    assert find_resume(cfg).iteration == 2


def test_no_complete_iteration_left_is_an_error_naming_the_files(assets, tmp_path_factory, tmp_path):
    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.checkpoint.resume import find_resume

    _, d = _straight_copy(assets, tmp_path_factory, tmp_path)
    s4 = _truncate_a_shard(d / "ckpt_actor" / "iter_0000004")
    (d / "ckpt_actor" / "iter_0000002" / "trainer_state.json").unlink()
    cfg = _config("ppo_tiny_cpu", assets, d, *RESUME_ARGS, actor_load=d / "ckpt_actor", critic_load=d / "ckpt_critic")
    with pytest.raises(CheckpointError) as e:
        find_resume(cfg)
    msg = str(e.value)
    assert "no complete training iteration" in msg and str(s4) in msg and "iter_0000002/trainer_state.json" in msg
    assert "finetune: true" in msg


def test_resume_past_a_damaged_iteration_onto_another_layout(assets, tmp_path_factory, tmp_path):
    """Two things a resume must survive, in one run: the newest iteration's shard is truncated, so the run falls
    back to the previous complete one; and it resumes that TP2 checkpoint at PP2 (same 2 devices: optimizer state
    and weights reshard through dist_checkpointing). The iterations it re-runs match the straight TP2 run within
    1e-5; metrics.jsonl is cut back and appended, never duplicated; the damaged iteration is rewritten whole."""
    straight, d = _straight_copy(assets, tmp_path_factory, tmp_path)
    _truncate_a_shard(d / "ckpt_actor" / "iter_0000004")
    layout = [f"{role}_config.{k}={v}" for role in ("actor", "critic")
              for k, v in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 2))]  # fmt: skip
    cfg = _config(
        "ppo_tiny_cpu", assets, d, "megatron_training.train_iters=4", *EVERY2, *EXTRA["ppo"], *RESUME_ARGS, *layout,
        actor_load=d / "ckpt_actor", critic_load=d / "ckpt_critic",
    )  # fmt: skip
    _, results, split, _ = _train(cfg)
    assert [r.iteration for r in results] == [3, 4]
    assert [m["iteration"] for m in split] == [1, 2, 3, 4]
    worst = 0.0
    for a, b in zip(straight[2:], split[2:]):
        # what a device holds depends on the layout (a PP2 stage holds half the layers): not compared here
        a, b = ({k: v for k, v in _comparable(m).items() if not k.startswith("memory/")} for m in (a, b))
        assert a.keys() == b.keys()
        worst = max([worst] + [abs(a[k] - b[k]) for k in a])
        bad = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-5)}
        assert not bad, bad
    print(f"resumed past a damaged iteration at PP2: max abs metric difference {worst:.3g}")
    from mindrl.checkpoint import mcore_ckpt

    mcore_ckpt.check_files(str(d / "ckpt_actor" / "iter_0000004"))  # the damaged iteration was rewritten whole
