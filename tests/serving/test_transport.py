"""Transports between samplers and the trainer on loopback: ZeroMQ round trips (experiences, weights, leases),
malformed messages dropped with a logged reason, backpressure, reconnect after a trainer restart, and two
sampler processes with one killed mid-run (no prompt lost or duplicated)."""

import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from mindrl.data.prompt_ledger import PromptLedger
from mindrl.launch import free_port
from mindrl.serving.experience import RUN_ID, Experience, encode
from mindrl.serving.transport import TransportTimeout, ZmqSamplerEnd, ZmqTrainerEnd
from tests.procs import stop_all

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def group(lease, sampler_id="s0", n=2, length=4, version=0, run_id=None):
    return [
        Experience(
            [lease.prompt_index + 1],
            np.arange(length) + k,
            -np.full(length, 0.5),
            {"acc": 1.0},
            "stop",
            lease.prompt_index,
            lease.epoch,
            sampler_id,
            version,
            meta={} if run_id is None else {RUN_ID: run_id},
        )  # fmt: skip
        for k in range(n)
    ]


@pytest.fixture
def ports():
    return free_port(), free_port()


def test_zmq_round_trip_weights_and_leases(ports):
    trainer = ZmqTrainerEnd(PromptLedger(4, seed=0), "127.0.0.1", *ports)
    sampler = ZmqSamplerEnd("s0", "127.0.0.1", *ports)
    try:
        assert sampler.fetch_weights(None, timeout_s=10) is None  # nothing published yet
        weights = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.bfloat16)}
        trainer.publish_weights(3, weights)
        update = sampler.fetch_weights(None, timeout_s=10)
        assert update.version == 3
        for k, t in weights.items():
            assert update.tensors[k].dtype == t.dtype and torch.equal(update.tensors[k], t)
        assert sampler.fetch_weights(3, timeout_s=10) is None
        with pytest.raises(ValueError, match="not newer"):
            trainer.publish_weights(3, weights)
        leases = sampler.lease(3, timeout_s=10)
        assert len(leases) == 3
        sent = [group(x, version=3) for x in leases]
        for g in sent:
            sampler.send(g, timeout_s=10)
        got = []
        while len(got) < 3:
            got += trainer.receive(8, timeout_s=10)
        for g_sent, g_got in zip(sent, got):
            assert encode(g_sent) == encode(g_got)  # bit-exact through the wire
        assert trainer.stats.received == 3 and trainer.ledger.in_flight() == []
    finally:
        sampler.close()
        trainer.close()


