"""The reference model in a sampler (rl_config.async_sampler_ref): an HF causal LM whose per-token logprobs of each
response ride in the experiences, so the trainer skips its own reference forward."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class HFReference:
    """The HF model at `model_dir` in `dtype`; `logprobs` gives each response's tokens' log softmax(logits /
    temperature), as the trainer's reference pass computes them."""

    def __init__(self, model_dir: str, temperature: float = 1.0, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        if not temperature > 0:
            raise ValueError(f"reference logprobs need a temperature > 0, got {temperature}")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.temperature = temperature
        self.dtype = dtype

    @torch.no_grad()
    def logprobs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per response of `prompt_ids` (one group), its tokens' logprobs (a float32 array, float64 for a float64
        model; one per token). One forward over the group, right-padded."""
        p = len(prompt_ids)
        longest = max((len(r) for r in responses), default=0)
        if longest == 0:
            return [np.zeros(0, dtype=np.float32) for _ in responses]
        ids = torch.zeros(len(responses), p + longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(responses):
            ids[i, : p + len(r)] = torch.tensor([*prompt_ids, *r], dtype=torch.long)
            mask[i, : p + len(r)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, p - 1 : p + longest - 1]
        wide = torch.float64 if self.dtype == torch.float64 else torch.float32  # numpy has no bf16
        lp = torch.log_softmax(logits.to(wide) / self.temperature, dim=-1)
        lp = lp.gather(-1, ids[:, p:].unsqueeze(-1)).squeeze(-1)
        return [lp[i, : len(r)].numpy().copy() for i, r in enumerate(responses)]
