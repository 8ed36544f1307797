"""Misbehaving verifiers for the pool tests. Module-level so worker processes can import them by name."""

import os
import time

from mindrl.rewards import register_verifier


@register_verifier("_test_sleep_if_marked")
def sleep_if_marked(response, label):
    """Hangs (far past any test timeout) on responses containing HANG; otherwise 1.0."""
    if "HANG" in response:
        time.sleep(600)
    return 1.0


@register_verifier("_test_crash_if_marked")
def crash_if_marked(response, label):
    """Kills its own process on responses containing CRASH, like a segfault in a C extension would."""
    if "CRASH" in response:
        os._exit(3)
    return 1.0


@register_verifier("_test_raise_if_marked")
def raise_if_marked(response, label):
    if "RAISE" in response:
        raise RuntimeError("bad verifier")
    if "NAN" in response:
        return float("nan")
    return 1.0


register_verifier("_test_inline_raise_if_marked", inline=True)(raise_if_marked)


@register_verifier("_test_pid")
def worker_pid(response, label):
    return float(os.getpid())


@register_verifier("_test_heavy_imports")
def heavy_imports(response, label):
    """How many of math-verify, sympy, torch and transformers the scoring process has imported."""
    import sys

    return float(sum(m in sys.modules for m in ("math_verify", "sympy", "torch", "transformers")))
