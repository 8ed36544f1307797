"""No silent no-ops: docs/config.md's table of ignored and refused MindSpeed-RL keys is the code's, a key accepted only
with mindrl's value refuses any other (naming the key and the file) and lists that value as ignored, and
num_layer_list is checked against the layout."""

from __future__ import annotations

import pytest

from mindrl.config import ConfigError, load_config
from mindrl.config.generate import GenerateConfig
from mindrl.config.megatron import MEGATRON_IGNORED, MEGATRON_UNSUPPORTED, MegatronTrainingConfig, RoleConfig
from mindrl.config.model import ModelArchConfig
from mindrl.config.rl import RLSectionConfig
from tools import config_keys_doc


def test_the_docs_key_table_is_the_codes():
    block = config_keys_doc.current_block(open(config_keys_doc.DOC).read())
    assert block is not None, "docs/config.md lost the key table's markers"
    assert block == config_keys_doc.render(), "docs/config.md's key table is stale: run python tools/config_keys_doc.py"
    for key in ("npu_deterministic", "num_layer_list", "num_layers_per_virtual_pipeline_stage", "hccl_buffersize"):
        assert f"| `{key}` |" not in block


def test_a_key_has_one_fate():
    """A key is a field (it does something), ignored, or accepted with one value: never two of them at once."""
    fields = (
        set(MegatronTrainingConfig.field_names()) | set(RoleConfig.field_names()) | set(ModelArchConfig.field_names())
    )
    assert not set(MEGATRON_IGNORED) & set(MEGATRON_UNSUPPORTED)
    assert not (set(MEGATRON_IGNORED) | set(MEGATRON_UNSUPPORTED)) & fields
    for cls in (RLSectionConfig, GenerateConfig):
        assert not set(cls.IGNORED) & set(cls.UNSUPPORTED), cls
        assert not (set(cls.IGNORED) | set(cls.UNSUPPORTED)) & set(cls.field_names()), cls


# key as an override, mindrl's value (accepted), another value (refused)
ONE_VALUE = [
    ("megatron_training.attention_softmax_in_fp32", "true", "false"),
    ("megatron_training.use_mcore_models", "true", "false"),
    ("actor_config.accumulate_allreduce_grads_in_fp32", "true", "false"),
    ("megatron_training.full_shuffle_instruction_dataset", "false", "true"),
    ("rl_config.async_engine", "false", "true"),
    ("rl_config.require_max_age_all_finished", "true", "false"),
]


def test_a_key_with_mindrls_value_only_refuses_the_others():
    ok = load_config("ppo_tiny_cpu", overrides=[f"+{k}={v}" for k, v, _ in ONE_VALUE])
    assert {k for k, _, _ in ONE_VALUE} <= set(ok.ignored_keys)
    with pytest.raises(ConfigError) as e:
        load_config("ppo_tiny_cpu", overrides=[f"+{k}={bad}" for k, _, bad in ONE_VALUE])
    text = str(e.value)
    assert f"{len(ONE_VALUE)} problems" in text, text
    for key, good, bad in ONE_VALUE:
        shown = {"true": "True", "false": "False", "null": "null"}[good]
        assert f"{key}: " in text and f"set it to {shown}" in text
        assert f"[override '+{key}={bad}']" in text


def test_num_layer_list_and_vpp():
    from mindrl.workers.from_config import model_settings

    name, key = "grpo_qwen25_32b_A3", "actor_config.num_layer_list"  # PP=4 over 64 layers
    even = load_config(name, overrides=[f"{key}='16,16,16,16'"])
    assert key not in even.ignored_keys and model_settings(even.actor_config, even, None, None).layers_per_stage is None
    uneven = load_config(name)  # MindSpeed-RL's own 16,17,16,15: each stage builds its own layers
    assert uneven.actor_config.num_layer_list == "16,17,16,15" and key not in uneven.ignored_keys
    assert model_settings(uneven.actor_config, uneven, None, None).layers_per_stage == (16, 17, 16, 15)
    vpp = "actor_config.num_layers_per_virtual_pipeline_stage"
    assert vpp in load_config(name, overrides=[f"+{vpp}=16"]).ignored_keys  # one chunk per stage: what mindrl runs
    with pytest.raises(ConfigError, match=rf"{vpp}: 8 is not supported .*interleaved.*set it to 16"):
        load_config(name, overrides=[f"+{vpp}=8"])
    for bad in ("'16,16,16'", "'16,16,16,17'", "'32,32,0,0'", "'a,b,c,d'"):
        with pytest.raises(ConfigError, match=rf"{key}: .*(64 in all|comma-separated)"):
            load_config(name, overrides=[f"{key}={bad}"])
