"""Preflight's path checks at load: checkpoints exist, are finished megatron checkpoints of the right kind and hold the
network the model file describes; the packed dataset and the tokenizer exist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mindrl.config import ConfigError
from mindrl.preflight import load_config
from tests.config.conftest import asset_overrides, fake_checkpoint


def _err(name: str, overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_config(name, overrides=overrides)
    return e.value


def _messages(err: ConfigError, key: str) -> str:
    msgs = [i.message for i in err.issues if i.key == key]
    assert msgs, f"no issue for {key} in:\n{err}"
    return " | ".join(msgs)


def test_missing_checkpoint_and_missing_tracker(assets, tmp_path):
    empty = tmp_path / "not_a_ckpt"
    empty.mkdir()
    err = _err("ppo_tiny_cpu", [*asset_overrides(assets), f"actor_config.load={tmp_path / 'nope'}",
                                f"critic_config.load={empty}"])  # fmt: skip
    assert "does not exist" in _messages(err, "actor_config.load")
    assert "latest_checkpointed_iteration.txt" in _messages(err, "critic_config.load")
    assert all(i.source.startswith("override") for i in err.issues)


def test_role_needs_the_right_kind_of_checkpoint(assets):
    err = _err("ppo_tiny_cpu", [*asset_overrides(assets), f"critic_config.load={assets['actor']}"])
    assert "needs a value model (convert with --orm)" in _messages(err, "critic_config.load")


def test_model_file_must_describe_the_checkpoint(assets, tmp_path):
    other = fake_checkpoint(tmp_path / "deeper", num_hidden_layers=4, num_key_value_heads=4)
    err = _err("grpo_tiny_cpu", [*asset_overrides(assets, critic=False), f"actor_config.load={other}"])
    assert "is 2 but the checkpoint actor_config.load" in _messages(err, "model.tiny_qwen2.num_layers")
    assert "has 4" in _messages(err, "model.tiny_qwen2.num_query_groups")
    assert any(i.source.endswith(os.path.join("model", "tiny_qwen2.yaml")) for i in err.issues)


def test_reference_path_checked(assets, tmp_path):
    err = _err("grpo_tiny_cpu", [*asset_overrides(assets, critic=False),
                                 f"rl_config.integrated_mode_config.ref_model_load_path={tmp_path / 'ref'}"])  # fmt: skip
    assert "does not exist" in _messages(err, "rl_config.integrated_mode_config.ref_model_load_path")


def test_dataset_files_and_prefix_forms(assets):
    os.remove(assets["data"] + "_packed_labels_document.idx")
    err = _err("grpo_tiny_cpu", asset_overrides(assets, critic=False))
    msg = _messages(err, "megatron_training.data_path")
    assert "train_packed_labels_document.idx" in msg and "mindrl-preprocess" in msg
    Path(assets["data"] + "_packed_labels_document.idx").write_bytes(b"")
    # the input_ids dataset prefix is accepted as well as the output prefix
    cfg = load_config("grpo_tiny_cpu", overrides=[*asset_overrides(assets, critic=False),
                                                  f"megatron_training.data_path={assets['data']}_packed_input_ids_document"])  # fmt: skip
    assert cfg.megatron_training.data_path.endswith("_packed_input_ids_document")


def test_tokenizer_dir_needs_tokenizer_files(assets, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    err = _err("grpo_tiny_cpu", [*asset_overrides(assets, critic=False), f"megatron_training.tokenizer_name_or_path={bare}",
                                 f"generate_config.tokenizer_name_or_path={tmp_path / 'missing'}"])  # fmt: skip
    assert "has no tokenizer files" in _messages(err, "megatron_training.tokenizer_name_or_path")
    assert "does not exist" in _messages(err, "generate_config.tokenizer_name_or_path")


def test_check_paths_false_skips_them():
    cfg = load_config("grpo_tiny_cpu", check_paths=False, overrides=["actor_config.load=/no/such/dir"])
    assert cfg.actor_config.load == "/no/such/dir"


def test_runtime_env_path_checked_at_load(assets, tmp_path):
    bad = tmp_path / "env.yaml"
    bad.write_text("env_vars:\n  BAD-NAME: x\n")
    err = _err("ppo_tiny_cpu", [*asset_overrides(assets), f"rl_config.runtime_env_path={tmp_path / 'none.yaml'}"])
    assert "does not exist" in _messages(err, "rl_config.runtime_env_path")
    err = _err("ppo_tiny_cpu", [*asset_overrides(assets), f"rl_config.runtime_env_path={bad}"])
    assert "env_vars.BAD-NAME: not a valid environment variable name" in _messages(err, "rl_config.runtime_env_path")
    good = tmp_path / "good.yaml"
    good.write_text("env_vars:\n  A: '1'\n")
    cfg = load_config("ppo_tiny_cpu", overrides=[*asset_overrides(assets), f"rl_config.runtime_env_path={good}"])
    assert cfg.rl_config.runtime_env_path == str(good)


def _tokenizer(path: Path, size: int) -> str:
    """An HF tokenizer dir of `size` tokens (len(tokenizer) == size)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(path)
    return str(path)


def test_make_vocab_size_divisible_by_pads_the_tokenizer(assets, tmp_path):
    """padded_vocab_size unset: the rows are megatron's (the tokenizer's size up to a multiple of
    make_vocab_size_divisible_by x TP), and a checkpoint with other rows is an error naming the key."""
    tok = _tokenizer(tmp_path / "tok", 1000)
    unset = [*asset_overrides(assets, critic=False), f"megatron_training.tokenizer_name_or_path={tok}",
             "model.tiny_qwen2.padded_vocab_size=null"]  # fmt: skip
    cfg = load_config("grpo_tiny_cpu", overrides=[*unset, "model.tiny_qwen2.make_vocab_size_divisible_by=96"],
                      check_paths=False)  # fmt: skip
    assert cfg.actor_config.tp == 2 and cfg.model.vocab_rows(1000, cfg.actor_config.tp) == 1152  # 6 x 96 x 2
    load_config("grpo_tiny_cpu", overrides=[*unset, "model.tiny_qwen2.make_vocab_size_divisible_by=128"])  # 1024 rows
    err = _err("grpo_tiny_cpu", [*unset, "model.tiny_qwen2.make_vocab_size_divisible_by=1"])  # the file's value
    msg = _messages(err, "model.tiny_qwen2.make_vocab_size_divisible_by")
    assert "pads the tokenizer's 1000 tokens to 1000 rows" in msg and "= 1 x 2" in msg
    assert "actor_config.load=" in msg and "has 1024" in msg and "set padded_vocab_size: 1024" in msg
    given = load_config("grpo_tiny_cpu", overrides=[*asset_overrides(assets, critic=False),
                        "model.tiny_qwen2.make_vocab_size_divisible_by=1"])  # fmt: skip
    assert given.model.vocab_rows(1000, 2) == 1024  # padded_vocab_size given: megatron derives nothing
