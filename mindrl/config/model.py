"""`model`: the network architecture, from configs/model/NAME.yaml (MindSpeed-RL's model files, whose single
top-level key is NAME), plus any architecture keys written in megatron_training or a role section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mindrl.config.errors import Collector
from mindrl.config.section import Section

SUPPORTED_ROPE_SCALING = (None, "llama3")
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
    """RoPE scaling: None or 'llama3' (Llama-3.1); MindSpeed-RL's 'linear' / 'yarn' are not supported."""
    rope_scaling_factor: float = 1.0
    """RoPE scaling factor (with rope_scaling_type)."""
    low_freq_factor: float | None = None
    """Llama-3 RoPE scaling: low-frequency factor."""
    high_freq_factor: float | None = None
    """Llama-3 RoPE scaling: high-frequency factor."""
    original_max_position_embeddings: int | None = None
    """Llama-3 RoPE scaling: the context length before scaling."""
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
            col.add("rope_scaling_type", f"{self.rope_scaling_type!r} is not supported; use null or 'llama3'")
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

    def _validate_moe(self, col: Collector) -> None:
        if not self.num_experts:
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
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            v = getattr(self, key)
            if v is not None and v < 0:
                col.add(key, f"must be >= 0, got {v}")

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
        """Key/value heads: num_query_groups with grouped-query attention, else one per query head."""
        return self.num_query_groups if self.group_query_attention else int(self.num_attention_heads or 0)

    @property
    def head_dim(self) -> int:
        return int(self.kv_channels or (self.hidden_size or 0) // max(1, self.num_attention_heads or 1))

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
        )

    @property
    def token_ffn_size(self) -> int:
        """The MLP width one token runs through: ffn_size, or for a MoE model its k experts' (moe_router_topk x
        expert_ffn_size); what activation memory scales with."""
        return self.moe_router_topk * self.expert_ffn_size if self.is_moe else self.ffn_size

    @property
    def ffn_size(self) -> int:
        """ffn_hidden_size, or megatron's 4 * hidden_size when unset."""
        return int(self.ffn_hidden_size or 4 * (self.hidden_size or 0))

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["num_kv_heads"] = self.num_kv_heads
        return d
