"""MindSpeed-RL's multi-turn keys (dapo_qwen25_7b_A2_multi_turn): read and checked at load with errors naming the
key and the file; the mode combinations multi-turn refuses, each with its reason; the tool YAML checked by
preflight, naming the file and the entry."""

from __future__ import annotations

import os

import yaml

from mindrl.config import load_config
from mindrl.config.errors import Collector
from mindrl.preflight import check_tool_config
from tests.agent.test_tools import CALC_SCHEMA
from tests.config.test_errors import GRPO, _edited, errors, issue

# The recipe's block, as MindSpeed-RL writes it.
RECIPE = """
  multi_turn_enable: {enable}
  tool_config_path: ./configs/tools/retool_config.yaml
  max_tool_calls: 1
  max_parallel_calls: 1
  max_total_response_length: {total}
  max_tool_response_length: 256
  tool_response_truncate_side: '{side}'
  tool_parser_format: '{fmt}'
"""


def _cfg(tmp_path, enable="false", total=2048, side="middle", fmt="hermes"):
    block = RECIPE.format(enable=enable, total=total, side=side, fmt=fmt)
    return _edited(tmp_path, GRPO, "rl_config:\n", "rl_config:" + block)


def test_the_recipes_keys_are_read_and_listed_as_unused_while_multi_turn_is_off(tmp_path):
    d = _cfg(tmp_path)
    cfg = load_config("cfg", config_path=d)
    rl = cfg.rl_config
    assert (rl.max_tool_calls, rl.max_parallel_calls, rl.max_total_response_length) == (1, 1, 2048)
    assert (rl.max_tool_response_length, rl.tool_response_truncate_side, rl.tool_parser_format) == (
        256,
        "middle",
        "hermes",
    )
    assert rl.tool_config_path == "./configs/tools/retool_config.yaml"
    assert {f"rl_config.{k}" for k in ("tool_config_path", "max_tool_calls", "tool_parser_format")} <= set(
        cfg.ignored_keys
    )


def test_multi_turn_loads_with_async_engine_and_the_episode_length_checked_against_max_model_len(tmp_path):
    d = _cfg(tmp_path, enable="true", total=64)
    text = open(os.path.join(d, "cfg.yaml")).read().replace("  multi_turn_enable: true\n",
                                                            "  multi_turn_enable: true\n  async_engine: true\n")  # fmt: skip
    open(os.path.join(d, "cfg.yaml"), "w").write(text)
    cfg = load_config("cfg", config_path=d)
    assert cfg.rl_config.multi_turn_enable and "rl_config.async_engine" in cfg.ignored_keys
    assert cfg.sequence_length == cfg.rl_config.max_prompt_length + 64
    err = errors("cfg", config_path=_cfg(tmp_path / "long", enable="true", total=100_000))
    issue(err, "generate_config.max_model_len", "rl_config.max_prompt_length + rl_config.max_total_response_length")


def test_async_engine_without_multi_turn_is_refused(tmp_path):
    err = errors("cfg", "+rl_config.async_engine=true", config_path=_cfg(tmp_path))
    issue(err, "rl_config.async_engine", "without multi_turn_enable", "set it to False")


REFUSED = [  # override -> (key, words of the reason)
    ("rl_config.async_mode=bounded", "rl_config.multi_turn_enable", "async_mode bounded", "sampler processes"),
]


def test_the_refused_combinations_say_why(tmp_path):
    for i, (override, key, *words) in enumerate(REFUSED):
        err = errors("cfg", override, config_path=_cfg(tmp_path / str(i), enable="true", total=64))
        issue(err, key, *words)


def test_the_engine_group_the_servers_and_partial_rollout_take_multi_turn(tmp_path):
    """Their weights load once per rollout (`awake`), as the integrated engines' do; the servers must hold a whole
    episode (the trainer checks their max_model_len against the config's sequence_length); partial rollout carries a
    cut episode's whole state (test_agent_loop's partial test)."""
    for i, extra in enumerate([("rl_config.use_integrated_worker=false", "+rl_config.reference_resource.num_npus=2"),
                               ("generate_config.rollout_mode=server",
                                "generate_config.server_urls=[http://127.0.0.1:1]"),
                               ("rl_config.partial_rollout_max_split=2",)]):  # fmt: skip
        cfg = load_config("cfg", overrides=list(extra), config_path=_cfg(tmp_path / str(i), enable="true", total=64))
        assert cfg.rl_config.multi_turn_enable
        assert cfg.sequence_length == cfg.rl_config.max_prompt_length + 64


def test_bad_values_name_the_key_and_the_file(tmp_path):
    d = _cfg(tmp_path, side="midle", fmt="mistral")
    text = open(os.path.join(d, "cfg.yaml")).read().replace("max_tool_calls: 1", "max_tool_calls: 0")
    open(os.path.join(d, "cfg.yaml"), "w").write(text)
    err = errors("cfg", config_path=d)
    src = os.path.join(d, "cfg.yaml")
    issue(err, "rl_config.max_tool_calls", "must be >= 1, got 0", source=src)
    issue(err, "rl_config.tool_response_truncate_side", "'midle' is not one of", "did you mean 'middle'?", source=src)
    issue(err, "rl_config.tool_parser_format", "'mistral' is not one of hermes", source=src)


def test_an_episode_must_hold_a_whole_first_turn(tmp_path):
    err = errors("cfg", config_path=_cfg(tmp_path, total=8))
    issue(err, "rl_config.max_total_response_length", "8 < generate_config.sampling_config.max_tokens")


def test_wrong_types_are_reported(tmp_path):
    d = _cfg(tmp_path)
    text = open(os.path.join(d, "cfg.yaml")).read().replace("max_parallel_calls: 1", "max_parallel_calls: many")
    open(os.path.join(d, "cfg.yaml"), "w").write(text)
    issue(errors("cfg", config_path=d), "rl_config.max_parallel_calls")


def test_preflight_checks_the_tool_yaml_naming_file_and_entry(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"tools": [{"class_name": "calculator", "tool_schema": CALC_SCHEMA}]}))
    col = Collector()
    check_tool_config(col, str(good))
    assert col.issues == []
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tools": [{"class_name": "calculator", "config": {"nope": 1},
                                              "tool_schema": CALC_SCHEMA}]}))  # fmt: skip
    check_tool_config(col, str(bad))
    [i] = col.issues
    assert i.key == "rl_config.tool_config_path"
    assert f"{bad}: tools[0] (calculator): config: unknown key(s) ['nope']" in i.message
