"""MKL's CPU-vendor check answered "Intel" on AMD CPUs by a preloaded shim, so that torch's MKL picks its kernels
by instruction set instead of running its vendor-generic path (`KernelSet.worker_env` preloads it into workers)."""

from __future__ import annotations

import functools
import os
import platform as host_platform
import subprocess
import warnings

import torch

from mindrl.kernels.native_build import c_compiler, cache_dir, compile_library, failure_detail, read_source
from mindrl.platform import env_switch

SYMBOL = "mkl_serv_intel_cpu_true"  # what the shim defines (mkl_vendor_shim.c), returning 1
SOURCE_FILE = "mkl_vendor_shim.c"
_NAME = "libmindrl_mkl_intel_cpu_true.so"


def is_x86_64() -> bool:
    """Whether this host's CPU is x86-64 (where the oneDNN and MKL choices apply)."""
    return host_platform.machine().lower() in ("x86_64", "amd64")


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
        compile_library(compiler, read_source(SOURCE_FILE), path, ["-O2"])
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
