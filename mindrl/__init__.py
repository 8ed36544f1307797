"""mindrl: RL post-training for LLMs on megatron-core and vLLM."""

__version__ = "0.1.0"
