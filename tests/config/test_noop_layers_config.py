"""noop_layers (MindSpeed's identity layers) is refused by mindrl-train at load, saying why and, where the recipe's
stages keep a real layer each, the num_layers and num_layer_list that give the same stages without them."""

from __future__ import annotations

import pytest

from mindrl.config import ConfigError
from mindrl.preflight import load_config

MOE = ["model=tiny_qwen3_moe", "megatron_training.model=tiny_qwen3_moe", "actor_config.model=tiny_qwen3_moe",
       "actor_config.tensor_model_parallel_size=1", "actor_config.pipeline_model_parallel_size=2",
       "generate_config.infer_tensor_parallel_size=1", "model.tiny_qwen3_moe.num_layers=4"]  # fmt: skip
KEY = "model.tiny_qwen3_moe.noop_layers"


@pytest.mark.parametrize(
    "overrides, split",
    [
        (["model.tiny_qwen3_moe.noop_layers='1'"], "here num_layers 3 and actor_config.num_layer_list '1,2'"),
        (["model.tiny_qwen3_moe.noop_layers='1'", "+actor_config.num_layer_list='3,1'"], "num_layer_list '2,1'"),
        (["model.tiny_qwen3_moe.noop_layers='0,1'"], None),  # stage 0 would hold no real layer
    ],
)  # fmt: skip
def test_noop_layers_are_refused_naming_the_split_without_them(overrides, split):
    with pytest.raises(ConfigError) as e:
        load_config("grpo_tiny_cpu", overrides=[*MOE, *overrides])
    (issue,) = [i for i in e.value.issues if i.key == KEY]
    assert "identity layers hold no weights" in issue.message and "mindrl builds none" in issue.message
    assert (split in issue.message) if split else ("here num_layers" not in issue.message), issue.message
