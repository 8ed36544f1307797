"""The rollout engine interface: sampling/engine configs, the per-sample output (token ids, logprob of every sampled
token under the *processed* distribution, finish reason) and the ABC both engines implement."""

from __future__ import annotations

import abc
import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from mindrl.config.settings import DTYPES, RolloutConfig, SamplingConfig
from mindrl.platform import current_platform

FINISH_REASONS = ("stop", "length")
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


@dataclass
class RolloutSample:
    """One response. `logprobs[i]` is the logprob of `token_ids[i]` under the processed distribution."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) | "length" (max_tokens reached)
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS or length
    text: str | None = None  # with SamplingConfig.detokenize
    top_logprobs: list[dict[int, float]] | None = None  # with SamplingConfig.logprobs > 0


def processed_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The logits the sampler draws from: the reference definition both engines follow (vLLM's order).

    logits: (..., vocab) raw logits, any float dtype; returns float32. Greedy (temperature 0) returns the
    raw logits. Otherwise: divide by temperature, then min_p, then top_k, then top_p masking (-inf).
    """
    x = logits.float()
    if sampling.greedy:
        return x
    x = x / sampling.temperature
    if sampling.min_p > 0:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * sampling.min_p, -math.inf)
    if sampling.top_k > 0 and sampling.top_k < x.shape[-1]:
        kth = x.topk(sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if sampling.top_p < 1.0:
        sorted_x, idx = x.sort(dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - sampling.top_p
        drop[..., -1] = False  # always keep the most likely token
        x = x.scatter(-1, idx, sorted_x.masked_fill(drop, -math.inf))
    return x


def processed_logprobs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """log_softmax of `processed_logits`: the distribution rollout logprobs are reported under.

    With top_k=-1, top_p=1, min_p=0 this is exactly `log_softmax(logits / temperature)`, which is what a
    PPO trainer recomputes; truncation makes the returned logprobs those of the truncated distribution.
    """
    return processed_logits(logits, sampling).log_softmax(dim=-1)


# Files whose presence means a model dir carries a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# vLLM-CPU's KV block size for standard attention (vllm/platforms/cpu.py: 128 unless the user or an MLA model sets it).
KV_BLOCK_TOKENS = 128


def full_batch_kv_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    tensor_parallel_size: int = 1,
) -> int:
    """KV-cache bytes on one engine rank for max_num_seqs sequences all at max_model_len: the most a batch can hold,
    so no request is ever preempted for lack of blocks. Each sequence takes whole blocks of KV_BLOCK_TOKENS; two
    blocks more cover vLLM's reserved null block. A TP rank holds num_kv_heads / tp heads (at least one: vLLM
    replicates KV heads when tp exceeds them)."""
    for key, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                   ("dtype_bytes", dtype_bytes), ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                   ("tensor_parallel_size", tensor_parallel_size)):  # fmt: skip
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"full_batch_kv_bytes: {key} must be a positive integer, got {v!r}")
    heads = max(1, num_kv_heads // tensor_parallel_size)
    per_token = 2 * num_layers * heads * head_dim * dtype_bytes  # K and V
    blocks = max_num_seqs * math.ceil(max_model_len / KV_BLOCK_TOKENS) + 2
    return blocks * KV_BLOCK_TOKENS * per_token


def has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def tokenizer_source(config: RolloutConfig) -> tuple[str, bool]:
    """(the tokenizer's dir, whether the engine loads a tokenizer): config.load_tokenizer, else whether the dir
    has one; load_tokenizer=True on a dir without one raises."""
    tok_dir = config.tokenizer or config.model
    load = has_tokenizer(tok_dir) if config.load_tokenizer is None else config.load_tokenizer
    if load and not has_tokenizer(tok_dir):
        raise ValueError(f"load_tokenizer=True but {tok_dir} has none of {', '.join(TOKENIZER_FILES)}")
    return tok_dir, load


SLEEP_TAGS = ("kv_cache", "weights")
"""What sleep() frees and wake(tags) rebuilds, part by part."""


def check_wake_tags(tags: Sequence[str] | None) -> set[str]:
    """The parts wake(tags) rebuilds: all for None; unknown tags raise."""
    wanted = set(SLEEP_TAGS if tags is None else tags)
    if not wanted <= set(SLEEP_TAGS):
        raise ValueError(f"wake tags must be among {SLEEP_TAGS}, got {sorted(wanted)}")
    return wanted


@contextlib.contextmanager
def forked_rng(seed: int | None = None) -> Iterator[None]:
    """Run the block on its own global RNG stream (CPU and device), seeded with `seed` if given, and put the
    caller's RNG state back afterwards."""
    p = current_platform()
    devices = [] if p.is_cpu else list(range(p.device_count()))
    with torch.random.fork_rng(devices=devices, device_type=p.device_type):
        if seed is not None:
            torch.manual_seed(seed)
        yield


class RolloutEngine(abc.ABC):
    """Generates responses from token-id prompts with weights pushed in by the trainer.

    Lifecycle in the hybrid engine, every step: wake() -> load_weights(stream) -> generate(...) -> sleep().
    """

    supports_sleep: bool = False
    """sleep()/wake() really free/rebuild device memory (False: they are no-ops)."""
    shares_process_group: bool = False
    """The engine runs inside the caller's torch.distributed world (its ranks are the caller's ranks)."""

    def __init__(self, config: RolloutConfig):
        self.config = config

    vocab_size: int
    """Token ids of prompts and stop_token_ids must lie in [0, vocab_size)."""
    has_tokenizer: bool
    """The engine loaded a tokenizer (needed for detokenize and stop strings)."""

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seeds: Sequence[int] | None = None,
    ) -> list[list[RolloutSample]]:
        """Per prompt, `sampling.n` samples (in prompt order). Every TP peer must call it with the same args.

        seeds: one per prompt (overrides sampling.seed): prompt i's samples then depend only on its seed, the
        prompt and the weights, not on the batch it came in or the engine's layout (sample j uses seed_i + j)."""
        self._check_can_generate()
        prompts = self.check_prompts(prompt_token_ids, sampling, self.vocab_size)
        seeds = self.check_seeds(seeds, len(prompts))
        if (sampling.detokenize or sampling.stop) and not self.has_tokenizer:
            raise ValueError(
                f"detokenize / stop strings need a tokenizer; {self.config.model} has none (use stop_token_ids)"
            )
        # As vLLM does: a request stops at max_model_len (finish_reason "length"), so a prompt longer than
        # max_model_len - max_tokens gets the tokens left to it; such prompts are sampled apart with that cap.
        caps = [min(sampling.max_tokens, self.config.max_model_len - len(p)) for p in prompts]
        if all(c == sampling.max_tokens for c in caps):
            return self._generate(prompts, sampling, seeds)
        out: list = [None] * len(prompts)
        for cap in sorted(set(caps)):
            idx = [i for i, c in enumerate(caps) if c == cap]
            part = self._generate([prompts[i] for i in idx], replace(sampling, max_tokens=cap),
                                  None if seeds is None else [seeds[i] for i in idx])  # fmt: skip
            for i, samples in zip(idx, part):
                out[i] = samples
        return out

    @abc.abstractmethod
    def _generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int] | None
    ) -> list[list[RolloutSample]]:
        """generate() on prompts and seeds that passed its checks."""

    def _check_can_generate(self) -> None:
        """Raise if the engine cannot generate now (shut down, asleep); generate() calls it first."""
        return None

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (un-sharded) HF-named tensors; any prefix cache is invalidated. Collective over TP peers."""

    def sleep(self) -> None:
        """Free the KV cache (and weights, per config) for training; a no-op unless `supports_sleep`."""
        return None

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Rebuild what sleep() freed; tags ('weights', 'kv_cache') wake parts, None wakes all."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the engine; idempotent. The caller's torch.distributed world stays usable."""

    def release_for_exit(self) -> None:
        """For a process that ends right after (a Ray worker about to be killed): release only what would outlive
        the process. By default, `shutdown`."""
        self.shutdown()

    # ---- shared helpers -------------------------------------------------------------------------

    def check_prompts(
        self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, vocab_size: int
    ) -> list[list[int]]:
        """Validate prompts against the model and config; returns them as lists of ints."""
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if isinstance(prompt_token_ids, torch.Tensor) or not isinstance(prompt_token_ids, Sequence):
            raise TypeError("prompt_token_ids must be a list of token-id lists (one per prompt, unpadded)")
        prompts = []
        limit = self.config.max_model_len
        for i, p in enumerate(prompt_token_ids):
            p = p.tolist() if isinstance(p, torch.Tensor) else [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= limit:  # vLLM's rule: the prompt and at least one response token must fit
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens: max_model_len={limit} leaves no room for a response token"
                )
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"prompt {i} has token id {lo if lo < 0 else hi} outside the vocab [0, {vocab_size})")
            prompts.append(p)
        if sampling.stop_token_ids and max(sampling.stop_token_ids) >= vocab_size:
            raise ValueError(f"stop_token_ids {sampling.stop_token_ids} has ids outside the vocab [0, {vocab_size})")
        return prompts

    @staticmethod
    def check_seeds(seeds: Sequence[int] | None, num_prompts: int) -> list[int] | None:
        if seeds is None:
            return None
        seeds = [int(s) for s in seeds]
        if len(seeds) != num_prompts:
            raise ValueError(f"got {len(seeds)} seeds for {num_prompts} prompts; give one seed per prompt")
        if any(s < 0 for s in seeds):
            raise ValueError(f"seeds must be non-negative, got {min(seeds)}")
        return seeds

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
