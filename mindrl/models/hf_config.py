"""HF config -> a validated `ModelSpec` -> megatron `TransformerConfig`, for Qwen2 / Qwen2.5, Llama, Qwen3 (dense),
Qwen3-MoE and DeepSeek-V3 / R1 causal LMs or one-label `*ForSequenceClassification`; anything else fails here, naming
the field, before any start."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# architecture -> (family, is a sequence-classification / value model)
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen2ForSequenceClassification": ("qwen2", True),
    "LlamaForCausalLM": ("llama", False),
    "LlamaForSequenceClassification": ("llama", True),
    "Qwen3ForCausalLM": ("qwen3", False),
    "Qwen3ForSequenceClassification": ("qwen3", True),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False),
    "DeepseekV3ForCausalLM": ("deepseek_v3", False),
}
MOE_FAMILIES = ("qwen3_moe", "deepseek_v3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# Llama-3.1 scaling constants that megatron's `rope_scaling=True` hard-codes.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class ModelConfigError(ValueError):
    """An HF config mindrl cannot build, or a parallel layout that does not fit the model."""


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    name = str(name).replace("torch.", "")
    if name not in _DTYPES:
        raise ModelConfigError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelSpec:
    """Everything mindrl needs from an HF config, in megatron terms."""

    architecture: str
    family: str
    is_value_model: bool
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    dtype: str
    rope_scaling_factor: float | None = None  # Llama-3.1 style scaling, None = plain RoPE
    qk_layernorm: bool = False  # RMSNorm over each query / key head before RoPE (Qwen3)
    # Mixture of experts (0 experts: a dense model). A MoE layer routes each token to `moe_router_topk` of
    # `num_experts` SwiGLU experts of width `moe_ffn_hidden_size`; the others are dense MLPs of `ffn_hidden_size`.
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to 1
    moe_aux_loss_coeff: float = 0.0  # the load-balancing loss's weight in training
    moe_layers: tuple[int, ...] = ()  # the global indices of the MoE layers
    # DeepSeek-V3's router: sigmoid scores, the choice made on score + a per-expert bias (the checkpoint's
    # e_score_correction_bias) within the `moe_group_topk` best of `moe_num_groups` expert groups, the chosen scores
    # renormalised and multiplied by `moe_routed_scaling_factor`; its MoE layers add a shared expert of
    # `moe_shared_expert_ffn` that every token runs through.
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False
    moe_num_groups: int = 0
    moe_group_topk: int = 0
    moe_routed_scaling_factor: float = 1.0
    moe_shared_expert_ffn: int = 0
    # Multi-head latent attention (DeepSeek-V3; kv_lora_rank 0: not MLA). Queries through a rank-q_lora_rank
    # bottleneck (0: one projection), keys and values from one kv_lora_rank latent per token plus one shared rope key;
    # each head's query / key is qk_nope_head_dim + qk_rope_head_dim wide, its value v_head_dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # YaRN RoPE (factor 0: none), as megatron's MLA builds it.
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---------------------------------------------------------------------------------- loading
    @classmethod
    def from_hf_dir(cls, hf_dir: str) -> ModelSpec:
        path = os.path.join(hf_dir, "config.json")
        if not os.path.isdir(hf_dir):
            raise ModelConfigError(f"HF model directory {hf_dir!r} does not exist")
        if not os.path.isfile(path):
            raise ModelConfigError(f"{hf_dir!r} has no config.json: is it an HF checkpoint directory?")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        return cls.from_hf_config(cfg, source=path)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config") -> ModelSpec:
        archs = cfg.get("architectures") or []
        if len(archs) != 1:
            raise ModelConfigError(f"{source}: 'architectures' must name exactly one class, got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"{source}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family, is_value = SUPPORTED_ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ModelConfigError(f"{source}: required field {key!r} is missing")
            return cfg[key]

        def reject(key: str, ok) -> None:
            if key in cfg and cfg[key] is not None and not ok(cfg[key]):
                raise ModelConfigError(f"{source}: {key}={cfg[key]!r} is not supported")

        reject("hidden_act", lambda v: v == "silu")
        reject("use_sliding_window", lambda v: v is False)
        reject("attention_bias", lambda v: v is False)  # Llama: biases on q/k/v/o
        reject("mlp_bias", lambda v: v is False)
        reject("quantization_config", lambda v: False)
        reject("qk_layernorm", lambda v: v is False)
        # Qwen3 configs list each layer's attention kind; mindrl builds full attention only.
        reject("layer_types", lambda v: all(t == "full_attention" for t in v))
        if is_value:
            labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
            if labels != 1:
                raise ModelConfigError(f"{source}: a reward/critic model needs num_labels=1, got {labels}")

        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_factor, yarn = None, {}
        if rope_type == "llama3":
            mismatch = {k: rope.get(k) for k, v in _LLAMA3_ROPE.items() if float(rope.get(k, -1)) != v}
            if mismatch:
                raise ModelConfigError(
                    f"{source}: rope_scaling llama3 with {mismatch} is not supported (need {_LLAMA3_ROPE})"
                )
            rope_factor = float(rope["factor"])
        elif rope_type == "yarn" and family == "deepseek_v3":
            yarn = _yarn_fields(rope, source)
        elif rope_type != "default":
            raise ModelConfigError(f"{source}: rope scaling type {rope_type!r} is not supported")

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        mla = _mla_fields(cfg, source) if family == "deepseek_v3" else {}
        if mla:  # a query / key head: its nope and rope parts (HF's head_dim names the rope part only)
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        if heads % kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")
        torch_dtype(dtype)
        num_layers = int(need("num_hidden_layers"))
        moe = {}
        if family == "qwen3_moe":
            moe = _moe_fields(cfg, num_layers, source)
        elif family == "deepseek_v3":
            moe = _deepseek_moe_fields(cfg, num_layers, source)
        return cls(
            architecture=arch,
            family=family,
            is_value_model=is_value,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            ffn_hidden_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=float(rope_theta),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            dtype=dtype,
            rope_scaling_factor=rope_factor,
            qk_layernorm=family in ("qwen3", "qwen3_moe"),
            hf_config=dict(cfg),
            **moe,
            **mla,
            **yarn,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        d["moe_layers"] = tuple(d.get("moe_layers", ()))  # a list once through JSON
        return cls(**d)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def moe_layer_pattern(self) -> list[int]:
        """megatron's `moe_layer_freq` as a list: 1 for a MoE layer, 0 for a dense one, per global layer."""
        return [int(i in self.moe_layers) for i in range(self.num_layers)]

    # ---------------------------------------------------------------------------------- layouts
    def validate_layout(self, tp: int, pp: int, ep: int = 1, uneven_pp: bool = False) -> None:
        """Raise a ModelConfigError naming every dimension that TP / PP / EP does not divide (PP: unless the stages
        are given their own layer counts, `uneven_pp`)."""
        if tp < 1 or pp < 1 or ep < 1:
            raise ModelConfigError(f"TP, PP and EP must be >= 1, got TP={tp} PP={pp} EP={ep}")
        problems = []
        if ep > 1 and not self.is_moe:
            problems.append(f"EP={ep} needs a mixture-of-experts model")
        elif self.num_experts % ep:
            problems.append(f"EP={ep} does not divide num_experts={self.num_experts}")
        for what, n in (
            (
                ("num_attention_heads", self.num_heads),
                ("num_key_value_heads", self.num_kv_heads),
                ("intermediate_size (ffn)", self.ffn_hidden_size),
                ("vocab_size", self.vocab_size),
            )
            + ((("moe_intermediate_size (expert ffn)", self.moe_ffn_hidden_size),) if self.is_moe else ())
            + (
                (("shared expert ffn (moe_intermediate_size x n_shared_experts)", self.moe_shared_expert_ffn),)
                if self.moe_shared_expert_ffn
                else ()
            )
            + ((("q_lora_rank", self.q_lora_rank),) if self.q_lora_rank else ())
            + ((("kv_lora_rank + qk_rope_head_dim", self.kv_lora_rank + self.qk_rope_head_dim),) if self.is_mla else ())
        ):
            if n % tp:
                problems.append(f"TP={tp} does not divide {what}={n}")
        if self.num_layers % pp and not uneven_pp:
            problems.append(f"PP={pp} does not divide num_hidden_layers={self.num_layers}")
        if problems:
            raise ModelConfigError(f"{self.architecture}: " + "; ".join(problems))

    def transformer_config(
        self,
        tp: int = 1,
        pp: int = 1,
        dtype: str | torch.dtype | None = None,
        sequence_parallel: bool = False,
        use_cpu_initialization: bool = True,
        perform_initialization: bool = True,
        **overrides: Any,
    ):
        """The megatron TransformerConfig for this model at TP x PP (dtype defaults to the checkpoint's)."""
        from megatron.core.transformer import TransformerConfig

        self.validate_layout(tp, pp, uneven_pp=overrides.get("pipeline_model_parallel_layout") is not None)
        params_dtype = torch_dtype(dtype or self.dtype)
        kwargs = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_heads,
            num_query_groups=self.num_kv_heads,
            kv_channels=self.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=self.norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_layernorm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            attention_softmax_in_fp32=True,
            apply_query_key_layer_scaling=False,
            # Fused SwiGLU (keeps only its input for backward). models.builder decides per platform: mindrl's eager
            # module on CPU (use_te_activation_func), this flag (megatron's compiled function) elsewhere.
            bias_activation_fusion=True,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            sequence_parallel=sequence_parallel and tp > 1,
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            use_cpu_initialization=use_cpu_initialization,
            perform_initialization=perform_initialization,
            init_method_std=float(self.hf_config.get("initializer_range", 0.02)),
            cuda_graph_scope=[],  # megatron's own default ("full") is deprecated and warns on every build
        )
        if self.is_moe:
            kwargs.update(self._moe_config())
            if self.moe_score_function == "sigmoid" and params_dtype.itemsize < 4:
                kwargs["moe_router_dtype"] = "fp32"
        if self.is_mla:
            from megatron.core.transformer.transformer_config import MLATransformerConfig

            kwargs.update(self._mla_config())
            kwargs.update(overrides)
            # megatron's MLA applies its RoPE itself (interleaved pairs, YaRN's mscale), unfused: its fused form
            # needs Transformer Engine's kernel, and a rotate-half fusion would skip the de-interleave.
            kwargs["apply_rope_fusion"] = False
            return MLATransformerConfig(**kwargs)
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def _mla_config(self) -> dict[str, Any]:
        """megatron's MLA fields. Its rope takes each head's rope part as interleaved pairs, as DeepSeek's checkpoints
        (rope_interleave) lay it out; kv_channels (the core attention's per-head output) is the value head."""
        yarn = self.yarn_factor > 0
        return dict(
            q_lora_rank=self.q_lora_rank or None,
            kv_lora_rank=self.kv_lora_rank,
            qk_head_dim=self.qk_nope_head_dim,
            qk_pos_emb_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            kv_channels=self.v_head_dim,
            qk_layernorm=True,  # the latent RMSNorms (q_a_layernorm, kv_a_layernorm)
            rope_type="yarn" if yarn else "rope",
            rotary_base=self.rope_theta,
            rotary_scaling_factor=self.yarn_factor if yarn else 1.0,
            original_max_position_embeddings=self.yarn_original_max_position_embeddings or self.max_position_embeddings,
            beta_fast=self.yarn_beta_fast,
            beta_slow=self.yarn_beta_slow,
            mscale=self.yarn_mscale,
            mscale_all_dim=self.yarn_mscale_all_dim,
        )

    def _moe_config(self) -> dict[str, Any]:
        """megatron's MoE fields. HF's Qwen3-MoE router takes the softmax over all experts, then the top k, then
        (norm_topk_prob) divides them by their sum: that is a softmax over the top-k logits, megatron's default
        order (moe_router_pre_softmax=False); without renormalisation it is megatron's pre-softmax order."""
        config = dict(
            num_moe_experts=self.num_experts,
            moe_router_topk=self.moe_router_topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not self.norm_topk_prob,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=self.moe_aux_loss_coeff,
            moe_layer_freq=self.moe_layer_pattern(),
            # alltoall and allgather both run on gloo; alltoall is what the accelerators use at EP > 1.
            moe_token_dispatcher_type="alltoall",
            # Per-expert linears (SequentialMLP): the grouped GEMM needs a device kernel.
            moe_grouped_gemm=False,
            add_bias_linear=False,
        )
        if self.moe_score_function == "sigmoid":
            config.update(self._sigmoid_router_config())
        return config

    def _sigmoid_router_config(self) -> dict[str, Any]:
        """DeepSeek-V3's router in megatron's terms. megatron renormalises a sigmoid router's top-k scores whenever
        k > 1 (the loader requires norm_topk_prob there) and ranks a group by the sum of its top k / group_topk scores
        (the loader requires HF's top 2). The bias only steers the choice; megatron moves it by the tokens each
        expert received at moe_router_bias_update_rate per step, 0 here: the checkpoint's bias stays (the trainer
        passes the config's rate). Router logits in fp32 as transformers computes them (fp64 models keep fp64)."""
        return dict(
            moe_router_score_function="sigmoid",
            moe_router_pre_softmax=False,
            moe_router_enable_expert_bias=self.moe_expert_bias,
            moe_router_bias_update_rate=0.0,
            moe_router_num_groups=self.moe_num_groups or None,
            moe_router_group_topk=self.moe_group_topk or None,
            moe_router_topk_scaling_factor=self.moe_routed_scaling_factor,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_ffn or None,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )


