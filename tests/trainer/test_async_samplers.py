"""`mindrl-sampler` processes (HF engine, the tiny model) feeding the bounded intake over ZeroMQ on
loopback: the first is SIGKILLed after the first batch and the second takes over; the dead one's in-flight prompts are
re-issued, and every prompt is trained exactly once, none more than max_staleness versions old."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from mindrl.data.prompt_dataset import PromptDataset
from mindrl.data.prompt_ledger import PromptLedger
from mindrl.launch import free_port
from mindrl.serving.transport import ZmqTrainerEnd
from mindrl.trainer.pipeline.intake import Intake, make_batch
from tests.procs import stop_all
from tests.trainer.rl_helpers import ROOT

pytestmark = pytest.mark.slow

N = 2


def start(sampler_id, assets, ports, log, n=N, max_tokens=8, extra=()):
    cmd = [sys.executable, "-m", "mindrl.cli.sampler", "--sampler-id", sampler_id, "--host", "127.0.0.1",
           "--data-port", str(ports[0]), "--sync-port", str(ports[1]), "--model", str(assets / "hf"),
           "--data-path", str(assets / "data" / "train"), "--max-prompt-length", "64", "--n", str(n),
           "--max-tokens", str(max_tokens), "--lease-size", "2", "--seed", "11", "--idle-exit", "60", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def weights(assets, version):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(assets / "hf"), dtype=torch.float32)
    g = torch.Generator().manual_seed(version)
    return {k: v.detach() + 1e-3 * version * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def test_two_sampler_processes_one_killed(assets, tmp_path):
    num_prompts = len(PromptDataset(str(assets / "data" / "train"), 64, ("labels",)))
    ports = (free_port(), free_port())
    ledger = PromptLedger(num_prompts, seed=5, num_epochs=1)
    trainer = ZmqTrainerEnd(ledger, "127.0.0.1", *ports, hwm=2)
    intake = Intake(trainer, groups=4, max_staleness=1, timeout_s=180, poll_s=0.5)
    logs = {k: open(tmp_path / f"sampler-{k}.log", "w") for k in "AB"}  # noqa: SIM115 (closed in finally)
    procs = {"A": start("A", assets, ports, logs["A"])}  # B joins once A is dead
    trained, by_sampler, killed_in_flight = [], {"A": 0, "B": 0}, None
    try:
        version = 1
        trainer.publish_weights(version, weights(assets, version))
        while len(trained) < num_prompts:
            groups, metrics = intake.take(version)
            assert metrics["async/staleness/max"] <= 1
            batch = make_batch(groups, N, pad_token_id=0)
            assert len(batch) == 4 * N and set(batch.rows_meta["weight_version"]) <= {version - 1, version}
            for g in groups:
                trained.append((g[0].epoch, g[0].prompt_index))
                by_sampler[g[0].sampler_id] += 1
                assert g[0].rewards == {} and g[0].finish_reason in ("stop", "length")
            version += 1
            trainer.publish_weights(version, weights(assets, version))
            if killed_in_flight is None:  # after the first batch, all A's: kill it mid-run
                procs["A"].send_signal(signal.SIGKILL)
                procs["A"].wait()
                killed_in_flight = ledger.in_flight("A")
                deadline = time.monotonic() + 30
                while "A" not in trainer.silent_samplers(3.0):  # the trainer's liveness check
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
                trainer.sampler_dead("A")  # its in-flight prompts are re-issued
                procs["B"] = start("B", assets, ports, logs["B"])
        assert procs["B"].poll() is None, (tmp_path / "sampler-B.log").read_text()
        assert sorted(trained) == [(0, i) for i in range(num_prompts)]  # none lost, none twice
        assert by_sampler["A"] >= 4 and by_sampler["B"] > 0
        # each prompt A held when it died was re-issued, or A's group for it (sent before the kill) came first
        late = by_sampler["A"] - 4
        assert ledger.reissued + late >= len(killed_in_flight)
        assert trainer.stats.dropped_malformed == 0
        print(
            f"A delivered {by_sampler['A']}, B {by_sampler['B']}; A's prompts in flight when killed "
            f"{len(killed_in_flight)}, re-issued {ledger.reissued}, stale dropped {trainer.stats.dropped_stale}"
        )
    finally:
        stop_all(procs.values(), 30)
        for f in logs.values():
            f.close()
        trainer.close()
