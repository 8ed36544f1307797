"""Activation recomputation: the recompute settings as megatron-core's TransformerConfig keys (its own checkpointed
forward), and the MLP that recomputes its activation in backward instead of keeping its output."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import MLP

from mindrl.config.settings import RecomputeSettings


def transformer_config_keys(recompute: RecomputeSettings | None) -> dict[str, Any]:
    """The TransformerConfig keys of `recompute`: 'full' checkpoints whole layers (TransformerBlock's checkpointed
    forward, per recompute_method / recompute_num_layers), 'selective' the core attention of every layer
    (megatron's recompute_modules default, ["core_attn"])."""
    if recompute is None or recompute.recompute_granularity is None:
        return {}
    return {
        "recompute_granularity": recompute.recompute_granularity,
        "recompute_method": recompute.recompute_method,
        "recompute_num_layers": recompute.recompute_num_layers,
    }


class RecomputeActivationMLP(MLP):
    """megatron's MLP whose activation output (fc2's input, [s, b, ffn / tp]) is not kept for backward: its storage
    is released once fc2 has run and rebuilt from fc1's output when fc2's output grad arrives (megatron's
    `CheckpointWithoutOutput`, as its MoE experts' `moe_act`). Only the activation's input stays, which the fused
    SwiGLU keeps anyway; forward-only passes (no grad) run megatron's MLP unchanged. Made by
    `recompute_activations` from built MLPs (megatron's layer hands its TP group only to the classes it knows)."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not (self.training and torch.is_grad_enabled()):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        # fp8=None: megatron-core 0.16 reads `fp8 is not None`, so its default (False) asks for Transformer Engine.
        checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
        args = (intermediate,) if bias is None else (intermediate, bias)
        activated = checkpoint.checkpoint(self._activation, *args)
        output, output_bias = self.linear_fc2(activated)
        checkpoint.discard_output_and_register_recompute(output)
        return output, output_bias

    def _activation(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The activation megatron's MLP applies to fc1's output (the same function, so the same values)."""
        if self.config.use_te_activation_func:  # mindrl's fused SwiGLU module (models.builder.layer_spec)
            return self.activation_func(x if bias is None else x + bias)
        if self.config.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

            return bias_swiglu_impl(x, bias, self.config.activation_func_fp8_input_store, False)
        if bias is not None:
            x = x + bias
        gate, linear = torch.chunk(x, 2, dim=-1)
        return self.config.activation_func(gate) * (linear + self.config.glu_linear_offset)


def recompute_activations(model: torch.nn.Module) -> None:
    """Make every dense MLP of `model` recompute its activation in backward (`RecomputeActivationMLP`)."""
    for module in model.modules():
        if type(module) is MLP:
            config = module.config
            swiglu = config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
            if not swiglu or config.activation_func_clamp_value is not None:
                raise ValueError("recompute_activation_function covers the SwiGLU MLP (silu, gated, no clamp)")
            module.__class__ = RecomputeActivationMLP
