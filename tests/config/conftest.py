"""Helpers for config tests: config folders written on the fly, and fake assets (checkpoint trackers with
mindrl's model description, packed-dataset files, a tokenizer dir) that pass the path checks without weights."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

TINY_HF = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def write_configs(root: Path, files: dict[str, str]) -> Path:
    """Write {relative path: YAML text} under root; returns root."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def fake_checkpoint(path: Path, value_model: bool = False, **hf_overrides) -> str:
    """A directory that looks like a finished mindrl checkpoint (tracker + model description, no weights)."""
    from mindrl.checkpoint.mcore_ckpt import RELEASE, iteration_dir, write_model_meta, write_tracker
    from mindrl.models.hf_config import ModelSpec

    hf = {**TINY_HF, **hf_overrides}
    if value_model:
        hf["architectures"] = ["Qwen2ForSequenceClassification"]
        hf["num_labels"] = 1
    it = iteration_dir(str(path), RELEASE)
    os.makedirs(it, exist_ok=True)
    write_model_meta(it, ModelSpec.from_hf_config(hf), "critic" if value_model else "actor", 1, 1, "float32")
    write_tracker(str(path), RELEASE)
    return str(path)


@pytest.fixture
def assets(tmp_path) -> dict[str, str]:
    """Paths (as override values) for actor/critic checkpoints, the dataset prefix and the tokenizer."""
    root = tmp_path / "assets"
    actor = fake_checkpoint(root / "actor")
    critic = fake_checkpoint(root / "critic", value_model=True)
    data = root / "data" / "train"
    data.parent.mkdir(parents=True)
    for key in ("input_ids", "labels"):
        for ext in (".bin", ".idx"):
            Path(f"{data}_packed_{key}_document{ext}").write_bytes(b"")
    tok = root / "hf"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    return {"actor": actor, "critic": critic, "data": str(data), "tokenizer": str(tok)}


def asset_overrides(assets: dict[str, str], critic: bool = True) -> list[str]:
    out = [
        f"actor_config.load={assets['actor']}",
        f"rl_config.integrated_mode_config.ref_model_load_path={assets['actor']}",
        f"megatron_training.data_path={assets['data']}",
        f"megatron_training.tokenizer_name_or_path={assets['tokenizer']}",
    ]
    if critic:
        out.append(f"critic_config.load={assets['critic']}")
    return out