def _moe_fields(cfg: dict[str, Any], num_layers: int, source: str) -> dict[str, Any]:
    """A Qwen3-MoE config's MoE fields. Layer i is sparse when it is not in `mlp_only_layers` and (i + 1) is a
    multiple of `decoder_sparse_step`, as transformers builds it."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    problems = []
    if not isinstance(experts, int) or experts < 1:
        problems.append(f"num_experts={experts!r} must be a positive integer")
    topk = cfg.get("num_experts_per_tok")
    if not isinstance(topk, int) or not 1 <= topk <= (experts if isinstance(experts, int) else topk):
        problems.append(f"num_experts_per_tok={topk!r} must be an integer in 1..num_experts")
    width = cfg.get("moe_intermediate_size")
    if not isinstance(width, int) or width < 1:
        problems.append(f"moe_intermediate_size={width!r} must be a positive integer")
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        problems.append(f"decoder_sparse_step={step!r} must be a positive integer")
    dense = cfg.get("mlp_only_layers") or []
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        problems.append(f"mlp_only_layers holds {bad}, not layer indices in 0..{num_layers - 1}")
    if cfg.get("shared_expert_intermediate_size"):
        problems.append("shared experts (shared_expert_intermediate_size) are not supported")
    if problems:
        raise ModelConfigError(f"{source}: " + "; ".join(problems))
    moe_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if not moe_layers:
        raise ModelConfigError(f"{source}: no MoE layer left (mlp_only_layers={dense}, decoder_sparse_step={step})")
    return dict(
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=width,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)),
        moe_layers=moe_layers,
    )


def _deepseek_moe_fields(cfg: dict[str, Any], num_layers: int, source: str) -> dict[str, Any]:
    """A DeepSeek-V3 config's MoE fields: layers from first_k_dense_replace on hold n_routed_experts experts and
    n_shared_experts shared ones, routed by the sigmoid router with its correction bias and group-limited top-k."""
    problems = []

    def positive(key: str, default=None) -> int:
        v = cfg.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            problems.append(f"{key}={v!r} must be a positive integer")
            return 1
        return v

    experts = positive("n_routed_experts")
    topk = positive("num_experts_per_tok")
    width = positive("moe_intermediate_size")
    shared = cfg.get("n_shared_experts") or 0
    if not isinstance(shared, int) or shared < 0:
        problems.append(f"n_shared_experts={shared!r} must be a non-negative integer")
        shared = 0
    groups, group_topk = positive("n_group", 1), positive("topk_group", 1)
    first_dense = cfg.get("first_k_dense_replace") or 0
    if not isinstance(first_dense, int) or not 0 <= first_dense < num_layers:
        problems.append(f"first_k_dense_replace={first_dense!r} must leave a MoE layer in 0..{num_layers - 1}")
        first_dense = 0
    if topk > experts:
        problems.append(f"num_experts_per_tok={topk} exceeds n_routed_experts={experts}")
    if experts % groups:
        problems.append(f"n_group={groups} does not divide n_routed_experts={experts}")
    elif group_topk > groups:
        problems.append(f"topk_group={group_topk} exceeds n_group={groups}")
    elif groups > 1 and (topk % group_topk or topk // group_topk != 2 or experts // groups < 2):
        # transformers ranks a group by its best two scores, megatron by its best num_experts_per_tok / topk_group
        problems.append(
            f"num_experts_per_tok={topk} / topk_group={group_topk} must be 2 (transformers ranks each group by its "
            "two best scores, megatron by its best num_experts_per_tok / topk_group)"
        )
    elif groups > 1 and group_topk * experts // groups < topk:
        problems.append(f"topk_group={group_topk} groups of {experts // groups} experts hold fewer than {topk}")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={cfg.get('scoring_func')!r} is not supported (DeepSeek-V3's is sigmoid)")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method={cfg.get('topk_method')!r} is not supported (DeepSeek-V3's is noaux_tc)")
    if cfg.get("moe_layer_freq", 1) != 1:
        problems.append(
            f"moe_layer_freq={cfg.get('moe_layer_freq')!r} is not supported (1: every layer after the dense ones)"
        )
    norm = cfg.get("norm_topk_prob", True)
    if topk > 1 and not norm:
        problems.append(
            "norm_topk_prob=false with num_experts_per_tok > 1: megatron's sigmoid router always renormalises"
        )
    if problems:
        raise ModelConfigError(f"{source}: " + "; ".join(problems))
    return dict(
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=width,
        norm_topk_prob=bool(norm),
        moe_aux_loss_coeff=0.0,
        moe_layers=tuple(range(first_dense, num_layers)),
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_num_groups=groups if groups > 1 else 0,
        moe_group_topk=group_topk if groups > 1 else 0,
        moe_routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        moe_shared_expert_ffn=width * shared,
    )


def _mla_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """A DeepSeek-V3 config's multi-head latent attention."""
    problems = []
    out = {}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        v = cfg.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            problems.append(f"{key}={v!r} must be a positive integer")
        out[key] = v
    q_rank = cfg.get("q_lora_rank")
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank < 1):
        problems.append(f"q_lora_rank={q_rank!r} must be a positive integer or null (one query projection)")
    if isinstance(out["qk_rope_head_dim"], int) and out["qk_rope_head_dim"] % 2:
        problems.append(f"qk_rope_head_dim={out['qk_rope_head_dim']} must be even (RoPE rotates pairs)")
    heads = cfg.get("num_attention_heads")
    if cfg.get("num_key_value_heads", heads) != heads:
        problems.append(f"num_key_value_heads={cfg.get('num_key_value_heads')!r} must equal num_attention_heads={heads}: "
                        "MLA expands one key / value per query head")  # fmt: skip
    if cfg.get("rope_interleave", True) is not True:
        problems.append(
            "rope_interleave=false is not supported: megatron's MLA takes the rope dims as interleaved pairs"
        )
    if problems:
        raise ModelConfigError(f"{source}: " + "; ".join(problems))
    return dict(q_lora_rank=q_rank or 0, **out)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_fields(rope: dict[str, Any], source: str) -> dict[str, Any]:
    """HF's YaRN rope parameters as megatron's MLA takes them. transformers scales cos / sin by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else by mscale(factor); megatron by the
    same ratio of its mscale and mscale_all_dim (1 and 0 by default: mscale(factor)); both scale the softmax by
    mscale(factor, mscale_all_dim)^2."""
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    problems = []
    if not isinstance(factor, (int, float)) or factor < 1:
        problems.append(f"rope_scaling.factor={factor!r} must be a number >= 1")
    if not isinstance(original, int) or original < 1:
        problems.append(f"rope_scaling.original_max_position_embeddings={original!r} must be a positive integer")
    if rope.get("truncate", True) is not True:
        problems.append("rope_scaling.truncate=false is not supported (megatron rounds YaRN's correction range)")
    if problems:
        raise ModelConfigError(f"{source}: " + "; ".join(problems))
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and all_dim:
        m, m_all = float(mscale), float(all_dim)
    elif all_dim:  # transformers: mscale(factor) on cos / sin, megatron cannot split it so
        raise ModelConfigError(f"{source}: rope_scaling.mscale_all_dim={all_dim} without mscale is not supported")
    else:
        m, m_all = 1.0, 0.0
    want = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
    given = rope.get("attention_factor")
    if given is not None and not math.isclose(float(given), want, rel_tol=1e-12):
        raise ModelConfigError(
            f"{source}: rope_scaling.attention_factor={given} is not supported (megatron's YaRN scales by {want:.6g})"
        )
    return dict(
        yarn_factor=float(factor),
        yarn_original_max_position_embeddings=int(original),
        yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
        yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        yarn_mscale=m,
        yarn_mscale_all_dim=m_all,
    )
