"""The settings groups that several floors share, declared once (standard library only): a trained model's optimizer and
LR schedule, and the rollout engine with its sampling (used by the engine, the rollout server and generate_config)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
DTYPES = ("float32", "float16", "bfloat16")
"""Inference and training dtypes by name (torch's names)."""


@dataclass
class OptimSettings:
    """Optimizer (Adam(W)) and LR schedule of one trained model, in megatron's key names.

    The workers build the optimizer from it. actor_config / critic_config (`RoleConfig`) and SFT's
    megatron_training extend it with their own defaults; `optim_settings` resolves one of them to this class."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: str = "constant"
    """One of LR_DECAY_STYLES: constant | linear | cosine | inverse-square-root | WSD."""
    lr_warmup_iters: int = 0
    """Optimizer steps of linear warmup from 0 to lr (the first step runs at lr 0, as in megatron)."""
    lr_decay_iters: int | None = None
    """Optimizer steps over which lr decays to min_lr (None: the run's total optimizer steps)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (megatron's DistributedOptimizer)."""

    def __post_init__(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style {self.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")

    def optim_settings(self, **resolved: Any) -> OptimSettings:
        """These settings as a plain OptimSettings (from a config section that extends it), with `resolved`
        replacing the section's values (e.g. the warmup once a fraction is turned into steps)."""
        values = {f.name: getattr(self, f.name) for f in fields(OptimSettings)}
        return OptimSettings(**{**values, **resolved})


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass
class RecomputeSettings:
    """Activation recomputation of one trained model, in megatron's / MindSpeed's key names (unset: none).

    The model builder hands the first three to megatron-core's TransformerConfig (its own checkpointed forward);
    the MLP recomputes its activation when recompute_activation_function is set. `recompute_problems` holds the
    rules (megatron's), for the config's validation and for settings built in code."""

    recompute_granularity: str | None = None
    """'full': each checkpointed layer keeps only its input and is run again in backward; 'selective': only the
    core attention (scores, softmax, context) is run again; None: nothing is recomputed."""
    recompute_method: str | None = None
    """Full recomputation only. 'uniform': the stage's layers in chunks of recompute_num_layers, each chunk keeping
    only its input; 'block': the first recompute_num_layers layers of each pipeline stage, the rest not at all."""
    recompute_num_layers: int | None = None
    """Full recomputation only: layers per chunk (uniform) or layers recomputed per pipeline stage (block)."""
    recompute_activation_function: bool = False
    """Recompute the MLP's activation (SwiGLU) in backward instead of keeping its output for the second linear
    layer (MindSpeed's switch, on every layer)."""

    def __post_init__(self) -> None:
        problems = self.recompute_problems()
        if problems:
            raise ValueError("; ".join(f"{key} {message}" for key, message in problems))

    def recompute_problems(self, layers_per_stage: int | None = None) -> list[tuple[str, str]]:
        """(key, message) for each rule these settings break; layers_per_stage: the model's layers per pipeline
        stage, when known."""
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        out: list[tuple[str, str]] = []
        if g not in (None, *RECOMPUTE_GRANULARITIES):
            out.append(("recompute_granularity", f"{g!r} is not one of full, selective (or null: no recomputation)"))
        if m not in (None, *RECOMPUTE_METHODS):
            out.append(("recompute_method", f"{m!r} is not one of uniform, block"))
        if n is not None and n < 1:
            out.append(("recompute_num_layers", f"must be >= 1, got {n}"))
        if g == "full":
            if m is None:
                out.append(("recompute_method", "is required with recompute_granularity: full (uniform or block)"))
            if n is None:
                out.append(("recompute_num_layers", "is required with recompute_granularity: full (>= 1)"))
            elif n >= 1 and layers_per_stage:
                if n > layers_per_stage:
                    out.append(("recompute_num_layers", f"{n} exceeds the {layers_per_stage} layers per pipeline "
                                "stage (num_layers / pipeline_model_parallel_size)"))  # fmt: skip
                elif m == "uniform" and layers_per_stage % n:
                    out.append(("recompute_num_layers", f"{n} does not divide the {layers_per_stage} layers per "
                                "pipeline stage: the uniform method checkpoints chunks of exactly this many layers"))  # fmt: skip
        elif g == "selective":
            for key, value in (("recompute_method", m), ("recompute_num_layers", n)):
                if value is not None:
                    out.append((key, f"must be unset with recompute_granularity: selective (it recomputes the core "
                                f"attention of every layer), got {value!r}"))  # fmt: skip
        return out

    def recompute_settings(self) -> RecomputeSettings:
        """These settings as a plain RecomputeSettings (from a config section that extends it)."""
        return RecomputeSettings(**{f.name: getattr(self, f.name) for f in fields(RecomputeSettings)})

    @property
    def recomputes(self) -> bool:
        """Whether anything is recomputed."""
        return self.recompute_granularity is not None or self.recompute_activation_function


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""MindSpeed-RL's lora_target_modules: megatron's names of the four linears of a dense transformer layer."""


@dataclass
class LoRASettings:
    """LoRA adapters of one trained model, in MindSpeed-RL's key names: on when lora_target_modules names any linear
    (MindSpeed-RL's rule); then the backbone is frozen and only the adapters train (mindrl/models/lora.py, docs/lora.md)."""

    lora_target_modules: list[str] | None = None
    """The linears of every layer that get an adapter, any of linear_qkv, linear_proj, linear_fc1, linear_fc2
    (null or []: no LoRA, the whole model trains)."""
    lora_r: int = 8
    """The adapters' rank r (A is r x in, B is out x r); MindSpeed-RL's default 8."""
    lora_alpha: float = 16.0
    """The adapters' scale is lora_alpha / lora_r (PEFT's); MindSpeed-RL's default 16."""
    lora_ckpt_filter: bool = False
    """Checkpoints hold only the adapters (the frozen backbone stays where `load` has it)."""
    lora_fusion: bool = False
    """MindSpeed's CCLoRA: the adapters' communication overlapped with compute on Ascend. The math is the same; mindrl
    computes the adapters unfused, so the key has no effect (listed as ignored)."""

    def lora_problems(self) -> list[tuple[str, str]]:
        """(key, message) for each rule these settings break."""
        out: list[tuple[str, str]] = []
        targets = self.lora_target_modules or []
        bad = [t for t in targets if t not in LORA_TARGETS]
        if bad:
            out.append(("lora_target_modules", f"{bad} not among {', '.join(LORA_TARGETS)}"))
        if len(set(targets)) != len(targets):
            out.append(("lora_target_modules", f"{targets} names a linear twice"))
        if targets and self.lora_r < 1:
            out.append(("lora_r", f"must be >= 1, got {self.lora_r}"))
        if targets and self.lora_alpha <= 0:
            out.append(("lora_alpha", f"must be > 0, got {self.lora_alpha}"))
        return out

    def checkpoint_problems(self, saved: dict | None) -> list[tuple[str, str]]:
        """(key, message) for each way these settings differ from the adapters a checkpoint holds (its model meta's
        `lora`: lora_r, lora_alpha, lora_target_modules; None: a checkpoint without adapters, which any setting may
        start from). Loading such adapters into other layers would fail, or with another alpha silently scale them
        wrong."""
        if not saved:
            return []
        held = f"r = {saved['lora_r']}, alpha = {saved['lora_alpha']:g} on {saved['lora_target_modules']}"
        if not self.lora:
            return [("lora_target_modules", f"is not set, but the checkpoint holds LoRA adapters ({held}): set the "
                     "adapters' keys to train them, or export it merged (mindrl-convert mcore2hf, then hf2mcore) "
                     "to train the whole model")]  # fmt: skip
        out = []
        if set(self.lora_target_modules) != set(saved["lora_target_modules"]):
            out.append(("lora_target_modules", f"is {list(self.lora_target_modules)}, but the checkpoint's adapters "
                        f"are on {saved['lora_target_modules']}"))  # fmt: skip
        if self.lora_r != saved["lora_r"]:
            out.append(("lora_r", f"is {self.lora_r}, but the checkpoint's adapters have rank {saved['lora_r']}"))
        if float(self.lora_alpha) != float(saved["lora_alpha"]):
            out.append(("lora_alpha", f"is {self.lora_alpha:g}, but the checkpoint's adapters were trained with "
                        f"{saved['lora_alpha']:g} (their scale is alpha / r)"))  # fmt: skip
        return out

    @property
    def lora(self) -> bool:
        """Whether the model trains through adapters."""
        return bool(self.lora_target_modules)


@dataclass
class SamplingSettings:
    """How to sample, in the keys of MindSpeed-RL's `generate_config.sampling_config` (plus `stop`,
    `stop_token_ids`, `ignore_eos`); `SamplingSection` extends it with MindSpeed-RL's defaults."""

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
    stop: list[str] = field(default_factory=list)
    """Stop strings (need a tokenizer). The response ends with the token that completed the string."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response (in addition to the model's EOS); the stop token is kept."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS (benchmarks: fixed-length responses)."""

    def sampling_settings(self) -> dict[str, Any]:
        """The SamplingSettings keys and their values (of a class that extends it)."""
        return {f.name: getattr(self, f.name) for f in fields(SamplingSettings)}


@dataclass
class SamplingConfig(SamplingSettings):
    """What an engine samples: `SamplingSettings` for `n` samples per prompt. Validated at construction; engines
    trust it."""

    n: int = 1
    """Samples per prompt."""

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
class EngineSettings:
    """The rollout engine's knobs that generate_config names too (same keys); `GenerateConfig` extends it with
    MindSpeed-RL's defaults, `RolloutConfig` with what an engine needs besides."""

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
    """No graph capture/compilation (fast start; capture pays off only on accelerators). On CPU `false` lets
    vLLM-CPU compile the model with inductor, which needs a C++ compiler at run time (docs/performance.md)."""
    enable_prefix_caching: bool = False
    """Reuse KV blocks of shared prompt prefixes (reset after every load_weights)."""
    sleep_level: int = 1
    """vLLM sleep level where the platform has sleep mode: 1 offloads weights to host and drops the KV cache,
    2 drops both (weights must be reloaded after wake, which the hybrid engine does anyway)."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills over engine steps. None: the platform's default (off where seeded requests cannot
    survive a split prefill, i.e. on CPU; then max_num_batched_tokens is raised to max_model_len)."""

    def engine_settings(self) -> dict[str, Any]:
        """The EngineSettings keys and their values (of a class that extends it)."""
        return {f.name: getattr(self, f.name) for f in fields(EngineSettings)}


@dataclass
class RolloutConfig(EngineSettings):
    """The engine's settings: `EngineSettings` plus what an in-process engine needs. Validated at construction."""

    model: str = field(kw_only=True)
    """HF model directory: config (and tokenizer, if present). Weights come from it only with load_format='auto'."""
    load_format: str = "dummy"
    """'dummy': random weights, real ones arrive through load_weights (hybrid engine). 'auto': read the dir."""
    seed: int = 1234
    """Engine RNG seed. The effective seed is seed + the engine's data-parallel index, so TP peers sample
    identically and DP replicas sample different streams."""
    kv_cache_memory_bytes: int | None = None
    """Explicit KV cache size. None: the platform default (a fixed size on CPU, else gpu_memory_utilization)."""
    tokenizer: str | None = None
    """Tokenizer dir; None: the model dir."""
    load_tokenizer: bool | None = None
    """None: load a tokenizer if the dir has one. False: token ids only (detokenize/stop strings unavailable)."""

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
