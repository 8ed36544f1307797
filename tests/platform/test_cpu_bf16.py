"""Whether this host runs bf16 natively, from /proc/cpuinfo's flags: a bf16 config on a host without bf16
instructions is told it runs in software (it still runs)."""

from __future__ import annotations

import pytest

from mindrl.platform import cpu as cpu_platform


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("fma avx avx2", False),  # AVX2 only
        ("avx2 avx512f avx512bw avx512vl", False),  # AVX-512 before AVX512-BF16
        ("avx2 avx512f avx512_bf16", True),
        ("avx2 avx512f amx_bf16 amx_tile", True),
    ],
)
def test_bf16_in_software_reads_the_flags(tmp_path, monkeypatch, flags, native):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: x\n")
    assert cpu_platform.cpu_flags(str(info)) == set(flags.split())
    monkeypatch.setattr(cpu_platform, "cpu_flags", lambda: set(flags.split()))
    why = cpu_platform.CpuPlatform().bf16_in_software()
    assert (why is None) == native
    if not native:
        assert "no bf16 instructions" in why


def test_arm_bf16_and_unreadable_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert "bf16" in cpu_platform.cpu_flags(str(info))
    assert cpu_platform.cpu_flags(str(tmp_path / "missing")) == set()
    monkeypatch.setattr(cpu_platform, "cpu_flags", lambda: set())
    assert cpu_platform.CpuPlatform().bf16_in_software() is None  # unknown: no claim
