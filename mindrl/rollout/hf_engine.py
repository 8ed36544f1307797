"""transformers `generate` behind the `RolloutEngine` interface, the fallback where vLLM is unavailable; it samples
through `processed_logits`, so its distribution and logprobs are the same as VllmEngine's."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence

import torch

from mindrl.config.settings import RolloutConfig, SamplingConfig
from mindrl.platform import current_platform
from mindrl.rollout.base import (
    TORCH_DTYPES,
    RolloutEngine,
    RolloutSample,
    check_wake_tags,
    forked_rng,
    processed_logits,
    tokenizer_source,
)


class _Processed:
    """A transformers logits processor: raw scores -> `processed_logits` (the scores generate samples from)."""

    def __init__(self, sampling: SamplingConfig):
        self.sampling = sampling

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return processed_logits(scores, self.sampling)


class HFEngine(RolloutEngine):
    """The whole model on every rank (no tensor parallelism); sleep/wake are no-ops."""

    supports_sleep = False
    shares_process_group = False

    def __init__(self, config: RolloutConfig):
        super().__init__(config)
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        if config.infer_tensor_parallel_size != 1:
            raise ValueError(
                f"HFEngine runs the whole model on each rank: infer_tensor_parallel_size must be 1, "
                f"got {config.infer_tensor_parallel_size}"
            )
        tok_dir, self.has_tokenizer = tokenizer_source(config)
        self.device = current_platform().device()
        hf_config = AutoConfig.from_pretrained(config.model)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = _as_list(hf_config.eos_token_id)
        self.pad_token_id = hf_config.pad_token_id if hf_config.pad_token_id is not None else 0
        dp_rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.seed = config.seed + dp_rank
        with forked_rng(self.seed):  # random init must not move the caller's RNG
            if config.load_format == "dummy":
                self.model = AutoModelForCausalLM.from_config(hf_config, dtype=TORCH_DTYPES[config.dtype])
            else:
                self.model = AutoModelForCausalLM.from_pretrained(config.model, dtype=TORCH_DTYPES[config.dtype])
        self.model.to(self.device).eval()
        # A checkpoint's generation_config.json (e.g. top_k=20, temperature=0.7) must not leak into sampling.
        self.model.generation_config = GenerationConfig()
        self.tokenizer = AutoTokenizer.from_pretrained(tok_dir) if self.has_tokenizer else None
        self._rng = torch.Generator().manual_seed(self.seed)
        self._closed = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (tied embeddings: either name lands in the shared tensor)."""
        self._check_open("load_weights")
        targets = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in weights:
                target = targets.get(name)
                if target is None:
                    close = difflib.get_close_matches(name, list(targets), n=3)
                    raise KeyError(f"HFEngine.load_weights: {name!r} is not a weight of the model; close: {close}")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"HFEngine.load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(target.shape)}"
                    )
                target.copy_(tensor)

    def _check_can_generate(self) -> None:
        self._check_open("generate")

    def _generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int] | None
    ) -> list[list[RolloutSample]]:
        call_seed = (
            sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        )
        # Prompts per generate call so that rows (= prompts * n) stay within max_num_seqs.
        chunk = max(1, self.config.max_num_seqs // sampling.n)
        results: list[list[RolloutSample]] = []
        if seeds is not None:  # each prompt alone on its own stream: independent of batching
            for p, seed in zip(prompts, seeds):
                with forked_rng(seed):
                    results.extend(self._generate_chunk([p], sampling))
            return results
        with forked_rng(call_seed):
            for start in range(0, len(prompts), chunk):
                results.extend(self._generate_chunk(prompts[start : start + chunk], sampling))
        return results

    def sleep(self) -> None:
        """A no-op (`supports_sleep` is False): the model stays where it is."""
        self._check_open("sleep")

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """A no-op (`supports_sleep` is False); tags are still checked."""
        self._check_open("wake")
        check_wake_tags(tags)

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        del self.model

    # ---- internals ------------------------------------------------------------------------------

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"HFEngine.{method}() called after shutdown(): create a new engine")

    @torch.no_grad()
    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        from transformers import GenerationConfig, LogitsProcessorList

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token is aligned
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention_mask[i, width - len(p) :] = 1
        stop_ids = list(sampling.stop_token_ids) + ([] if sampling.ignore_eos else self.eos_token_ids)
        # transformers' own warpers off: _Processed applies them, in vLLM's order.
        warpers_off = {} if sampling.greedy else dict(temperature=1.0, top_k=0, top_p=1.0)
        gen_config = GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=not sampling.greedy,
            **warpers_off,
            num_return_sequences=sampling.n,
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            stop_strings=sampling.stop or None,
        )
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=gen_config,
            logits_processor=LogitsProcessorList([_Processed(sampling)]),
            tokenizer=self.tokenizer if sampling.stop else None,
        )
        responses = out.sequences[:, width:]  # (rows, steps), rows = prompts * n, prompt-major
        # Per step, the logprob of the token taken (and the top logprobs): never a (rows, steps, vocab) tensor.
        token_lps, top_ids, top_lps = [], [], []
        for t, scores in enumerate(out.scores):
            lp = scores.float().log_softmax(dim=-1)
            token_lps.append(lp.gather(-1, responses[:, t : t + 1])[:, 0])
            if sampling.logprobs:
                vals, idx = lp.topk(sampling.logprobs, dim=-1)
                top_ids.append(idx)
                top_lps.append(vals)
        token_lps = torch.stack(token_lps, dim=1).cpu()  # (rows, steps)
        tops = (torch.stack(top_ids, dim=1).cpu(), torch.stack(top_lps, dim=1).cpu()) if sampling.logprobs else None
        responses = responses.cpu()
        results = []
        for i in range(len(prompts)):
            rows = range(i * sampling.n, (i + 1) * sampling.n)
            results.append(
                [
                    self._sample(responses[r], token_lps[r], tops and (tops[0][r], tops[1][r]), sampling, stop_ids)
                    for r in rows
                ]
            )
        return results

    def _sample(
        self, ids: torch.Tensor, token_lps: torch.Tensor, tops, sampling: SamplingConfig, stop_ids: list[int]
    ) -> RolloutSample:
        ids_list = ids.tolist()
        length, finish, stop_reason = len(ids_list), "length", None
        for t, tok in enumerate(ids_list):
            if tok in stop_ids:
                length, finish = t + 1, "stop"
                stop_reason = tok if tok in sampling.stop_token_ids else None
                break
        text = None
        if sampling.stop:  # the first position where the decoded text contains a stop string
            for t in range(length):
                decoded = self.tokenizer.decode(ids_list[: t + 1], skip_special_tokens=True)
                hit = min(((decoded.find(s), s) for s in sampling.stop if s in decoded), default=None)
                if hit is not None:
                    length, finish, stop_reason, text = t + 1, "stop", hit[1], decoded[: hit[0]]
                    break
        ids_list = ids_list[:length]
        sampled = token_lps[:length].tolist()
        if any(math.isinf(x) for x in sampled):
            raise RuntimeError("HFEngine sampled a token outside the processed distribution (logprob -inf)")
        top = None
        if tops is not None:
            top = [dict(zip(i.tolist(), v.tolist())) for i, v in zip(tops[0][:length], tops[1][:length])]
        if sampling.detokenize and text is None:
            text = self.tokenizer.decode(ids_list, skip_special_tokens=True)
        return RolloutSample(ids_list, sampled, finish, stop_reason, text if sampling.detokenize else None, top)


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [int(x)]
