"""`generate_config` (+ `sampling_config`): the rollout engine and how it samples, with helpers that build
the engine's `mindrl.rollout` configs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from mindrl.config.errors import Collector
from mindrl.config.section import Section, ignored_field
from mindrl.config.settings import DTYPES, EngineSettings, RolloutConfig, SamplingConfig, SamplingSettings

ROLLOUT_MODES = ("integrated", "server")
WEIGHT_TRANSFERS = ("auto", "http", "dist")


@dataclass
class SamplingSection(Section, SamplingSettings):
    """MindSpeed-RL's generate_config.sampling_config: `SamplingSettings` with MindSpeed-RL's vLLM engine defaults.
    The samples per prompt come from rl_config.n_samples_per_prompt."""

    SECTION: ClassVar[str] = "generate_config.sampling_config"

    logprobs: int = 1
    """MindSpeed-RL: whether vLLM returns logprobs. mindrl always returns each sampled token's logprob, so this
    only has to be >= 0; no top-k alternatives are requested."""
    top_k: int = 50
    """Sample among the k most likely tokens; -1 disables (MindSpeed-RL's default: 50)."""
    temperature: float = 0.2
    """Softmax temperature (MindSpeed-RL's default: 0.2; RL configs use 1.0); 0 is greedy."""

    def validate(self, col: Collector) -> None:
        if self.logprobs < 0:
            col.add("logprobs", f"must be >= 0, got {self.logprobs}")
        if self.max_tokens < 1:
            col.add("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            col.add("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            col.add("top_k", f"must be -1 or 0 (off) or a positive number of tokens, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            col.add("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.temperature < 0:
            col.add("temperature", f"must be >= 0 (0: greedy), got {self.temperature}")
        if any(not s for s in self.stop):
            col.add("stop", "stop strings must be non-empty")
        if self.stop and not self.detokenize:
            col.add("stop", "stop strings are matched in the response text: set detokenize: true with them")
        if any(t < 0 for t in self.stop_token_ids):
            col.add("stop_token_ids", f"token ids must be >= 0, got {self.stop_token_ids}")


@dataclass
class GenerateConfig(Section, EngineSettings):
    """The rollout engine (vLLM) in MindSpeed-RL's keys (those an engine takes as they are: `EngineSettings`),
    plus mindrl's rollout_mode, kv_cache_memory_gib, bucket_size_mb, sleep_level and enable_chunked_prefill."""

    SECTION: ClassVar[str] = "generate_config"
    IGNORED: ClassVar[dict[str, str]] = {
        "num_scheduler_steps": "vLLM's multi-step scheduling no longer exists (vLLM V1 schedules every step)",
        "torchair_graph": "an Ascend graph-capture mode of vLLM-Ascend (a performance switch)",
        "ascend_scheduler_config_enabled": "a vLLM-Ascend scheduler switch (a performance switch)",
        "data_parallel_size": "derived, as MindSpeed-RL derives it (overwriting a written value): "
        "actor_resource.num_npus / infer_tensor_parallel_size",
        "limit_mm_image_per_prompt": "a multimodal option; mindrl is text-only",
        "limit_mm_video_per_prompt": "a multimodal option; mindrl is text-only",
        "eplb_token_collects": "collects the engines' per-expert token counts for EPLB, which places experts over "
        "engines; mindrl's engines each hold every expert (infer_expert_parallel_size 1); the update logs its "
        "per-expert load (actor/moe_expert_load_*)",
        "eplb_token_save_path": "where EPLB's token counts go (eplb_token_collects)",
        "expert_map_path": "EPLB's placement of experts (redundant ones included) over vLLM's expert-parallel "
        "engines; mindrl's engines each hold every expert (infer_expert_parallel_size > 1 is refused at start), so "
        "there is nothing to place",
    }
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {}

    infer_tensor_parallel_size: int = 8
    """Rollout tensor parallelism (MindSpeed-RL's default: 8); must divide the device count."""
    infer_pipeline_parallel_size: int = 1
    """Must be 1 (vLLM pipeline parallelism is not supported, as in MindSpeed-RL)."""
    enable_expert_parallel: bool = False
    """vLLM's expert parallelism for a MoE model (with infer_expert_parallel_size > 1): each rollout device holds
    num_experts / (infer TP x infer_expert_parallel_size) whole experts instead of every expert split over infer
    TP."""
    infer_expert_parallel_size: int = 1
    """vLLM's data-parallel size (MindSpeed-RL's VLLM_DP_SIZE): that many engines of infer TP devices share one
    copy of the experts, expert parallel over infer TP x infer_expert_parallel_size devices; needs
    enable_expert_parallel. mindrl-plan sizes the rollout with it; mindrl-train runs every engine with all its
    experts (1) and refuses more at start (docs/moe.md)."""
    tokenizer_name_or_path: str | None = None
    """Tokenizer of the engine; None: megatron_training.tokenizer_name_or_path (resolved at load)."""
    trust_remote_code: bool = ignored_field(
        False, "mindrl's Qwen2/Llama/Qwen3 models and tokenizers need no remote code"
    )
    """Accepted for compatibility; mindrl's Qwen2/Llama/Qwen3 models need no remote code, so it has no effect."""
    max_num_seqs: int = 1
    """Most sequences decoded at once per engine (MindSpeed-RL's default: 1; set it to the batch)."""
    max_num_batched_tokens: int = 2048
    """Most tokens in one engine step."""
    offload_train_optimizer: bool = False
    """Move the optimizer state to host memory during rollout."""
    offload_train_grad: bool = False
    """Move the gradient buffers to host memory during rollout."""
    offload_train_param: bool = False
    """Move the training weights to host memory during rollout."""
    rollout_mode: str = "integrated"
    """Where rollout runs (mindrl addition): 'integrated' (the engine inside the actor's processes) or 'server'
    (mindrl-rollout-server processes at server_urls; the actor pushes its weights to them every iteration; not with
    rl_config.async_mode bounded, whose samplers generate)."""
    server_urls: list[str] = field(default_factory=list)
    """rollout_mode 'server': the rollout servers' base URLs, e.g. http://10.0.0.5:8000; the prompts are split
    over them (mindrl addition)."""
    server_timeout: float = 300.0
    """rollout_mode 'server': seconds to wait for a server that does not answer (at start, and after a failure
    mid-run) before the run stops; also the longest one request may take (mindrl addition)."""
    server_token_file: str | None = None
    """rollout_mode 'server': a file holding the servers' token (their --token-file); None: no token (mindrl
    addition)."""
    weight_transfer: str = "auto"
    """rollout_mode 'server': how weights reach the servers (mindrl addition): 'http' (safetensors bodies), 'dist'
    (a torch.distributed group per server, the platform's backend; bucket metadata over HTTP) or 'auto' (the
    platform's measured fastest: dist; docs/rollout_server.md)."""
    kv_cache_memory_gib: float | None = None
    """Explicit KV-cache size per engine in GiB, e.g. on CPU; None: the platform default (mindrl addition)."""
    bucket_size_mb: float = 512.0
    """Resharding bucket: MiB of weights streamed into the engine at a time (mindrl addition)."""
    sampling_config: SamplingSection = field(default_factory=SamplingSection)
    """How responses are sampled."""

    def validate(self, col: Collector) -> None:
        for key in ("infer_tensor_parallel_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, key) < 1:
                col.add(key, f"must be >= 1, got {getattr(self, key)}")
        if self.infer_pipeline_parallel_size != 1:
            col.add("infer_pipeline_parallel_size", "must be 1: vLLM pipeline parallelism is not supported")
        if self.infer_expert_parallel_size < 1:
            col.add("infer_expert_parallel_size", f"must be >= 1, got {self.infer_expert_parallel_size}")
        elif self.infer_expert_parallel_size > 1 and not self.enable_expert_parallel:
            col.add("infer_expert_parallel_size", f"{self.infer_expert_parallel_size} needs enable_expert_parallel: "
                    "true (vLLM splits experts only then)")  # fmt: skip
        if self.dtype not in DTYPES:
            col.add("dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            col.add("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.rollout_mode not in ROLLOUT_MODES:
            col.add("rollout_mode", f"{self.rollout_mode!r} is not one of {', '.join(ROLLOUT_MODES)}")
        self._validate_server(col)
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            col.add("kv_cache_memory_gib", f"must be > 0 (or null), got {self.kv_cache_memory_gib}")
        if self.bucket_size_mb <= 0:
            col.add("bucket_size_mb", f"must be > 0, got {self.bucket_size_mb}")
        if self.sleep_level not in (1, 2):
            col.add("sleep_level", f"must be 1 or 2, got {self.sleep_level}")

    def _validate_server(self, col: Collector) -> None:
        from urllib.parse import urlsplit

        if self.rollout_mode == "server" and not self.server_urls:
            col.add("server_urls", "rollout_mode 'server' needs at least one rollout server URL, e.g. "
                    "server_urls: [http://127.0.0.1:8000] (start one with mindrl-rollout-server --model HF_DIR)")  # fmt: skip
        seen = set()
        for i, url in enumerate(self.server_urls):
            try:
                parts = urlsplit(url)
                port = parts.port
            except ValueError as e:
                col.add(f"server_urls[{i}]", f"{url!r} is not a URL: {e}")
                continue
            if parts.scheme not in ("http", "https") or not parts.hostname:
                col.add(f"server_urls[{i}]", f"{url!r} must look like http://HOST:PORT")
            elif port is None:
                col.add(f"server_urls[{i}]", f"{url!r} names no port (mindrl-rollout-server's default is 8000)")
            elif parts.path.strip("/") or parts.query:
                col.add(f"server_urls[{i}]", f"{url!r} must be the server's base URL, without a path")
            key = url.rstrip("/")
            if key in seen:
                col.add(f"server_urls[{i}]", f"{url!r} is listed twice")
            seen.add(key)
        if self.weight_transfer not in WEIGHT_TRANSFERS:
            col.add("weight_transfer", f"{self.weight_transfer!r} is not one of {', '.join(WEIGHT_TRANSFERS)}")
        if not self.server_timeout > 0:
            col.add("server_timeout", f"must be > 0 seconds, got {self.server_timeout}")
        if self.server_token_file is not None and not self.server_token_file:
            col.add("server_token_file", "must be a file path or null")

    # -- builders for mindrl.rollout -----------------------------------------------------------------
    def sampling(self, n: int) -> SamplingConfig:
        """The engine's SamplingConfig for `n` samples per prompt."""
        return SamplingConfig(**{**self.sampling_config.sampling_settings(), "logprobs": 0}, n=n)

    def rollout_config(self, model_dir: str, seed: int) -> RolloutConfig:
        """The engine's RolloutConfig: HF config from `model_dir`, dummy weights (the trainer streams the
        actor's in), engine seed `seed`."""
        kv = None if self.kv_cache_memory_gib is None else int(self.kv_cache_memory_gib * 2**30)
        return RolloutConfig(
            **self.engine_settings(),
            model=model_dir,
            load_format="dummy",
            seed=seed,
            kv_cache_memory_bytes=kv,
            tokenizer=self.tokenizer_name_or_path,
        )
