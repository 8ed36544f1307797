"""Models: HF config -> megatron TransformerConfig, actor / critic builders, the HF<->mcore weight map. Import
submodules directly (builder and forward import megatron; hf_config and weight_map do not)."""
