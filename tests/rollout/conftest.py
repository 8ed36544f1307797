"""Rollout fixtures: two same-architecture tiny checkpoints (weights A and B), HF reference models, and one
in-process VllmEngine (fp32, prefix caching on) shared by the module's tests (creating one costs ~8 s)."""

from __future__ import annotations

import pytest
import torch

from tests.rollout import helpers


@pytest.fixture(scope="session")
def rollout_models(tmp_path_factory) -> dict[str, str]:
    """'a' and 'b': untied tiny Qwen2 dirs with different random weights; 'a_notok': 'a' without tokenizer
    files and with a generation_config.json whose sampling defaults must be ignored."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("rollout_models")
    a = make_tiny_model(str(root / "a"), num_layers=2, seed=11)
    b = make_tiny_model(str(root / "b"), num_layers=2, seed=12)
    return {"a": a, "b": b, "a_notok": helpers.strip_tokenizer(a, str(root / "a_notok"))}


@pytest.fixture(scope="session")
def hf_models(rollout_models):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(rollout_models[k], dtype=torch.float32).eval() for k in ("a", "b")}


@pytest.fixture(scope="session")
def weights(rollout_models) -> dict[str, dict[str, torch.Tensor]]:
    """The HF checkpoints' tensors: what a megatron weight stream would yield (HF names, full tensors)."""
    return {k: helpers.hf_state(rollout_models[k]) for k in ("a", "b")}


@pytest.fixture(scope="module")
def vllm_engine(rollout_models, weights):
    """Dummy-initialised engine with weights A loaded; records the host state around its creation."""
    from mindrl.rollout import RolloutConfig
    from mindrl.rollout.vllm_engine import VllmEngine

    before = helpers.host_state()
    engine = VllmEngine(
        RolloutConfig(
            model=rollout_models["a"],
            dtype="float32",
            max_model_len=256,
            max_num_seqs=32,
            max_num_batched_tokens=1024,
            enable_prefix_caching=True,
        )
    )
    engine.created_host_diff = helpers.host_diff(before, helpers.host_state())
    engine.load_weights(weights["a"].items())
    yield engine
    engine.shutdown()
    engine.shutdown()  # idempotent
    # The world vLLM created for this engine is gone again, and its VLLM_* variables; nothing else of the host
    # changed. The RNG is left out: tests (and pytest-randomly, before each test) move it themselves.
    changed = helpers.host_diff(before, helpers.host_state())
    assert [k for k in changed if k != "rng"] == []
