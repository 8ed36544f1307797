"""Shared test helpers: HF reference logprobs, host-state snapshots, checkpoint surgery."""

from __future__ import annotations

import json
import os
import shutil

import torch

from mindrl.rollout import RolloutSample, SamplingConfig, processed_logprobs


def hf_state(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def strip_tokenizer(src: str, dst: str) -> str:
    """Copy of an HF dir without tokenizer files, with sampling defaults that would change the output."""
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump({"top_k": 2, "temperature": 0.1, "top_p": 0.5, "do_sample": True}, f)
    return dst


@torch.no_grad()
def recompute_logprobs(model, prompt: list[int], sample: RolloutSample, sampling: SamplingConfig) -> torch.Tensor:
    """Logprobs of the sample's tokens from a plain HF forward on prompt + response: (response_len,)."""
    ids = torch.tensor([prompt + sample.token_ids])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return processed_logprobs(logits, sampling).gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]


def max_logprob_diff(model, prompts, outputs, sampling: SamplingConfig) -> float:
    diff = 0.0
    for prompt, samples in zip(prompts, outputs):
        for s in samples:
            assert len(s.logprobs) == len(s.token_ids) > 0
            ref = recompute_logprobs(model, prompt, s, sampling)
            diff = max(diff, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return diff


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by repeated full forwards (independent of generate and of any engine)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def host_state() -> dict:
    return {
        "threads": torch.get_num_threads(),
        "set_num_threads": torch.set_num_threads,
        "rng": torch.get_rng_state(),
        "dist": torch.distributed.is_initialized(),
        # PYTEST_CURRENT_TEST: pytest's own record of the running test
        "environ": {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "PYTEST_CURRENT_TEST"},
        "vllm_environ": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},  # kept while an engine lives
    }


def host_diff(before: dict, after: dict) -> list[str]:
    """Names of what changed."""
    out = []
    for k in before:
        same = (
            torch.equal(before[k], after[k])
            if isinstance(before[k], torch.Tensor)
            else before[k] is after[k] or before[k] == after[k]
        )
        if not same:
            out.append(k)
    return out


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(40, 73))]