def test_malformed_and_duplicate_dropped_with_reason(ports, caplog):
    import zmq

    trainer = ZmqTrainerEnd(PromptLedger(4, seed=0), "127.0.0.1", *ports)
    sampler = ZmqSamplerEnd("s0", "127.0.0.1", *ports)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.connect(f"tcp://127.0.0.1:{ports[0]}")
    try:
        (lease,) = sampler.lease(1, timeout_s=10)
        good = encode(group(lease))
        with caplog.at_level(logging.WARNING, logger="mindrl.serving.transport"):
            raw.send(good[: len(good) // 2])  # truncated
            raw.send(b"\xc1\x80\x04")  # not msgpack (0xc1 is never used)
            raw.send(good)
            raw.send(good)  # a duplicate of an accepted prompt
            got = []
            deadline = time.monotonic() + 20
            while trainer.stats.received + trainer.stats.dropped_duplicate + trainer.stats.dropped_malformed < 4:
                got += trainer.receive(4, timeout_s=1)
                assert time.monotonic() < deadline
        assert len(got) == 1 and trainer.stats.dropped_malformed == 2 and trainer.stats.dropped_duplicate == 1
        assert "truncated" in caplog.text and "not valid msgpack" in caplog.text
        # a malformed sync request is answered with the reason, and the channel keeps working
        sampler._req.send(b"\x93\x01")
        reply = sampler._req.recv_multipart()
        assert b"not valid msgpack" in reply[0] or b"not a mindrl.sync" in reply[0]
        assert sampler.lease(1, timeout_s=10)
    finally:
        raw.close(linger=0)
        ctx.term()
        sampler.close()
        trainer.close()


def test_backpressure_sender_blocks_when_receiver_does_not_read(ports):
    hwm, length = 4, 1 << 18  # ~1 MiB of ids + 1 MiB of logprobs per response: kernel socket buffers hold few
    trainer = ZmqTrainerEnd(PromptLedger(1000, seed=0), "127.0.0.1", *ports, hwm=hwm)
    sampler = ZmqSamplerEnd("s0", "127.0.0.1", *ports, hwm=hwm, linger_s=0)
    try:
        leases = sampler.lease(200, timeout_s=10)
        payload = len(encode(group(leases[0], n=1, length=length)))
        sent = 0
        with pytest.raises(TransportTimeout, match="data channel .*no room after 0.5s"):
            for x in leases:
                sampler.send(group(x, n=1, length=length), timeout_s=0.5)
                sent += 1
        # bounded: both high-water marks plus what the kernel's loopback socket buffers hold
        rmem = int(open("/proc/sys/net/ipv4/tcp_rmem").read().split()[2])
        wmem = int(open("/proc/sys/net/ipv4/tcp_wmem").read().split()[2])
        bound = 2 * hwm + (rmem + wmem) // payload + 2
        assert sent <= bound, (sent, bound)
        received = trainer.receive(sent, timeout_s=10)
        assert received
        sampler.send(group(leases[sent], n=1, length=length), timeout_s=10)  # room again once the trainer reads
        print(f"backpressure: blocked after {sent} messages of {payload} bytes (bound {bound})")
    finally:
        sampler.close()
        trainer.close()


def test_sampler_reconnects_after_trainer_restart(ports):
    ledger = PromptLedger(6, seed=0)
    trainer = ZmqTrainerEnd(ledger, "127.0.0.1", *ports)
    sampler = ZmqSamplerEnd("s0", "127.0.0.1", *ports)
    try:
        leases = sampler.lease(2, timeout_s=10)
        sampler.send(group(leases[0]), timeout_s=10)
        assert len(trainer.receive(1, timeout_s=10)) == 1
        state = ledger.state_dict()
        trainer.close()
        with pytest.raises(TransportTimeout, match="sync channel .* no reply within 0.5s"):
            sampler.lease(1, timeout_s=0.5)
        restored = PromptLedger(6, seed=0)
        restored.load_state_dict(state)
        trainer = ZmqTrainerEnd(restored, "127.0.0.1", *ports)  # same ports: the sampler finds it again
        sampler.send(group(leases[1]), timeout_s=20)
        got = trainer.receive(1, timeout_s=20)
        assert [g[0].prompt_index for g in got] == [leases[1].prompt_index]
        assert sampler.lease(1, timeout_s=20)
    finally:
        sampler.close()
        trainer.close()


def start_sampler(sampler_id, ports, delay, log):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.serving.sampler_proc",
            "--id",
            sampler_id,
            "--data-port",
            str(ports[0]),
            "--sync-port",
            str(ports[1]),
            "--delay",
            str(delay),
        ],  # fmt: skip
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def test_two_samplers_one_killed_mid_run(ports, tmp_path):
    num_prompts, epochs = 24, 2
    ledger = PromptLedger(num_prompts, seed=7, num_epochs=epochs)
    trainer = ZmqTrainerEnd(ledger, "127.0.0.1", *ports, hwm=4)
    trainer.publish_weights(1, {"w": torch.ones(4)})
    logs = {k: open(tmp_path / f"sampler-{k}.log", "w") for k in "AB"}  # noqa: SIM115 (closed in finally)
    procs = {k: start_sampler(k, ports, 0.1, logs[k]) for k in "AB"}  # one thread each: OMP_NUM_THREADS=1
    accepted, by_sampler, version = [], {"A": 0, "B": 0}, 1
    killed_in_flight = None
    try:
        deadline = time.monotonic() + 180
        while ledger.epochs_closed < epochs:
            assert time.monotonic() < deadline, (ledger.state_dict(), trainer.stats)
            for g in trainer.receive(4, timeout_s=0.5):
                accepted.append((g[0].epoch, g[0].prompt_index))
                by_sampler[g[0].sampler_id] += 1
                assert g[0].weight_version >= 1
            if killed_in_flight is None and by_sampler["A"] >= 3:
                procs["A"].send_signal(signal.SIGKILL)  # mid-run, with prompts in flight
                procs["A"].wait()
                killed_in_flight = ledger.in_flight("A")
                version += 1
                trainer.publish_weights(version, {"w": torch.full((4,), float(version))})
            if killed_in_flight is not None and "A" in trainer.silent_samplers(2.0):
                trainer.sampler_dead("A")
        assert procs["B"].poll() is None, (tmp_path / "sampler-B.log").read_text()
        assert sorted(accepted) == [(e, i) for e in range(epochs) for i in range(num_prompts)]  # none lost, none twice
        assert killed_in_flight, "the killed sampler had prompts in flight"
        assert ledger.reissued >= 1 and trainer.stats.dropped_malformed == 0
        print(f"A delivered {by_sampler['A']}, B {by_sampler['B']}; re-issued {ledger.reissued}, "
              f"duplicates dropped {trainer.stats.dropped_duplicate}")  # fmt: skip
    finally:
        stop_all(procs.values(), 10)
        for f in logs.values():
            f.close()
        trainer.close()


def test_restored_ledger_reissues_the_previous_runs_leases(ports):
    """A resumed trainer loads the checkpoint's ledger: the samplers holding leases in it are declared dead, their
    unfinished prompts go first to the next lease, and a late group from the old run still counts once."""
    old = PromptLedger(8, seed=3)
    held = old.issue("A", 3) + old.issue("B", 2)
    assert old.complete("A", held[0].prompt_index, held[0].epoch)
    trainer = ZmqTrainerEnd(PromptLedger(8, seed=3), "127.0.0.1", *ports)
    try:
        assert sorted(trainer.restore_ledger(old.state_dict())) == ["A", "B"]
        assert trainer.ledger.in_flight() == []
        assert trainer.ledger.issue("C", 4) == held[1:]  # the 4 unfinished, in their order
        assert trainer.ledger_state()["in_flight"] == {"C": [[x.prompt_index, x.epoch] for x in held[1:]]}
    finally:
        trainer.close()


def test_max_in_flight_bounds_the_leases(ports):
    trainer = ZmqTrainerEnd(PromptLedger(8, seed=3), "127.0.0.1", *ports)
    trainer.max_in_flight = 3
    sampler = ZmqSamplerEnd("s0", "127.0.0.1", *ports)
    try:
        first = sampler.lease(2, timeout_s=10)
        assert len(first) == 2 and len(sampler.lease(5, timeout_s=10)) == 1 and sampler.lease(1, timeout_s=10) == []
        sampler.send(group(first[0]), timeout_s=10)
        got = []
        while not got:
            got += trainer.receive(1, timeout_s=10)
        assert len(sampler.lease(5, timeout_s=10)) == 1  # the received prompt freed one
    finally:
        sampler.close()
        trainer.close()


def test_resumed_trainer_replaces_a_previous_runs_newer_weights(ports):
    """A trainer killed after publishing version 3 resumes from its version-2 checkpoint: a sampler that outlived it
    (holding version 3) gets version 2 back, its version-3 group is refused (its prompt re-issued), and its group
    sampled with version 2 before the kill, for a prompt in flight at the checkpoint, still counts once."""
    old = PromptLedger(8, seed=3)
    held = old.issue("A", 3)
    state = old.state_dict()  # the checkpoint: A holds 3 prompts
    trainer = ZmqTrainerEnd(PromptLedger(8, seed=3), "127.0.0.1", *ports)
    sampler = ZmqSamplerEnd("A", "127.0.0.1", *ports)
    try:
        trainer.restore_ledger(state)
        weights = {"w": torch.full((2,), 2.0)}
        trainer.publish_weights(2, weights)
        update = sampler.fetch_weights(3, timeout_s=10)  # the sampler holds the dead run's version 3
        assert update.version == 2 and torch.equal(update.tensors["w"], weights["w"])
        assert sampler.fetch_weights(2, timeout_s=10) is None
        sampler.send(group(held[0], "A", version=3), timeout_s=10)  # past the checkpoint: another lineage
        sampler.send(group(held[1], "A", version=2), timeout_s=10)  # the checkpoint's weights: trained
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 1 or trainer.stats.dropped_foreign == 0:
            assert time.monotonic() < deadline
            got += trainer.receive(2, timeout_s=1)
        assert [g[0].prompt_index for g in got] == [held[1].prompt_index]
        assert trainer.stats.dropped_foreign == 2 and "previous run's weights" in trainer.stats.last_reason
        reissued = trainer.ledger.issue("B", 8)
        assert reissued[:2] == [held[0], held[2]]  # the refused prompt and the one never delivered, first
        assert held[1] not in reissued
    finally:
        sampler.close()
        trainer.close()


def test_run_id_refuses_a_previous_runs_group_of_a_version_published_again(ports):
    """Version numbers repeat across runs (a resume republishes from its checkpoint's version); the run id does not.
    A sampler holding run 1's version 1 fetches run 2's version 1 (same number, other run), and its group stamped
    with run 1 is refused and its prompt re-issued, while the group sampled with run 2's weights is trained."""
    weights = {"w": torch.zeros(2)}
    first = ZmqTrainerEnd(PromptLedger(8, seed=3), "127.0.0.1", *ports)
    first.publish_weights(1, weights)
    run1 = first.run_id
    sampler = ZmqSamplerEnd("A", "127.0.0.1", *ports)
    try:
        assert sampler.fetch_weights(None, timeout_s=10).run_id == run1
        assert sampler.fetch_weights(1, timeout_s=10, have_run=run1) is None
        state = first.ledger_state()
        first.close()
        second = ZmqTrainerEnd(PromptLedger(8, seed=3), "127.0.0.1", *ports)
        try:
            assert second.run_id != run1
            second.restore_ledger(state)
            second.publish_weights(1, {"w": torch.ones(2)})
            update = sampler.fetch_weights(1, timeout_s=10, have_run=run1)  # same version, another run
            assert update.version == 1 and update.run_id == second.run_id and torch.equal(update.tensors["w"],
                                                                                             torch.ones(2))  # fmt: skip
            assert sampler.fetch_weights(1, timeout_s=10, have_run=second.run_id) is None
            a, b = sampler.lease(2, timeout_s=10)
            sampler.send(group(a, "A", version=1, run_id=run1), timeout_s=10)
            sampler.send(group(b, "A", version=1, run_id=second.run_id), timeout_s=10)
            got = []
            deadline = time.monotonic() + 10
            while len(got) < 1 or second.stats.dropped_foreign == 0:
                assert time.monotonic() < deadline
                got += second.receive(2, timeout_s=1)
            assert [g[0].prompt_index for g in got] == [b.prompt_index]
            assert second.stats.dropped_foreign == 2 and f"run {run1}, not this trainer's" in second.stats.last_reason
            assert second.ledger.issue("B", 1) == [a]  # the refused prompt, first
        finally:
            second.close()
    finally:
        sampler.close()
