"""Two samplers (each a real HFEngine on the tiny model) feeding one trainer over ZeroMQ on loopback: they fetch the
published weights, every prompt arrives exactly once with the version that sampled it, and each group is what the
engine generates for that prompt's seed with those weights (behaviour logprobs bit for bit)."""

from __future__ import annotations

import threading

import pytest
import torch

from mindrl.data.prompt_ledger import Lease, PromptLedger
from mindrl.launch import free_port
from mindrl.rollout import RolloutConfig, SamplingConfig
from mindrl.serving.experience import RUN_ID
from mindrl.serving.sampler import Sampler
from mindrl.serving.transport import ZmqSamplerEnd, ZmqTrainerEnd
from mindrl.trainer.pipeline.intake import Intake

SAMPLING = SamplingConfig(max_tokens=6, temperature=1.0, n=2)
PROMPTS = [[3 + i, 5, 7 + 2 * i, 11] for i in range(6)]


_RNG = threading.Lock()


class OneAtATime:
    """HFEngine's seeded sampling runs on torch's process-wide RNG: two threads of one process must take turns
    (samplers are processes or actors in a deployment)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, *args, **kw):
        with _RNG:
            return self.engine.generate(*args, **kw)

    def load_weights(self, weights):
        self.engine.load_weights(weights)

    def shutdown(self):
        self.engine.shutdown()


def engine(model_dir):
    from mindrl.rollout.hf_engine import HFEngine

    return OneAtATime(HFEngine(RolloutConfig(model=model_dir, dtype="float32", max_model_len=64, max_num_seqs=4)))


def test_two_samplers_feed_one_trainer(tiny_models):
    torch.set_num_threads(1)
    model = tiny_models["untied"]
    ref = engine(model)
    g = torch.Generator().manual_seed(0)
    weights = {
        k: v.detach() + 0.01 * torch.randn(v.shape, generator=g) for k, v in ref.engine.model.state_dict().items()
    }
    ref.load_weights(weights.items())
    ports = (free_port(), free_port())
    ledger = PromptLedger(len(PROMPTS), seed=1, num_epochs=1)
    trainer = ZmqTrainerEnd(ledger, "127.0.0.1", *ports, hwm=4)
    stop, threads, samplers = threading.Event(), [], []
    try:
        for sid in ("s0", "s1"):
            s = Sampler(sid, ZmqSamplerEnd(sid, "127.0.0.1", *ports), engine(model), PROMPTS.__getitem__,
                        SAMPLING, seed=5)  # fmt: skip
            samplers.append(s)
            threads.append(threading.Thread(target=s.run, args=(stop,), daemon=True))
        for t in threads:
            t.start()
        trainer.publish_weights(1, weights)
        intake = Intake(trainer, groups=3, max_staleness=0, timeout_s=120, poll_s=0.5)
        groups = []
        for _ in range(2):
            got, metrics = intake.take(1)
            groups += got
            assert metrics["async/staleness/max"] == 0
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        for s in samplers:
            s.end.close()
            s.engine.shutdown()
        trainer.close()
    assert sorted(g[0].prompt_index for g in groups) == list(range(len(PROMPTS)))  # each prompt once
    assert ledger.epochs_closed == 1
    for group in groups:
        lease = Lease(group[0].prompt_index, group[0].epoch)
        assert all(e.weight_version == 1 and len(group) == SAMPLING.n for e in group)
        assert {e.meta[RUN_ID] for e in group} == {trainer.run_id}  # stamped with the run whose weights sampled it
        want = ref.generate([PROMPTS[lease.prompt_index]], SAMPLING, seeds=[samplers[0].seed_of(lease)])[0]
        for e, w in zip(group, want):
            assert e.response_ids.tolist() == list(w.token_ids)
            assert e.behaviour_logprobs.tolist() == [float(x) for x in w.logprobs]
            assert e.rewards == {}  # the trainer scores: one place applies its verifiers, weights and timeouts
    ref.shutdown()


def test_groups_whose_send_times_out_are_sent_first_next_round(tiny_models):
    """The data channel has no trainer behind it (a trainer restarting): the round's leased prompts are generated and
    kept, the round raises TransportTimeout, and once a trainer reads again they are sent before anything new is
    leased; no leased prompt is lost."""
    import zmq

    from mindrl.serving.experience import decode
    from mindrl.serving.transport import TransportTimeout

    torch.set_num_threads(1)
    sync_port, data_port = free_port(), free_port()
    trainer = ZmqTrainerEnd(PromptLedger(len(PROMPTS), seed=1), "127.0.0.1", free_port(), sync_port)
    end = ZmqSamplerEnd("s0", "127.0.0.1", data_port, sync_port)  # nothing bound on data_port yet
    s = Sampler("s0", end, engine(tiny_models["untied"]), PROMPTS.__getitem__, SAMPLING, lease_size=2,
                timeout_s=0.5)  # fmt: skip
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        trainer.publish_weights(0, dict(s.engine.engine.model.state_dict()))
        with pytest.raises(TransportTimeout, match="no room after 0.5s"):
            s.step()
        held = trainer.ledger.in_flight("s0")
        assert len(held) == 2 and [g[0].prompt_index for g in s.unsent] == [x.prompt_index for x in held]
        pull.bind(f"tcp://127.0.0.1:{data_port}")  # a trainer reads the data channel again
        s.timeout_s = 30
        assert s.step() == 4  # the 2 kept groups first, then the round's 2 new prompts
        got = [decode(pull.recv()) for _ in range(4)]
        assert [g[0].prompt_index for g in got[:2]] == [x.prompt_index for x in held] and not s.unsent
    finally:
        pull.close(linger=0)
        ctx.term()
        end.close()
        s.engine.shutdown()
        trainer.close()


def test_mindrl_sampler_refuses_verifier(capsys):
    """A sampler does not score (the trainer does, with its rl_config.verifier_function): --verifier is refused with
    that reason, before anything starts."""
    from mindrl.cli.sampler import main

    with pytest.raises(SystemExit) as e:
        main(["--sampler-id", "s0", "--host", "127.0.0.1", "--model", "m", "--data-path", "d", "--verifier", "acc"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--verifier acc: samplers do not score" in err and "rl_config.verifier_function" in err
