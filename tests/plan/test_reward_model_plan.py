"""The planner counts the reward model: its weights on the device while scoring only, a forward pass's activations,
its own layout; the fix it names is reward_config's."""

from __future__ import annotations

from mindrl.config import load_config
from mindrl.plan.params import stage_params
from mindrl.plan.planner import make_plan


def test_reward_model_in_the_plan():
    cfg = load_config("ppo_tiny_cpu_rm")
    plan = make_plan(cfg, device="host")
    rm = plan.memory["reward"]
    weights = stage_params(cfg.reward_model, "critic", 1, 1, 0).total * 4  # fp32, TP1 PP1
    assert rm["score"]["weights_bytes"] == weights and rm["score"]["activations_bytes"] > 0
    assert all(rm[p]["weights_bytes"] == 0 for p in ("rollout", "critic_train", "train"))
    assert plan.residency["reward"]["score"] == "resident" and plan.residency["reward"]["train"] == "offloaded"
    tp2 = make_plan(load_config("ppo_tiny_cpu_rm", overrides=["reward_config.tensor_model_parallel_size=2"]), "host")
    assert tp2.memory["reward"]["score"]["weights_bytes"] < weights
    big = make_plan(load_config("ppo_tiny_cpu_rm", overrides=["reward_config.micro_batch_size=16"]), "host")
    assert big.verdict["largest_term"] == "reward.score.activations_bytes"
    assert big.verdict["fix"] == "reward_config.micro_batch_size (lower it)"
