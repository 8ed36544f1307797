"""megatron-core's `jit_fuser`, compiled at its first call instead of at import.

`megatron.core.jit` sets `jit_fuser = torch.compile`, and its fusion modules decorate functions with it at import:
`torch.compile(fn)` imports torch._dynamo and torch._inductor (and sympy) there and then, some 2 CPU s in every
process that imports megatron (a critic, a reference, a rank of a conversion or SFT), although mindrl calls those
functions only where a model asks for them (most never: its own fused SwiGLU and RoPE run eagerly on CPU). The
wrapper installed here calls `torch.compile(fn, **kwargs)` on the function's first call, so a process that calls one
compiles it exactly as before, and one that calls none never imports the compiler. A vLLM process imports torch._inductor
anyway (vllm.env_override), which this does not change.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

_MODULE = "megatron.core.jit"


def lazy_compile(fn=None, /, **kwargs):
    """`torch.compile(fn, **kwargs)` made on `fn`'s first call; `@lazy_compile` and `@lazy_compile(...)` both work."""
    if fn is None:
        return functools.partial(lazy_compile, **kwargs)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kw):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **kwargs)
        return compiled(*args, **kw)

    return call


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = lazy_compile


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Make megatron's jit_fuser lazy in this process, if megatron.core.jit is not imported yet (idempotent)."""
    if _MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
