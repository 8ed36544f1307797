"""Load-time checks of the paths a config names: checkpoints (and that they hold the model the config
describes), the packed prompt dataset and the tokenizer."""

from __future__ import annotations

import os

from mindrl.config.errors import Collector
from mindrl.config.model import ModelArchConfig
from mindrl.config.root import RLConfig

DATASET_SUFFIX = "_packed_input_ids_document"


def dataset_output_prefix(data_path: str) -> str:
    """megatron_training.data_path as mindrl-preprocess's output_prefix (it may name the input_ids dataset)."""
    return data_path[: -len(DATASET_SUFFIX)] if data_path.endswith(DATASET_SUFFIX) else data_path


def _p(path: str) -> str:
    """A path for messages: as written, plus where it resolves when it is relative."""
    return repr(path) if os.path.isabs(path) else f"{path!r} (= {os.path.abspath(path)})"


def check_paths(cfg: RLConfig, col: Collector) -> None:
    """Report every missing or wrong path of `cfg` to `col`."""
    mt, rl = cfg.megatron_training, cfg.rl_config
    _check_checkpoint(col, "actor_config.load", cfg.actor_config.load, cfg.model, value_model=False)
    ref = rl.integrated_mode_config.ref_model_load_path
    if ref:
        _check_checkpoint(
            col, "rl_config.integrated_mode_config.ref_model_load_path", ref, cfg.model, value_model=False
        )
    if cfg.critic_config is not None and cfg.critic_model is not None:
        _check_checkpoint(col, "critic_config.load", cfg.critic_config.load, cfg.critic_model, value_model=True)
    if mt.data_path and not col.is_bad("megatron_training.data_path"):
        _check_dataset(col, mt.data_path, mt.dataset_additional_keys)
    if rl.runtime_env_path:
        _check_runtime_env(col, rl.runtime_env_path)
    for key, path in (
        ("megatron_training.tokenizer_name_or_path", mt.tokenizer_name_or_path),
        ("generate_config.tokenizer_name_or_path", cfg.generate_config.tokenizer_name_or_path),
    ):
        if path and not (key.startswith("generate") and path == mt.tokenizer_name_or_path):
            _check_tokenizer(col, key, path)


def _older_iteration_spec(path: str):
    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.checkpoint.iterations import saved_iterations
    from mindrl.checkpoint.mcore_ckpt import read_model_meta

    for it in reversed(saved_iterations(path)):
        try:
            return read_model_meta(path, it)[0]
        except (CheckpointError, OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _check_checkpoint(col: Collector, key: str, path: str | None, arch: ModelArchConfig, value_model: bool) -> None:
    from mindrl.checkpoint import legacy
    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.checkpoint.mcore_ckpt import TRACKER, read_model_meta

    if not path or col.is_bad(key):
        return
    if not os.path.isdir(path):
        col.add(key, f"checkpoint directory {_p(path)} does not exist")
        return
    if not os.path.isfile(os.path.join(path, TRACKER)):
        col.add(key, f"{_p(path)} is not a megatron checkpoint: it has no {TRACKER} (convert an HF model with "
                "mindrl-convert hf2mcore, or point at a finished save)")  # fmt: skip
        return
    try:
        spec = legacy.resolve_spec(path)[0] if legacy.is_legacy(path) else read_model_meta(path)[0]
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        # A damaged newest iteration: a resume falls back to an older complete one (with a warning), whose
        # description serves the checks here; with none readable, the error stands.
        spec = _older_iteration_spec(path)
        if spec is None:
            col.add(key, f"cannot read the checkpoint's model description: {e}")
            return
    if spec.is_value_model != value_model:
        want = "a value model (convert with --orm)" if value_model else "a causal LM"
        col.add(key, f"{path!r} holds a {spec.architecture}, but this role needs {want}")
    if not arch.name:
        return
    # The model file must describe the network in the checkpoint: layouts and the planner trust it.
    where = f"model.{arch.name}"
    pairs = [
        ("num_layers", arch.num_layers, spec.num_layers),
        ("hidden_size", arch.hidden_size, spec.hidden_size),
        ("ffn_hidden_size", arch.ffn_size, spec.ffn_hidden_size),
        ("num_attention_heads", arch.num_attention_heads, spec.num_heads),
        ("num_query_groups", arch.num_kv_heads, spec.num_kv_heads),
        ("padded_vocab_size", arch.padded_vocab_size, spec.vocab_size),
        ("add_qkv_bias", arch.add_qkv_bias, spec.qkv_bias),
    ]
    if not value_model:
        pairs.append(("untie_embeddings_and_output_weights", arch.untie_embeddings_and_output_weights,
                      not spec.tie_word_embeddings))  # fmt: skip
    for name, ours, theirs in pairs:
        if ours is not None and ours != theirs and not col.is_bad(f"{where}.{name}"):
            col.add(f"{where}.{name}", f"is {ours} but the checkpoint {key}={path!r} has {theirs}: the model file "
                    "must describe the checkpoint's network")  # fmt: skip


def _check_dataset(col: Collector, data_path: str, extra_keys: list[str]) -> None:
    prefix = dataset_output_prefix(data_path)
    missing = []
    for k in ["input_ids", *extra_keys]:
        base = f"{prefix}_packed_{k}_document"
        missing += [base + ext for ext in (".bin", ".idx") if not os.path.isfile(base + ext)]
    if missing:
        col.add("megatron_training.data_path", f"packed dataset files missing: {', '.join(missing)} (data_path "
                f"{_p(data_path)}; run mindrl-preprocess with output_prefix={prefix!r}, and check "
                "dataset_additional_keys)")  # fmt: skip


def _check_tokenizer(col: Collector, key: str, path: str) -> None:
    from mindrl.rollout.base import TOKENIZER_FILES, has_tokenizer

    if not os.path.isdir(path):
        col.add(key, f"tokenizer directory {_p(path)} does not exist")
    elif not has_tokenizer(path):
        col.add(key, f"{_p(path)} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")


def _check_runtime_env(col: Collector, path: str) -> None:
    from mindrl.workers.runtime_env import RuntimeEnvError, read_env_file

    key = "rl_config.runtime_env_path"
    if not os.path.isfile(path):
        col.add(key, f"runtime env file {_p(path)} does not exist")
        return
    try:
        read_env_file(path)
    except RuntimeEnvError as e:
        col.add(key, str(e))
