"""The rollout engine interface: sampling/engine configs, the per-sample output, and the ABC.

Both engines (vLLM, transformers) take prompts as token ids and return, per prompt, `n` samples with
their response token ids, the logprob of every sampled token under the *processed* distribution
(see `processed_logprobs`) and a finish reason.
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from mindrl.platform import current_platform

FINISH_REASONS = ("stop", "length")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class SamplingConfig:
    """How to sample; follows MindSpeed-RL's `generate_config.sampling_config` (plus `n`, `stop`).

    Validated at construction; engines trust it.
    """

    max_tokens: int = 128
    """Maximum number of response tokens per sample."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax, logprobs then from the raw distribution)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p (in (0, 1])."""
    top_k: int = -1
    """Keep the top_k most likely tokens; -1 (or 0) disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p * (probability of the most likely token); 0 disables."""
    logprobs: int = 0
    """Besides the sampled token's logprob (always returned), the number of top logprobs per position."""
    seed: int | None = None
    """Per-call seed: same seed, same prompts, same weights -> same samples. None: the engine's RNG stream."""
    detokenize: bool = False
    """Also return the response text (needs a tokenizer in the model dir)."""
    n: int = 1
    """Samples per prompt."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (need a tokenizer). The response ends with the token that completed the string."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response (in addition to the model's EOS); the stop token is kept."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS (benchmarks: fixed-length responses)."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"SamplingConfig: {msg}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.logprobs, int) or self.logprobs < 0:
            bad(f"logprobs (top logprobs per position) must be an integer >= 0, got {self.logprobs!r}")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n (samples per prompt) must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an int or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RolloutConfig:
    """The engine's settings; follows MindSpeed-RL's `generate_config` (plus what an in-process engine needs)."""

    model: str
    """HF model directory: config (and tokenizer, if present). Weights come from it only with load_format='auto'."""
    infer_tensor_parallel_size: int = 1
    """Inference TP. > 1 needs an initialised torch.distributed world whose size it divides."""
    max_num_seqs: int = 256
    """Most sequences the engine decodes at once."""
    max_model_len: int = 2048
    """Prompt + response tokens, at most. A prompt with len(prompt) + max_tokens above it is rejected."""
    max_num_batched_tokens: int = 8192
    """Most tokens in one engine step (prefill chunking)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory for weights + KV cache (ignored when kv_cache_memory_bytes is set)."""
    dtype: str = "bfloat16"
    """Inference dtype: float32, float16 or bfloat16 (use float32 for logprob parity checks)."""
    enforce_eager: bool = True
    """No graph capture/compilation (fast start; capture pays off only on accelerators)."""
    enable_prefix_caching: bool = False
    """Reuse KV blocks of shared prompt prefixes (reset after every load_weights)."""
    load_format: str = "dummy"
    """'dummy': random weights, real ones arrive through load_weights (hybrid engine). 'auto': read the dir."""
    seed: int = 1234
    """Engine RNG seed. The effective seed is seed + the engine's data-parallel index, so TP peers sample
    identically and DP replicas sample different streams."""
    kv_cache_memory_bytes: int | None = None
    """Explicit KV cache size. None: the platform default (a fixed size on CPU, else gpu_memory_utilization)."""
    sleep_level: int = 1
    """vLLM sleep level where the platform has sleep mode: 1 offloads weights to host and drops the KV cache,
    2 drops both (weights must be reloaded after wake, which the hybrid engine does anyway)."""
    tokenizer: str | None = None
    """Tokenizer dir; None: the model dir."""
    load_tokenizer: bool | None = None
    """None: load a tokenizer if the dir has one. False: token ids only (detokenize/stop strings unavailable)."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills over engine steps. None: the platform's default (off where seeded requests cannot
    survive a split prefill, i.e. on CPU; then max_num_batched_tokens is raised to max_model_len)."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"RolloutConfig: {msg}")

        for name in ("infer_tensor_parallel_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                bad(f"{name} must be an integer >= 1, got {v!r}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype not in DTYPES:
            bad(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("dummy", "auto"):
            bad(f"load_format must be 'dummy' or 'auto', got {self.load_format!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            bad(f"kv_cache_memory_bytes must be positive or None, got {self.kv_cache_memory_bytes!r}")
        if self.sleep_level not in (1, 2):
            bad(f"sleep_level must be 1 or 2, got {self.sleep_level!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


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

    @abc.abstractmethod
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seeds: Sequence[int] | None = None,
    ) -> list[list[RolloutSample]]:
        """Per prompt, `sampling.n` samples (in prompt order). Every TP peer must call it with the same args.

        seeds: one per prompt (overrides sampling.seed): prompt i's samples then depend only on its seed, the
        prompt and the weights, not on the batch it came in or the engine's layout (sample j uses seed_i + j)."""

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
            if len(p) + sampling.max_tokens > limit:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_tokens={sampling.max_tokens} that is "
                    f"{len(p) + sampling.max_tokens} > max_model_len={limit}"
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
