"""Two samplers (each a real HFEngine on the tiny model) feeding one trainer over ZeroMQ on loopback: they fetch the
published weights, every prompt arrives exactly once with the version that sampled it, and each group is what the
engine generates for that prompt's seed with those weights (behaviour logprobs bit for bit)."""

from __future__ import annotations

import threading

import torch

from mindrl.data.prompt_ledger import Lease, PromptLedger
from mindrl.launch import free_port
from mindrl.rollout import RolloutConfig, SamplingConfig
from mindrl.serving.sampler import Sampler
from mindrl.serving.transport import ZmqSamplerEnd, ZmqTrainerEnd
from mindrl.trainer.async_intake import Intake

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


def score(samples, label):
    return [{"len": float(len(s.token_ids)), "label": float(label)} for s in samples]


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
            s = Sampler(sid, ZmqSamplerEnd(sid, "127.0.0.1", *ports), engine(model), lambda i: (PROMPTS[i], i),
                        SAMPLING, score, seed=5)  # fmt: skip
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
        want = ref.generate([PROMPTS[lease.prompt_index]], SAMPLING, seeds=[samplers[0].seed_of(lease)])[0]
        for e, w in zip(group, want):
            assert e.response_ids.tolist() == list(w.token_ids)
            assert e.behaviour_logprobs.tolist() == [float(x) for x in w.logprobs]
            assert e.rewards == {"len": float(len(w.token_ids)), "label": float(lease.prompt_index)}
    ref.shutdown()
