"""Shared pieces of the device tests (`tests/*/test_*on_device.py`): one rank on the platform's accelerator (CUDA,
or an NPU through torch_npu), compared with the same computation on a CPU rank of the same host.

They are skipped on a CPU-only host (CI, laptops), where the whole suite already runs these paths on the CPU. Set
MINDRL_DEVICE_TESTS_ON_CPU=1 to run them there anyway, "device" side included on the CPU: that checks the tests
themselves, not a device.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

from mindrl.platform.detect import current_platform

ON_CPU_ANYWAY = os.environ.get("MINDRL_DEVICE_TESTS_ON_CPU") == "1"

needs_device = pytest.mark.skipif(
    current_platform().name == "cpu" and not ON_CPU_ANYWAY,
    reason="needs an accelerator (CUDA or NPU); the CPU runs this path everywhere else "
    "(MINDRL_DEVICE_TESTS_ON_CPU=1 runs the test on the CPU, to check the test itself)",
)

# cuBLAS is deterministic only with a fixed workspace; the variable must be set before the rank's first GEMM.
CUBLAS_DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def rank_pool(monkeypatch, on_cpu: bool):
    """A one-rank pool on the device, or (on_cpu) on the CPU of the same host. Not yet entered."""
    from mindrl.launch import RankPool

    with monkeypatch.context() as m:  # the ranks read the environment when they start
        for k, v in CUBLAS_DETERMINISTIC.items():
            m.setenv(k, v)
        if on_cpu:
            m.setenv("MINDRL_PLATFORM", "cpu")
        return RankPool(1, timeout_s=600)


def convert_on_cpu(hf_dirs: dict[str, str], root: str) -> dict[str, str]:
    """TP1 mcore checkpoints of the given HF models ({name: hf dir}), converted on a CPU rank."""
    from mindrl.checkpoint import convert
    from mindrl.launch import RankPool

    with pytest.MonkeyPatch.context() as m:
        m.setenv("MINDRL_PLATFORM", "cpu")
        pool = RankPool(1, timeout_s=600)
    out = {}
    with pool:
        for name, hf in hf_dirs.items():
            out[name] = os.path.join(root, name)
            convert.hf2mcore(hf, out[name], 1, 1, orm=name == "orm", pool=pool)
    return out


def to_host(obj: Any, devices: set[str]) -> Any:
    """`obj` with every tensor copied to the host (recursively through dicts, lists and tuples); the device types
    the tensors were on are added to `devices`."""
    if isinstance(obj, torch.Tensor):
        devices.add(obj.device.type)
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_host(v, devices) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v, devices) for v in obj)
    return obj


def deterministic_run(fn, *args: Any) -> dict:
    """Run `fn(*args)` in a rank with torch's deterministic algorithms on (a device's atomics-based kernels, e.g.
    attention backward, would otherwise make two equal runs differ in the last bits). Returns {"result" (tensors
    on the host), "devices" (where its tensors were), "nondeterministic" (the determinism warnings ops gave)}."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # warn_only=False: a kernel with a deterministic variant only selects it then (CUDA's memory-efficient
        # attention backward); a kernel without one raises, naming itself.
        torch.use_deterministic_algorithms(True)
        try:
            result = fn(*args)
        finally:
            torch.use_deterministic_algorithms(False)
    devices: set[str] = set()
    result = to_host(result, devices)
    warned = {str(w.message).splitlines()[0] for w in caught if "determinis" in str(w.message)}
    return {"result": result, "devices": sorted(devices), "nondeterministic": sorted(warned)}
