"""PPO and GRPO with a reward model beside the rule reward (real megatron on gloo, Ray, vLLM): the new metrics, the
reward model's residency in the ledger, and the first iteration's rewards against a direct computation (transformers'
*ForSequenceClassification on the same rollouts' tokens, the mix done by hand)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.rl_helpers import _config, _train, integrated_rm_run
from tests.workers.reward_rank_fns import hf_model, hf_scores

pytestmark = pytest.mark.slow


def _direct_rewards(rows: list[dict], hf_dir: str, weight: float, normalize: bool, clip) -> tuple:
    """(transformers' fp64 scores of the rows' prompt + response tokens, its fp32-vs-fp64 gap, the rewards mixed by
    hand from the rows' rule rewards and those scores)."""
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(hf_dir).pad_token_id
    tokens = [r["prompt_ids"] + r["response_ids"][: r["response_length"]] for r in rows]
    truth = hf_scores(hf_model(hf_dir, torch.float64), tokens, pad, "none")
    gap = (hf_scores(hf_model(hf_dir, torch.float32), tokens, pad, "none").double() - truth).abs().max().item()
    shaped = truth.clone()
    if normalize:  # the running statistics start empty: the first batch's own mean and (population) std
        shaped = (shaped - shaped.mean()) / shaped.std(unbiased=False)
    if clip is not None:
        shaped = shaped.clamp(*clip)
    rewards = [r.get("acc_for_ppo", 0.0) + weight * s for r, s in zip(rows, shaped.tolist())]  # none: rule_reward false
    return truth, gap, rewards


def _check_run(lines, rollouts, hf_dir, weight, normalize, clip):
    first = next(line for line in lines if line["iteration"] == 1)
    for key in ("timing/reward_model", "reward_model/score/mean", "reward_model/score/max", "reward_model/score/min"):
        assert key in first and math.isfinite(first[key]), key
    # the reward model's weights: on the device while scoring, off it while the engine runs
    assert first["memory/device_bytes/score/reward.weights"] > 0
    assert first["memory/device_bytes/rollout/reward.weights"] == 0
    rows = [r for r in rollouts if r["iteration"] == 1 and r.get("dynamic_sampling", "trained") == "trained"]
    _check_scores(rows, hf_dir, weight, normalize, clip)
    ours = torch.tensor([r["reward_model_score"] for r in rows], dtype=torch.float64)
    assert first["reward_model/score/mean"] == pytest.approx(ours.mean().item(), abs=1e-6)


def _check_scores(rows, hf_dir, weight, normalize, clip):
    """The rows' raw scores against transformers' fp64 scores of their tokens, and their rewards against the mix."""
    truth, gap, rewards = _direct_rewards(rows, hf_dir, weight, normalize, clip)
    ours = torch.tensor([r["reward_model_score"] for r in rows], dtype=torch.float64)
    # two fp32 forwards (HF's, mindrl's) each land within about HF's own fp32-vs-fp64 gap of the fp64 truth
    err = (ours - truth).abs().max().item()
    print(f"|mindrl fp32 - HF fp64| max {err:.3g}; HF fp32-vs-fp64 gap {gap:.3g}")
    assert err <= 2 * gap + truth.abs().max().item() * torch.finfo(torch.float32).eps
    # the mix: the scores' rounding error scaled by the normalisation (1 / std) and the weight
    scale = abs(weight) / (truth.std(unbiased=False).item() if normalize else 1.0)
    tol = 3 * scale * (2 * gap + truth.abs().max().item() * torch.finfo(torch.float32).eps) + 1e-6
    got = [r["reward"] for r in rows]
    assert max(abs(a - b) for a, b in zip(got, rewards)) <= tol, (got, rewards)


def test_ppo_with_reward_model(assets, tmp_path_factory):
    """ppo_tiny_cpu_rm at TP1 on one device (rl_helpers.integrated_rm_run, shared with the separate-placement tests;
    the reward model at TP2 is the GRPO run's, at DP2 test_reward_model_alone's)."""
    from mindrl.plan.planner import make_plan

    run = integrated_rm_run(assets, tmp_path_factory)
    cfg, lines, rollouts = run.cfg, run.lines, run.rollouts
    planned = make_plan(cfg, device="host").memory["reward"]["score"]["weights_bytes"]
    assert lines[0]["memory/device_bytes/score/reward.weights"] == planned  # the planner counts what the ledger sees
    rl = cfg.rl_config
    _check_run(lines, rollouts, str(assets / "hf_critic"), rl.reward_model_weight, rl.normalize_reward,
               tuple(rl.reward_clip_range))  # fmt: skip


# GRPO with a TP2 reward model (weight 2, running normalisation) for 2 iterations, saved after each: the first
# iteration's rewards are test_grpo_with_reward_model's, the run is the straight side of the normalisation resume (one
# trainer start for both; the unnormalised mix is test_reward_model_alone's). Read-only: copy to resume from it.
GRPO_RM = ["+reward_config.tensor_model_parallel_size=2", "+reward_config.micro_batch_size=4",
           "+rl_config.reward_model_weight=2.0", "+rl_config.normalize_reward=true",
           "megatron_training.save_interval=1", "rl_config.use_tensorboard=false"]  # fmt: skip
_GRPO_RM: dict = {}


def _grpo_rm_run(assets, tmp_path_factory):
    """(config, metrics, rollouts, run dir) of the shared GRPO + reward model run, once per session."""
    if not _GRPO_RM:
        run_dir = tmp_path_factory.mktemp("grpo_rm")
        cfg = _config("grpo_tiny_cpu", assets, run_dir, "megatron_training.train_iters=2",
                      f"+reward_config.load={assets / 'critic'}", *GRPO_RM)  # fmt: skip
        _, _, lines, rollouts = _train(cfg)
        _GRPO_RM.update(cfg=cfg, lines=lines, rollouts=rollouts, run_dir=run_dir)
    return _GRPO_RM["cfg"], _GRPO_RM["lines"], _GRPO_RM["rollouts"], _GRPO_RM["run_dir"]


def test_grpo_with_reward_model(assets, tmp_path_factory):
    cfg, lines, rollouts, _ = _grpo_rm_run(assets, tmp_path_factory)
    assert cfg.reward_config.tp == 2 and cfg.rl_config.normalize_reward and cfg.rl_config.reward_clip_range is None
    _check_run(lines, rollouts, str(assets / "hf_critic"), 2.0, True, None)


def test_resume_continues_the_running_normalisation(assets, tmp_path_factory, tmp_path):
    """GRPO with normalize_reward for 2 iterations straight (the shared run) equals 1, stop, resume for 1: iteration
    2's rewards depend on iteration 1's scores through the running statistics saved in trainer_state.json."""
    import json
    import shutil

    from mindrl.checkpoint import mcore_ckpt

    _, straight, _, straight_dir = _grpo_rm_run(assets, tmp_path_factory)
    split_dir = tmp_path / "split"
    shutil.copytree(straight_dir, split_dir)
    shutil.rmtree(split_dir / "ckpt_actor" / "iter_0000002")
    mcore_ckpt.write_tracker(str(split_dir / "ckpt_actor"), 1)
    state = json.load(open(split_dir / "ckpt_actor" / "iter_0000001" / "trainer_state.json"))
    assert state["reward_moments"]["count"] == 8 * 4  # iteration 1's scores
    resume = [f"actor_config.{k}" for k in ("finetune=false", "no_load_optim=false", "no_load_rng=false")]
    _, results, split, _ = _train(_config("grpo_tiny_cpu", assets, split_dir, "megatron_training.train_iters=2",
                                          f"+reward_config.load={assets / 'critic'}", *GRPO_RM, *resume,
                                          actor_load=split_dir / "ckpt_actor"))  # fmt: skip
    assert [r.iteration for r in results] == [2]
    for key in ("reward/mean", "reward_model/score/mean", "critic/advantages/max", "actor/pg_loss"):
        assert math.isclose(straight[1][key], split[1][key], rel_tol=1e-6, abs_tol=1e-6), key


def test_reward_model_alone_with_dynamic_sampling_and_evaluation(assets, tmp_path):
    """rule_reward: false (the reward model alone: reward = 2 x score), DAPO's filter on the whole reward, and the
    held-out evaluation with the reward model's scores: every trained, dropped and evaluated row against
    transformers' fp64 score of its tokens."""
    import json

    cfg = _config("grpo_tiny_cpu", assets, tmp_path, "megatron_training.train_iters=1", "rl_config.rule_reward=false",
                  f"+reward_config.load={assets / 'critic'}", "+reward_config.micro_batch_size=4",
                  "+rl_config.reward_model_weight=2.0", "+rl_config.filter_groups_enable=true",
                  "+rl_config.filter_groups_metric=seq_reward", "+rl_config.filter_groups_max_batches=4",
                  f"rl_config.val_data_path={assets / 'data' / 'train'}", "rl_config.val_max_prompts=5",
                  "rl_config.use_tensorboard=false")  # fmt: skip
    assert cfg.rl_config.verifiers == ()
    run_dir, _, lines, rollouts = _train(cfg)
    hf_dir = str(assets / "hf_critic")
    _check_run(lines, rollouts, hf_dir, 2.0, False, None)
    first = lines[1]
    assert first["train/num_gen_batches"] >= 1 and "acc_for_ppo_rewards/mean" not in first
    assert first["timing/reward_model"] > 0 and first["timing/rule_reward"] == 0
    dropped = [r for r in rollouts if r.get("dynamic_sampling", "trained") != "trained"]
    if dropped:  # the filtered and surplus rows were scored the same way
        _check_scores(dropped, hf_dir, 2.0, False, None)
    for it, line in zip((0, 1), lines):  # before training and after iteration 1
        evaluated = [json.loads(x) for x in open(tmp_path / "eval" / f"iter_{it:07d}.jsonl")]
        assert line["iteration"] == it and line["val/num_prompts"] == 5 == len(evaluated)
        _check_scores(evaluated, hf_dir, 2.0, False, None)
        mean = sum(r["reward_model_score"] for r in evaluated) / 5
        assert line["val/reward_model/score/mean"] == pytest.approx(mean, abs=1e-9)
        assert line["val/reward/mean"] == pytest.approx(2 * mean, abs=1e-6)
