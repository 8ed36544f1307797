"""On CPU, offloaded state goes to a file outside the process's memory and comes back bit-identical; a read-only hold
sends nothing out again. In this process (no ranks needed)."""

from __future__ import annotations

import os

import pytest
import torch

from mindrl.platform import cpu
from mindrl.platform.cpu import SPILL_MIN_BYTES, CpuPlatform
from mindrl.resharding import OffloadConfig, TrainStateOffloader


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def spill_dir(tmp_path, monkeypatch):
    if cpu._fs_type(str(tmp_path)) in cpu._NO_SPILL_FS:
        pytest.skip(f"{tmp_path} is on a memory-backed file system")
    monkeypatch.setenv("MINDRL_OFFLOAD_DIR", str(tmp_path))
    return tmp_path


def test_cpu_host_buffer_leaves_the_process_and_keeps_its_bytes(spill_dir):
    p = CpuPlatform()
    n = 64 * SPILL_MIN_BYTES
    host = p.host_buffer(n)
    assert os.listdir(spill_dir) == []  # unlinked at once: nothing left behind
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    host.copy_(src)
    before = _rss_bytes()
    p.host_copied(host)
    freed = before - _rss_bytes()
    # The 64 MiB written leave the RSS; the process's other pages can move by a few pages meanwhile.
    assert freed > 0.9 * n, (freed, n)
    assert torch.equal(host, src)  # faulted back in from the page cache


def test_cpu_host_buffer_stays_in_memory_when_small_or_memory_backed(spill_dir, monkeypatch):
    p = CpuPlatform()
    small = p.host_buffer(SPILL_MIN_BYTES - 1)
    assert small.data_ptr() not in cpu._SPILLED
    small.fill_(3)
    p.host_copied(small)  # anonymous memory: must not be dropped (madvise would zero it)
    assert int(small.min()) == 3
    monkeypatch.setenv("MINDRL_OFFLOAD_DIR", "")
    assert p.host_buffer(SPILL_MIN_BYTES).data_ptr() not in cpu._SPILLED
    monkeypatch.setattr(cpu, "_fs_type", lambda path: "tmpfs")
    monkeypatch.setenv("MINDRL_OFFLOAD_DIR", str(spill_dir))
    assert p.host_buffer(SPILL_MIN_BYTES).data_ptr() not in cpu._SPILLED


def test_read_only_hold_copies_nothing_out_again(spill_dir, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 4))  # one spilled, three small
    want = {k: v.clone() for k, v in model.state_dict().items()}
    off = TrainStateOffloader([model], None, OffloadConfig(offload_train_param=True))
    off.offload()
    assert off.device_bytes()["param"] == 0
    made = []
    real = off.platform.host_buffer
    monkeypatch.setattr(off.platform, "host_buffer", lambda n: made.append(n) or real(n))
    x = torch.randn(2, 1024)
    for _ in range(2):
        with off.holding(["param"], read_only=True):
            y = model(x)
        assert made == [] and off.device_bytes()["param"] == 0
    assert all(torch.equal(v, want[k]) for k, v in _onloaded(off, model).items())
    with off.holding(["param"]):  # may change them: they are copied out again
        with torch.no_grad():
            model[1].bias.add_(1.0)
    assert sorted(made) == sorted(p.numel() * 4 for p in model.parameters())
    got = _onloaded(off, model)
    assert torch.equal(got["1.bias"], want["1.bias"] + 1.0) and torch.equal(got["0.weight"], want["0.weight"])
    with off.holding(["param"], read_only=True):
        assert torch.allclose(model(x), y + 1.0)


def _onloaded(off: TrainStateOffloader, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with off.holding(["param"], read_only=True):
        return {k: v.clone() for k, v in model.state_dict().items()}


def test_cpu_host_buffer_stays_in_memory_when_the_disk_is_full(spill_dir, monkeypatch, caplog):
    """The file's blocks are reserved when the buffer is made, so a full disk is a warning and an in-memory buffer,
    never a SIGBUS at the first write into the mapping; nothing is left in the directory."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cpu.os, "posix_fallocate", full)
    host = CpuPlatform().host_buffer(4 * SPILL_MIN_BYTES)
    assert host.data_ptr() not in cpu._SPILLED and host.numel() == 4 * SPILL_MIN_BYTES
    assert "stays in memory" in caplog.text and str(spill_dir) in caplog.text
    assert os.listdir(spill_dir) == []
