"""mindrl: RL post-training for LLMs on megatron-core and vLLM."""

import warnings as _warnings

# Expected on CPU / without NVIDIA extensions, and not actionable by users: megatron warns once per module
# that Apex / Transformer Engine are absent, and its checkpoint code calls deprecated torch.distributed APIs.
_warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*|Apex is not installed.*")
_warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch\.distributed|megatron)\..*")

__version__ = "0.1.0"
