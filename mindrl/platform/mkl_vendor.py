"""MKL's CPU-vendor check, answered "Intel" on AMD CPUs, so that torch's MKL picks its kernels by instruction set.

torch's CPU wheel links oneMKL statically into libtorch_cpu.so. MKL picks its code path by CPU vendor: on an AMD CPU
it runs a generic path whatever the CPU supports (`mkl_serv_cpu_detect()` reads 0 there, 7 on the same AMD EPYC with
this shim). On a 2-core AMD EPYC VM with full-width AVX-512, fp32 `torch.matmul` ran at 210-218 GFLOP/s against
oneDNN's 460-505 at the benchmark model's shapes (docs/performance.md). mindrl's megatron linears already run on
oneDNN (`cpu_linear`), but torch's other GEMMs do not: the CPU flash-attention kernel's inner products, `bmm`, and
whatever a user's code calls. MKL asks `mkl_serv_intel_cpu_true()`, which libtorch_cpu.so exports and calls through
its PLT, so a preloaded library defining it to return 1 answers for it: MKL then dispatches on the CPU's
instruction-set flags, as it does on Intel CPUs (an AMD CPU without AVX-512, which should get MKL's AVX2 path, was not
available to measure).

The shim is a one-line C file, built once with the host's C compiler into mindrl's cache directory, and preloaded
into every worker process (`Platform.worker_env`: Ray workers and rank pools). Only where it applies: an x86-64 CPU
whose vendor is AMD, a torch with MKL whose libtorch_cpu.so exports the symbol, and a C compiler (`$CC`, else `cc`).
MINDRL_MKL_VENDOR_SHIM=0 turns it off; a user's own LD_PRELOAD replaces it (the user's environment wins over the
platform's defaults).
"""

from __future__ import annotations

import functools
import os
import subprocess
import warnings

import torch

from mindrl.platform.detect import env_switch, is_x86_64
from mindrl.platform.native_build import c_compiler, cache_dir, compile_library, failure_detail

SYMBOL = "mkl_serv_intel_cpu_true"
_SOURCE = f"int {SYMBOL}(void) {{ return 1; }}\n"
_NAME = "libmindrl_mkl_intel_cpu_true.so"


def cpu_vendor() -> str:
    """The vendor_id of /proc/cpuinfo ("AuthenticAMD", "GenuineIntel", ...), "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def libtorch_cpu() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")


def applies() -> bool:
    """Whether this host's MKL would run its vendor-generic path: x86-64, an AMD CPU, a torch with MKL whose
    libtorch_cpu.so exports the vendor check. (The caller checks that the platform is the CPU.)"""
    if not env_switch("MINDRL_MKL_VENDOR_SHIM"):
        return False
    if not is_x86_64() or cpu_vendor() != "AuthenticAMD":
        return False
    if not torch.backends.mkl.is_available() or not os.path.isfile(libtorch_cpu()):
        return False
    import ctypes

    try:
        return hasattr(ctypes.CDLL(libtorch_cpu()), SYMBOL)
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def shim() -> str | None:
    """The path of the shim library (built on first use into `cache_dir()`), or None where it does not apply or
    cannot be built (then a warning says why, and MKL keeps its own choice)."""
    return build(cache_dir()) if applies() else None


def build(directory: str) -> str | None:
    """The shim library in `directory`, compiled there unless it exists; None (with a warning) if it cannot be."""
    path = os.path.join(directory, _NAME)
    if os.path.isfile(path):
        return path
    compiler = c_compiler()
    if compiler is None:
        warnings.warn(
            "mindrl: no C compiler ($CC, cc or gcc) to build the MKL vendor shim: torch.matmul keeps MKL's "
            "vendor-generic path on this AMD CPU (MINDRL_MKL_VENDOR_SHIM=0 silences this)",
            stacklevel=2,
        )
        return None
    try:
        compile_library(compiler, _SOURCE, path, ["-O2"])
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(
            f"mindrl: could not build the MKL vendor shim into {path} with {compiler}: {e} {failure_detail(e)}; "
            "torch.matmul keeps MKL's vendor-generic path on this AMD CPU (MINDRL_MKL_VENDOR_SHIM=0 silences this)",
            stacklevel=2,
        )
        return None
    return path


def loaded() -> bool:
    """Whether MKL's vendor check answers "Intel" in this process: a library in the global scope (the shim, preloaded)
    defines it."""
    import ctypes

    return hasattr(ctypes.CDLL(None), SYMBOL)


def mkl_code_path() -> int:
    """MKL's code-path number for this process (`mkl_serv_cpu_detect`: 0 the vendor-generic path; higher numbers
    newer instruction sets), -1 where torch has no MKL to ask."""
    import ctypes

    try:
        fn = ctypes.CDLL(libtorch_cpu()).mkl_serv_cpu_detect
    except (OSError, AttributeError):
        return -1
    fn.restype = ctypes.c_int
    return int(fn())
