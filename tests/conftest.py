"""Shared fixtures: tiny HF checkpoints (built once per session) and one pool of 4 gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# name -> make_tiny_model overrides. Small but complete: GQA (4 heads / 2 kv heads), head_dim 32.
TINY_VARIANTS = {
    "untied": dict(tie_word_embeddings=False, num_layers=2, seed=1),
    "tied": dict(tie_word_embeddings=True, num_layers=2, seed=2),
    "orm": dict(orm=True, num_layers=2, seed=3),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """HF dirs of the tiny Qwen2 variants: 'untied', 'tied' (causal LMs) and 'orm' (seq-cls, 1 label)."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: make_tiny_model(str(root / name), **kw) for name, kw in TINY_VARIANTS.items()}


_POOL = None


@pytest.fixture
def pool():
    """4 local gloo ranks shared by the whole session; re-created if a failing test tore it down."""
    from mindrl.platform.launch import RankPool

    global _POOL
    if _POOL is None or _POOL.closed:
        _POOL = RankPool(4, timeout_s=600)
    return _POOL


def pytest_sessionfinish(session, exitstatus):
    if _POOL is not None:
        _POOL.close()
