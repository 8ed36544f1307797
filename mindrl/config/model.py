"""`model`: the network architecture, from configs/model/NAME.yaml (MindSpeed-RL's model files, whose single
top-level key is NAME), plus any architecture keys written in megatron_training or a role section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mindrl.config.errors import Collector
from mindrl.config.section import Section

SUPPORTED_ROPE_SCALING = (None, "llama3", "yarn")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
"""moe_router_load_balancing_type values: megatron-core's router losses (sinkhorn routing is not built)."""


@dataclass
class ModelArchConfig(Section):
    """A Qwen2 / Llama / Qwen3-style decoder in megatron's argument names (MindSpeed-RL's model YAML keys).

    mindrl builds the model from the checkpoint's HF config; this section is what the layout checks, the
    planner and the checkpoint cross-check (when paths are checked) use, so it must describe the same network.
    """

    SECTION: ClassVar[str] = "model"

    name: str = ""
    """The model's name: the top-level key of configs/model/NAME.yaml (set by the loader)."""
    num_layers: int | None = None
    """Transformer layers (required)."""
    hidden_size: int | None = None
    """Hidden (embedding) size (required)."""
    ffn_hidden_size: int | None = None
    """MLP intermediate size; None means 4 * hidden_size (megatron's default)."""
    num_attention_heads: int | None = None
    """Query heads (required)."""
    kv_channels: int | None = None
    """Head dimension; None means hidden_size / num_attention_heads."""
    group_query_attention: bool = False
    """Grouped-query attention: num_query_groups key/value heads instead of one per query head."""
    num_query_groups: int = 1
    """Key/value heads when group_query_attention is true (ignored otherwise, as in megatron)."""
    padded_vocab_size: int | None = None
    """Vocabulary rows of the embedding and output layer (the HF config's vocab_size). None: megatron's, derived from
    the tokenizer with make_vocab_size_divisible_by."""
    make_vocab_size_divisible_by: int = 128
    """With padded_vocab_size unset, the vocabulary rows are megatron's: the tokenizer's size padded up to a multiple
    of this x the role's tensor_model_parallel_size (`vocab_rows`). mindrl builds a checkpoint's own rows and does
    not re-pad one, so the checkpoint must have exactly that many (checked at load). Unused with padded_vocab_size."""
    max_position_embeddings: int | None = None
    """Longest sequence the model supports; generate_config.max_model_len may not exceed it."""
    rotary_base: float = 10000.0
    """RoPE theta (Qwen2.5: 1e6)."""
    rope_scaling_type: str | None = None
    """RoPE scaling: None, 'llama3' (Llama-3.1) or 'yarn' (DeepSeek-V3, with multi_latent_attention); MindSpeed-RL's
    'linear' is not supported."""
    rope_scaling_factor: float = 1.0
    """RoPE scaling factor (with rope_scaling_type)."""
    low_freq_factor: float | None = None
    """Llama-3 RoPE scaling: low-frequency factor."""
    high_freq_factor: float | None = None
    """Llama-3 RoPE scaling: high-frequency factor."""
    original_max_position_embeddings: int | None = None
    """Llama-3 RoPE scaling: the context length before scaling."""
    beta_fast: float = 32.0
    """YaRN: the rotation count above which dimensions keep their frequency."""
    beta_slow: float = 1.0
    """YaRN: the rotation count below which dimensions are interpolated by rope_scaling_factor."""
    rope_scaling_mscale: float = 1.0
    """YaRN: mscale, the numerator's weight of the cos / sin scale."""
    rope_scaling_mscale_all_dim: float = 0.0
    """YaRN: mscale_all_dim, the denominator's weight of the cos / sin scale and the softmax scale's."""
    rope_scaling_original_max_position_embeddings: int | None = None
    """YaRN: the context length before scaling (DeepSeek-V3: 4096)."""
    multi_latent_attention: bool = False
    """DeepSeek-V3's multi-head latent attention (megatron's MLASelfAttention): queries through a q_lora_rank
    bottleneck, keys and values from one kv_lora_rank latent per token plus a shared qk_pos_emb_head_dim rope key;
    the rollout engine caches the latent and the rope key per token (docs/moe.md)."""
    q_lora_rank: int | None = None
    """MLA: the query latent's width (DeepSeek-V3: 1536); None: one query projection."""
    kv_lora_rank: int | None = None
    """MLA: the key/value latent's width (DeepSeek-V3: 512)."""
    qk_head_dim: int | None = None
    """MLA: each query/key head's part without RoPE (DeepSeek-V3: 128)."""
    qk_pos_emb_head_dim: int | None = None
    """MLA: each query/key head's RoPE part (DeepSeek-V3: 64)."""
    v_head_dim: int | None = None
    """MLA: each value head's width (DeepSeek-V3: 128)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer weights (Qwen2.5-7B/32B: true)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2: true, Llama and Qwen3: false)."""
    qk_layernorm: bool = False
    """RMSNorm over each query and key head (its own weight of kv_channels values), before RoPE (Qwen3: true)."""
    disable_bias_linear: bool = False
    """No bias on the other linear layers; mindrl's decoders have none, so this must be true."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon (Qwen2.5-7B: 1e-6)."""
    swiglu: bool = False
    """SwiGLU MLP; mindrl's decoders always use it, so this must be true."""
    normalization: str = "LayerNorm"
    """'RMSNorm' is the only normalization mindrl builds."""
    position_embedding_type: str = "learned_absolute"
    """'rope' is the only position embedding mindrl builds."""
    use_rotary_position_embeddings: bool = False
    """Legacy megatron switch for RoPE; true is the same as position_embedding_type: rope."""
    noop_layers: str | list[int] | None = None
    """MindSpeed's identity layers ("5,95"): global layer indices, within num_layers, that hold no weights, so that
    num_layers pads the model's real layers to a multiple of PP. mindrl-plan sizes each stage's real layers;
    mindrl-train does not build them and refuses the key at start (docs/moe.md)."""
    num_experts: int | None = None
    """Routed experts per MoE layer (Qwen3-MoE: 128); None or 0: a dense model. Checked against the checkpoint,
    with moe_router_topk, moe_ffn_hidden_size and norm_topk_prob (docs/moe.md)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (Qwen3-MoE: 8)."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's SwiGLU width (Qwen3-30B-A3B: 768); None: ffn_hidden_size."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing weights to sum to 1 (Qwen3-MoE: true): a softmax over the chosen experts'
    logits; false: the softmax over all experts, then the top k."""
    moe_router_load_balancing_type: str = "aux_loss"
    """The router's load-balancing loss in training: aux_loss (the Switch loss over each micro-batch's tokens, what
    MindSpeed-RL's recipes set), seq_aux_loss (per sequence), global_aux_loss (over the global batch) or none."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss, added to the training loss per MoE layer (Qwen3-MoE recipes: 0.001; 0:
    none). It replaces the checkpoint's router_aux_loss_coef, as in MindSpeed-RL."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss (ST-MoE) in training; None: none."""
    first_k_dense_replace: int = 0
    """DeepSeek-V3: the first layers keep a dense MLP of ffn_hidden_size (DeepSeek-V3: 3)."""
    moe_layer_freq: int = 1
    """Every this-many layers after the dense ones is a MoE layer; mindrl builds 1 (every one), as DeepSeek-V3 has."""
    n_shared_experts: int | None = None
    """DeepSeek-V3: shared experts every token runs through beside its routed ones, one SwiGLU of n_shared_experts x
    moe_ffn_hidden_size."""
    moe_router_score_function: str = "softmax"
    """The router's score: softmax (Qwen3-MoE) or sigmoid (DeepSeek-V3, its top-k scores renormalised)."""
    moe_router_enable_expert_bias: bool = False
    """DeepSeek-V3: each expert's correction bias (the checkpoint's e_score_correction_bias) added to its score for
    the choice only."""
    moe_router_bias_update_rate: float = 0.0
    """How far megatron moves each expert's bias per step towards an even load (sign of its deficit x this rate);
    0 keeps the checkpoint's bias (mindrl's default; megatron's pre-training default is 1e-3)."""
    moe_router_num_groups: int | None = None
    """DeepSeek-V3: experts form this many groups (n_group: 8) ..."""
    moe_router_group_topk: int | None = None
    """... of which each token's experts come from the best this many (topk_group: 4), a group ranked by its
    best moe_router_topk / moe_router_group_topk scores."""
    moe_router_topk_scaling_factor: float | None = None
    """DeepSeek-V3: the chosen experts' weights are multiplied by this (routed_scaling_factor: 2.5)."""

    def validate(self, col: Collector) -> None:
        for key in ("num_layers", "hidden_size", "num_attention_heads"):
            v = getattr(self, key)
            if v is None:
                col.add(key, "is required (the model YAML must give the architecture)")
            elif v < 1:
                col.add(key, f"must be >= 1, got {v}")
        for key in ("ffn_hidden_size", "kv_channels", "padded_vocab_size", "max_position_embeddings"):
            v = getattr(self, key)
            if v is not None and v < 1:
                col.add(key, f"must be >= 1 (or unset), got {v}")
        if self.num_query_groups < 1:
            col.add("num_query_groups", f"must be >= 1, got {self.num_query_groups}")
        if self.make_vocab_size_divisible_by < 1:
            col.add("make_vocab_size_divisible_by", f"must be >= 1, got {self.make_vocab_size_divisible_by}")
        heads, hidden = self.num_attention_heads, self.hidden_size
        if heads and heads >= 1 and not col.is_bad("num_attention_heads", "num_query_groups"):
            if self.group_query_attention and self.num_query_groups >= 1 and heads % self.num_query_groups:
                col.add(
                    "num_query_groups",
                    f"num_attention_heads={heads} must be divisible by num_query_groups={self.num_query_groups}",
                )
            if self.kv_channels is None and hidden and hidden >= 1 and hidden % heads:
                col.add("hidden_size", f"hidden_size={hidden} must be divisible by num_attention_heads={heads} "
                        "(or set kv_channels)")  # fmt: skip
        self._validate_moe(col)
        if self.noop_layers is not None:
            try:
                bad = [i for i in self.noop_layer_indices if not 0 <= i < (self.num_layers or 0)]
            except ValueError:
                col.add("noop_layers", f"{self.noop_layers!r} is not a comma-separated list of layer indices")
            else:
                if bad:
                    col.add(
                        "noop_layers", f"{bad} are not layer indices in 0..num_layers-1={(self.num_layers or 0) - 1}"
                    )
        if self.norm_epsilon <= 0:
            col.add("norm_epsilon", f"must be > 0, got {self.norm_epsilon}")
        if self.rotary_base <= 0:
            col.add("rotary_base", f"must be > 0, got {self.rotary_base}")
        if self.rope_scaling_type not in SUPPORTED_ROPE_SCALING:
            col.add("rope_scaling_type", f"{self.rope_scaling_type!r} is not supported; use null, 'llama3' or 'yarn'")
        elif self.rope_scaling_type == "yarn" and not self.multi_latent_attention:
            col.add("rope_scaling_type", "yarn is built inside megatron's multi-latent attention only (DeepSeek-V3); "
                    "set multi_latent_attention: true or use null / 'llama3'")  # fmt: skip
        self._validate_mla(col)
        # mindrl builds Qwen2 / Llama / Qwen3-style decoders only; a model file describing anything else is wrong here.
        style = (
            "mindrl builds Qwen2/Llama/Qwen3-style decoders (RMSNorm, SwiGLU, RoPE, no linear biases but the QKV bias)"
        )
        if self.normalization != "RMSNorm":
            col.add("normalization", f"{self.normalization!r} is not supported: {style}; set it to RMSNorm")
        if not self.swiglu:
            col.add("swiglu", f"must be true: {style}")
        if not self.uses_rope:
            col.add("position_embedding_type", f"{self.position_embedding_type!r} is not supported: {style}; set rope")
        if not self.disable_bias_linear:
            col.add("disable_bias_linear", f"must be true: {style}")

    def _validate_mla(self, col: Collector) -> None:
        if not self.multi_latent_attention:
            return
        for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            v = getattr(self, key)
            if v is None or v < 1:
                col.add(key, f"must be >= 1 with multi_latent_attention, got {v}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            col.add("q_lora_rank", f"must be >= 1 (or unset: one query projection), got {self.q_lora_rank}")

    def _validate_moe(self, col: Collector) -> None:
        if not self.num_experts:
            for key, default in (("first_k_dense_replace", 0), ("n_shared_experts", None)):
                if getattr(self, key) not in (default, 0):
                    col.add(key, "needs a mixture-of-experts model (num_experts)")
            return
        if self.num_experts < 0:
            col.add("num_experts", f"must be >= 0 (0 or null: a dense model), got {self.num_experts}")
        elif not 1 <= self.moe_router_topk <= self.num_experts:
            col.add("moe_router_topk", f"must be in 1..num_experts={self.num_experts}, got {self.moe_router_topk}")
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            col.add("moe_ffn_hidden_size", f"must be >= 1 (or unset), got {self.moe_ffn_hidden_size}")
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            col.add("moe_router_load_balancing_type", f"{self.moe_router_load_balancing_type!r} is not one of "
                    f"{', '.join(LOAD_BALANCING_TYPES)}")  # fmt: skip
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
            v = getattr(self, key)
            if v is not None and v < 0:
                col.add(key, f"must be >= 0, got {v}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            col.add("moe_router_score_function", f"{self.moe_router_score_function!r} is not one of softmax, sigmoid")
        if self.moe_layer_freq != 1:
            col.add("moe_layer_freq", f"{self.moe_layer_freq} is not supported: mindrl builds every layer after "
                    "first_k_dense_replace as a MoE layer (1)")  # fmt: skip
        if self.num_layers and not 0 <= self.first_k_dense_replace < self.num_layers:
            col.add("first_k_dense_replace", f"must leave a MoE layer among num_layers={self.num_layers}")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups or group_topk:
            if not groups or not group_topk or self.num_experts % groups or not 1 <= group_topk <= groups:
                col.add("moe_router_num_groups", f"{groups} groups with moe_router_group_topk={group_topk} must divide "
                        f"num_experts={self.num_experts} and choose 1..{groups} of them")  # fmt: skip

    # -- derived ----------------------------------------------------------------------------------------
    @property
    def uses_rope(self) -> bool:
        return self.position_embedding_type == "rope" or self.use_rotary_position_embeddings

    def vocab_rows(self, tokenizer_size: int, tp: int) -> int:
        """The embedding's and output layer's rows at tensor parallel size `tp`: padded_vocab_size, else megatron's
        padding of the tokenizer's `tokenizer_size` tokens up to a multiple of make_vocab_size_divisible_by x tp."""
        if self.padded_vocab_size is not None:
            return int(self.padded_vocab_size)
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-tokenizer_size // multiple) * multiple

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads: num_query_groups with grouped-query attention, else one per query head (MLA: the keys
        and values megatron expands from the latent, one per query head)."""
        if self.multi_latent_attention:
            return int(self.num_attention_heads or 0)
        return self.num_query_groups if self.group_query_attention else int(self.num_attention_heads or 0)

    @property
    def head_dim(self) -> int:
        """A query / key head's width (MLA: its nope and rope parts)."""
        if self.multi_latent_attention:
            return int((self.qk_head_dim or 0) + (self.qk_pos_emb_head_dim or 0))
        return int(self.kv_channels or (self.hidden_size or 0) // max(1, self.num_attention_heads or 1))

    def is_moe_layer(self, index: int) -> bool:
        """Whether global layer `index` holds experts (every layer from first_k_dense_replace on of a MoE model)."""
        return self.is_moe and index >= self.first_k_dense_replace

    @property
    def shared_expert_ffn_size(self) -> int:
        """The shared expert's SwiGLU width (n_shared_experts x the experts' width); 0 without one."""
        return int(self.n_shared_experts or 0) * self.expert_ffn_size if self.is_moe else 0

    @property
    def noop_layer_indices(self) -> list[int]:
        """noop_layers as a list of ints (raises ValueError on a malformed string)."""
        given = self.noop_layers
        if given is None or given == "":
            return []
        return [int(x) for x in given.split(",")] if isinstance(given, str) else [int(x) for x in given]

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def expert_ffn_size(self) -> int:
        """moe_ffn_hidden_size, or ffn_hidden_size when unset (megatron's default)."""
        return int(self.moe_ffn_hidden_size or self.ffn_size)

    def moe_training_overrides(self) -> dict[str, Any]:
        """The TransformerConfig keys of this file's router losses, which replace the checkpoint's (an empty dict
        for a dense model)."""
        if not self.is_moe:
            return {}
        kind = self.moe_router_load_balancing_type
        return dict(
            moe_router_load_balancing_type=kind,
            moe_aux_loss_coeff=0.0 if kind == "none" else float(self.moe_aux_loss_coeff),
            moe_z_loss_coeff=self.moe_z_loss_coeff or None,
            moe_router_bias_update_rate=float(self.moe_router_bias_update_rate),
        )

    @property
    def token_ffn_size(self) -> int:
        """The MLP width one token runs through: ffn_size, or for a MoE model its k experts' (moe_router_topk x
        expert_ffn_size); what activation memory scales with."""
        if not self.is_moe:
            return self.ffn_size
        return self.moe_router_topk * self.expert_ffn_size + self.shared_expert_ffn_size

    @property
    def ffn_size(self) -> int:
        """ffn_hidden_size, or megatron's 4 * hidden_size when unset."""
        return int(self.ffn_hidden_size or 4 * (self.hidden_size or 0))

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["num_kv_heads"] = self.num_kv_heads
        return d
