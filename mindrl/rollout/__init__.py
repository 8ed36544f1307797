"""Rollout engines: generate responses + sampled-token logprobs from token-id prompts, with weights
streamed in from the trainer. `VllmEngine` (vLLM, in-process) and `HFEngine` (transformers fallback).
"""

from mindrl.rollout.base import (
    RolloutConfig,
    RolloutEngine,
    RolloutSample,
    SamplingConfig,
    processed_logits,
    processed_logprobs,
)


def __getattr__(name: str):
    # The engines import vllm / transformers lazily: importing mindrl.rollout stays cheap.
    if name == "VllmEngine":
        from mindrl.rollout.vllm_engine import VllmEngine

        return VllmEngine
    if name == "HFEngine":
        from mindrl.rollout.hf_engine import HFEngine

        return HFEngine
    raise AttributeError(name)


__all__ = [
    "HFEngine",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutSample",
    "SamplingConfig",
    "VllmEngine",
    "processed_logits",
    "processed_logprobs",
]
