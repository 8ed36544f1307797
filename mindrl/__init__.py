"""mindrl: RL post-training for LLMs on megatron-core and vLLM."""

import os as _os
import sys as _sys
import warnings as _warnings

# Modules a worker process must not import, as the platform's worker environment names them (`MINDRL_BLOCKED_IMPORTS`,
# comma-separated): set before anything imports them, so that `import x` raises ImportError and find_spec finds nothing.
# mindrl is the first package a worker imports (its actor class or rank entry point), before megatron and vLLM.
for _name in filter(None, _os.environ.get("MINDRL_BLOCKED_IMPORTS", "").split(",")):
    _sys.modules.setdefault(_name.strip(), None)

# Expected on CPU / without NVIDIA extensions, and not actionable by users: megatron warns once per module
# that Apex / Transformer Engine are absent, and its checkpoint code calls deprecated torch.distributed APIs.
_warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*|Apex is not installed.*")
_warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch\.distributed|megatron)\..*")

from mindrl import _lazy_jit  # noqa: E402  (before megatron: its jit_fuser compiles on first call, not at import)

_lazy_jit.install()

__version__ = "0.1.0"
