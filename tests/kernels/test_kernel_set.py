"""The one object that says which kernels are on (`mindrl.kernels.current_kernels()`): oneDNN linears in megatron,
the rollout's kernel switches."""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys

import pytest
import torch

from mindrl.kernels import current_kernels, mkl_vendor
from mindrl.platform import current_platform
from tests.procs import check_in_fresh_process

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_device_platforms_have_no_kernels_of_mindrls():
    from mindrl.kernels import KernelSet
    from mindrl.platform import CudaPlatform

    fast = KernelSet(CudaPlatform())
    assert fast.elementwise_kernels() is None and fast.rollout_sampler_kernels() is None
    assert fast.rollout_linear_kernels() is None and not fast.onednn_linear and fast.mkl_vendor_shim is None
    assert fast.worker_env == {}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="oneDNN linears are x86-only")
def test_megatron_linears_run_on_onednn_with_megatrons_results():
    # on an Intel CPU they are off by default (MKL's faster)
    check_in_fresh_process("tests.kernels.onednn_checks", "onednn_linear", MINDRL_ONEDNN_LINEAR="1")


def _onednn_linear_in(env: dict) -> str:
    code = "from mindrl.kernels import current_kernels as c; print(c().onednn_linear)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    return proc.stdout.strip() or proc.stderr.strip().splitlines()[-1]


def test_onednn_linears_are_where_mkl_runs_its_vendor_generic_path():
    """By default oneDNN's linears are on exactly on a non-Intel x86 CPU without the MKL vendor shim (measured there:
    MKL at half of oneDNN's rate; on Intel and with the shim MKL is the faster); 0 turns them off, 1 on, anything
    else is an error that says what the variable takes."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MINDRL_ONEDNN_LINEAR")}
    available = current_kernels().onednn_available
    generic = mkl_vendor.cpu_vendor() != "GenuineIntel" or not torch.backends.mkl.is_available()
    assert _onednn_linear_in(base) == str(available and generic)
    assert _onednn_linear_in(dict(base, MINDRL_ONEDNN_LINEAR="auto")) == str(available and generic)
    assert _onednn_linear_in(dict(base, MINDRL_ONEDNN_LINEAR="0")) == "False"
    assert _onednn_linear_in(dict(base, MINDRL_ONEDNN_LINEAR="1")) == str(available)
    assert "MINDRL_ONEDNN_LINEAR='yes' must be auto, 0 or 1" in _onednn_linear_in(
        dict(base, MINDRL_ONEDNN_LINEAR="yes")
    )


@pytest.mark.parametrize(
    "name,offered",
    [("MINDRL_ROLLOUT_C_SAMPLER", "rollout_sampler_kernels"), ("MINDRL_ROLLOUT_C_LINEAR", "rollout_linear_kernels")],
)
def test_the_rollout_kernel_switches(monkeypatch, name, offered):
    """MINDRL_ROLLOUT_C_SAMPLER=0 keeps vLLM's sampling step, MINDRL_ROLLOUT_C_LINEAR=0 its linears (no kernels
    offered); a bad value is an error; MINDRL_CPU_KERNELS=0 turns both off."""
    fast = current_kernels()
    kernels = getattr(fast, offered)
    monkeypatch.setenv(name, "0")
    assert kernels() is None
    monkeypatch.setenv(name, "yes")
    if current_platform().is_cpu:
        with pytest.raises(ValueError, match=f"{name}='yes' must be 0 or 1"):
            kernels()
    monkeypatch.setenv(name, "1")
    monkeypatch.setenv("MINDRL_CPU_KERNELS", "1")
    assert (kernels() is not None) == (fast.elementwise_kernels() is not None)
    monkeypatch.setenv("MINDRL_CPU_KERNELS", "0")
    assert kernels() is None


def test_bf16_kernels_only_where_a_bf16_form_is():
    """The training kernels with a bf16 form (SwiGLU, RMSNorm, RoPE, the log-probs' softmax) take bf16 tensors when
    their caller says so; the rest (the rollout's GEMM and sampler, attention's softmax) keep fp32 only, and a mix of
    dtypes goes to torch. The bf16 forms use no bf16 instruction (tests/kernels/test_cpu_kernels.py builds them for
    AVX2 too), so every x86-64 CPU runs them."""
    from mindrl.kernels.cpu_kernels import Kernels
    from mindrl.models.fused import kernels_for

    bf16, fp32 = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)
    assert not Kernels.takes(bf16) and not Kernels.takes(fp32, bf16) and Kernels.takes(fp32)
    assert Kernels.takes(bf16, bf16, bf16=True) and not Kernels.takes(fp32, bf16, bf16=True)
    assert kernels_for(bf16) is None
    assert (kernels_for(bf16, bf16=True) is not None) == (kernels_for(fp32) is not None)
