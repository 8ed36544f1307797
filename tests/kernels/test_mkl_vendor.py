"""mindrl.kernels.mkl_vendor: on an AMD CPU every worker preloads a library that answers MKL's vendor check, so
torch's MKL runs the code path of the CPU's instruction set (the rank's `mkl_serv_cpu_detect` is above the vendor-
generic 0 that an unpatched process reads) and megatron's linears stay on MKL instead of oneDNN; elsewhere (or where
it could not be built) nothing is preloaded. The shim builds with the host's compiler
on any CPU, a failed build warns and leaves MKL alone, and MINDRL_MKL_VENDOR_SHIM=0 turns it off."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from mindrl.kernels import current_kernels, mkl_vendor, native_build


def _rank_view():
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    err = ((a @ b).double() - a.double() @ b.double()).abs().max().item()
    return os.environ.get("LD_PRELOAD", ""), mkl_vendor.mkl_code_path(), err, current_kernels().onednn_linear


def test_workers_run_mkls_instruction_set_path_where_the_shim_applies(pool):
    shim = current_kernels().mkl_vendor_shim
    local = mkl_vendor.mkl_code_path()  # this test process has nothing preloaded
    for preload, code_path, err, onednn in pool.run(_rank_view):
        assert err < 1e-3  # fp32 sums of 200 products of N(0, 1) numbers
        if shim is None:
            assert "mindrl" not in preload and code_path == local
            assert onednn == current_kernels().onednn_linear
        else:
            assert mkl_vendor.applies() and mkl_vendor.cpu_vendor() == "AuthenticAMD"
            assert preload == shim and code_path > local, (preload, code_path, local)
            assert mkl_vendor.loaded() is False and not onednn  # MKL's own path is the faster one there


@pytest.mark.skipif(native_build.c_compiler() is None, reason="no C compiler to build the shim")
def test_the_shim_builds_and_answers_intel(tmp_path):
    path = mkl_vendor.build(str(tmp_path))
    assert path is not None and os.path.dirname(path) == str(tmp_path)
    assert getattr(ctypes.CDLL(path), mkl_vendor.SYMBOL)() == 1
    assert mkl_vendor.build(str(tmp_path)) == path  # built once
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no build leftovers


def test_a_failed_build_warns_and_leaves_mkl_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with pytest.warns(UserWarning, match="could not build the MKL vendor shim"):
        assert mkl_vendor.build(str(tmp_path)) is None
    assert os.listdir(tmp_path) == []


def test_the_shim_can_be_turned_off():
    code = "from mindrl.kernels import current_kernels as c; print(sorted(c().worker_env), c().mkl_vendor_shim)"
    env = {**os.environ, "MINDRL_MKL_VENDOR_SHIM": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [
        "['MALLOC_MMAP_MAX_',",
        "'MALLOC_TRIM_THRESHOLD_',",
        "'MINDRL_BLOCKED_IMPORTS']",
        "None",
    ]
