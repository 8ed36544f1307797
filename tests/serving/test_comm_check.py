"""`mindrl-comm check` on loopback: both directions pass between a trainer and a sampler process, and each
failure names the direction and port (nothing listening; a data port nobody binds)."""

import os
import subprocess
import sys

from mindrl.launch import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def two_ports():
    dp = free_port()
    sp = free_port()
    while sp == dp:  # free_port may hand back the port it just released
        sp = free_port()
    return dp, sp


def comm(*args, wait=True, timeout=60):
    p = subprocess.Popen(
        [sys.executable, "-m", "mindrl.cli.comm", *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if wait:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    return p


def test_help():
    rc, out = comm("--help")
    assert rc == 0 and "check" in out
    rc, out = comm("check", "--help")
    assert rc == 0 and "--data-port" in out and "--sync-port" in out and "5555" in out and "5556" in out


def test_both_directions_on_loopback():
    dp, sp = two_ports()
    ports = ["--data-port", str(dp), "--sync-port", str(sp), "--timeout", "60"]
    trainer = comm("check", "--role", "trainer", "--host", "127.0.0.1", *ports, wait=False)
    rc, out = comm("check", "--role", "sampler", "--host", "127.0.0.1", *ports, "--blob-mb", "4")
    t_out, _ = trainer.communicate(timeout=60)
    assert rc == 0 and trainer.returncode == 0, f"sampler:\n{out}\ntrainer:\n{t_out}"
    assert "4194304 bytes" in out and "bit-exact" in out and "experience sent" in out
    assert "data channel sampler -> trainer OK" in t_out and "sync channel trainer -> sampler OK" in t_out


def test_failure_names_direction_and_port():
    dp, sp = two_ports()
    rc, out = comm("check", "--role", "sampler", "--host", "127.0.0.1", "--data-port", str(dp), "--sync-port",
                   str(sp), "--timeout", "1")  # fmt: skip
    assert rc == 1 and "sync channel (trainer -> sampler)" in out and f"port {sp}" in out and "no answer" in out

    wrong = free_port()  # the trainer binds dp, the sampler pushes to a port nobody binds
    trainer = comm("check", "--role", "trainer", "--host", "127.0.0.1", "--data-port", str(dp), "--sync-port",
                   str(sp), "--timeout", "8", wait=False)  # fmt: skip
    rc, out = comm("check", "--role", "sampler", "--host", "127.0.0.1", "--data-port", str(wrong), "--sync-port",
                   str(sp), "--timeout", "3")  # fmt: skip
    t_out, _ = trainer.communicate(timeout=60)
    assert rc == 1 and "data channel (sampler -> trainer)" in out and f"port {wrong}" in out, out
    assert (
        trainer.returncode == 1 and f"no experience arrived on the data channel (sampler -> trainer) port {dp}" in t_out
    )

    rc, out = comm("check", "--role", "trainer", "--host", "127.0.0.1", "--data-port", str(dp), "--sync-port",
                   str(sp), "--timeout", "1")  # fmt: skip
    assert rc == 1 and "no sampler reached the sync channel (trainer -> sampler) on port" in out
