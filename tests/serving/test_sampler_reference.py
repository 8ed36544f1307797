"""A sampler holding the reference model (rl_config.async_sampler_ref): each experience carries its response's
reference logprobs, computed as the trainer's reference pass does (log softmax(logits / temperature)), through the
wire format bit-exactly and into the RL batch as ref_log_prob."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mindrl.data.prompt_ledger import Lease
from mindrl.rollout import RolloutConfig, SamplingConfig
from mindrl.serving.experience import REF_SECONDS, decode, encode
from mindrl.serving.reference import HFReference
from mindrl.serving.sampler import Sampler
from mindrl.trainer.pipeline.intake import make_batch

SAMPLING = SamplingConfig(max_tokens=8, temperature=0.7, n=3)
PROMPTS = [[3 + i, 5, 7 + 2 * i, 11, 13 + i][: 3 + i % 3] for i in range(4)]


def test_sampler_sends_the_reference_logprobs(tiny_models):
    from mindrl.rollout.hf_engine import HFEngine

    torch.set_num_threads(1)
    model = tiny_models["untied"]
    engine = HFEngine(RolloutConfig(model=model, dtype="float32", max_model_len=64, max_num_seqs=4))
    ref32 = HFReference(model, SAMPLING.temperature)
    ref64 = HFReference(model, SAMPLING.temperature, dtype=torch.float64)
    engine.load_weights(ref32.model.state_dict().items())  # as the trainer's published version 0 would
    s = Sampler("s0", None, engine, PROMPTS.__getitem__, SAMPLING, seed=3, version=0, reference=ref32.logprobs)
    try:
        groups = s.sample_many([Lease(i, 0) for i in range(len(PROMPTS))])
    finally:
        engine.shutdown()
    # The reference here is the engine's own model, so the behaviour logprobs (the engine's fp32 decode, with its
    # KV cache) are a second fp32 computation of the same numbers: their error against fp64 is the measured gap.
    ref_err, engine_err = 0.0, 0.0
    for g in groups:
        prompt, responses = g[0].prompt_ids.tolist(), [e.response_ids.tolist() for e in g]
        assert g[0].meta[REF_SECONDS] > 0
        exact = ref64.logprobs(prompt, responses)
        for e, want, x in zip(g, ref32.logprobs(prompt, responses), exact):
            assert e.ref_logprobs.dtype == np.float32 and e.ref_logprobs.shape == (e.response_len,)
            assert np.array_equal(e.ref_logprobs, want)  # one group per forward, whatever shared the engine call
            ref_err = max(ref_err, float(np.abs(e.ref_logprobs - x).max(initial=0.0)))
            engine_err = max(engine_err, float(np.abs(e.behaviour_logprobs - x).max(initial=0.0)))
    print(f"max |error| against fp64: sampler reference {ref_err:.3g}, engine's behaviour logprobs {engine_err:.3g}")
    # measured: 1.1e-6 and 9.7e-7, both fp32 rounding; the reference is within twice the engine's error
    assert 0 < engine_err and ref_err <= 2 * engine_err
    # over the wire bit-exactly, and into the batch as ref_log_prob (padding 0)
    back = [decode(encode(g)) for g in groups]
    for g, b in zip(groups, back):
        for e, f in zip(g, b):
            assert f.ref_logprobs.tobytes() == e.ref_logprobs.tobytes()
    batch = make_batch(back, SAMPLING.n, pad_token_id=0)
    rows = [e for g in back for e in g]
    for i, e in enumerate(rows):
        assert batch["ref_log_prob"][i, : e.response_len].tolist() == e.ref_logprobs.tolist()
        assert not batch["ref_log_prob"][i, e.response_len :].any()


def test_reference_of_an_empty_response_is_empty(tiny_models):
    torch.set_num_threads(1)
    ref = HFReference(tiny_models["untied"])
    got = ref.logprobs([3, 5, 7], [[], [9, 4]])
    assert got[0].shape == (0,) and got[1].shape == (2,) and (got[1] <= 0).all()
    assert [x.shape for x in ref.logprobs([3, 5], [[], []])] == [(0,), (0,)]
    with pytest.raises(ValueError, match="temperature > 0"):
        HFReference(tiny_models["untied"], temperature=0.0)
