"""HFEngine (transformers generate): the same parity and sampling checks as VllmEngine."""

from __future__ import annotations

import pytest
import torch

from mindrl.rollout import RolloutConfig, SamplingConfig
from tests.rollout import helpers
from tests.rollout.helpers import PROMPTS

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_engine(rollout_models, weights):
    from mindrl.rollout.hf_engine import HFEngine

    rng = torch.get_rng_state()
    engine = HFEngine(RolloutConfig(model=rollout_models["a"], dtype="float32", max_model_len=256, max_num_seqs=4))
    assert torch.equal(rng, torch.get_rng_state())  # dummy init ran on its own RNG stream
    engine.load_weights(weights["a"].items())
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_tokens=16, temperature=1.0, n=2, seed=3),
        SamplingConfig(max_tokens=16, temperature=0.7, n=2, seed=4),
        SamplingConfig(max_tokens=16, temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, n=3, seed=5),
    ],
    ids=["t1", "t0.7", "t0.7-topk-topp-minp"],
)
def test_logprobs_equal_hf_forward(hf_engine, hf_models, sampling):
    # 3 prompts * n rows > max_num_seqs=4: also exercises chunking; prompts of different lengths: left padding.
    out = hf_engine.generate(PROMPTS, sampling)
    assert [len(s) for s in out] == [sampling.n] * len(PROMPTS)
    assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, out, sampling) <= TOL
    if sampling.temperature != 1.0:
        assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, out, SamplingConfig(max_tokens=16)) > 1e-2


def test_a_prompt_near_max_model_len_gets_the_tokens_left(hf_engine, hf_models):
    """As vLLM's check_stop: prompt + max_tokens past max_model_len=256 stops at 256 tokens (finish_reason 'length'),
    the same greedy tokens as an uncapped HF generate; the other prompts in the call get max_tokens; a prompt of
    max_model_len tokens is refused, as vLLM refuses it."""
    long_prompt = (PROMPTS[0] * 256)[:250]
    short, long_ = hf_engine.generate([PROMPTS[1], long_prompt], SamplingConfig(max_tokens=10, ignore_eos=True,
                                                                               temperature=0.0))  # fmt: skip
    assert len(short[0].token_ids) == 10 and long_[0].token_ids == helpers.hf_greedy(hf_models["a"], long_prompt, 6)
    assert short[0].finish_reason == long_[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"prompt 0 has 256 tokens: max_model_len=256 leaves no room"):
        hf_engine.generate([(PROMPTS[0] * 256)[:256]], SamplingConfig(max_tokens=1))


def test_truncation_restricts_the_support(hf_engine, hf_models):
    """top_k=3: every sampled token is among the 3 most likely under the HF forward."""
    sampling = SamplingConfig(max_tokens=12, temperature=1.5, top_k=3, n=4, seed=0)
    for prompt, samples in zip(PROMPTS, hf_engine.generate(PROMPTS, sampling)):
        for s in samples:
            with torch.no_grad():
                logits = hf_models["a"](torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
            top3 = logits.topk(3, dim=-1).indices
            assert all(t in row.tolist() for t, row in zip(s.token_ids, top3))


def test_greedy_matches_hf_greedy_with_left_padding(hf_engine, hf_models):
    out = hf_engine.generate(PROMPTS, SamplingConfig(max_tokens=12, temperature=0.0, logprobs=2))
    for prompt, (s,) in zip(PROMPTS, out):
        assert s.token_ids == helpers.hf_greedy(hf_models["a"], prompt, 12)
        assert s.finish_reason == "length" and len(s.top_logprobs) == 12
        assert all(max(d, key=d.get) == t for d, t in zip(s.top_logprobs, s.token_ids))


def test_load_weights_switches_model(hf_engine, hf_models, weights):
    sampling = SamplingConfig(max_tokens=8, temperature=0.0)
    try:
        hf_engine.load_weights(weights["b"].items())
        out = hf_engine.generate(PROMPTS[:1], sampling)
        assert out[0][0].token_ids == helpers.hf_greedy(hf_models["b"], PROMPTS[0], 8)
        assert out[0][0].token_ids != helpers.hf_greedy(hf_models["a"], PROMPTS[0], 8)
    finally:
        hf_engine.load_weights(weights["a"].items())
    with pytest.raises(KeyError, match=r"'model.layers.0.self_attn.q_proj.weigth' is not a weight .* close: \['model"):
        hf_engine.load_weights([("model.layers.0.self_attn.q_proj.weigth", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(3,\), the model expects \(1024, 128\)"):
        hf_engine.load_weights([("lm_head.weight", torch.zeros(3))])


def test_n_samples_and_seeds(hf_engine):
    sampling = SamplingConfig(max_tokens=10, temperature=1.0, n=3, seed=7)
    rng = torch.get_rng_state()
    first = hf_engine.generate(PROMPTS[:2], sampling)
    assert first == hf_engine.generate(PROMPTS[:2], sampling)
    assert len({tuple(s.token_ids) for s in first[0]}) == 3
    assert first != hf_engine.generate(PROMPTS[:2], SamplingConfig(max_tokens=10, temperature=1.0, n=3, seed=8))
    unseeded = SamplingConfig(max_tokens=10, temperature=1.0, n=3)
    assert hf_engine.generate(PROMPTS[:2], unseeded) != hf_engine.generate(PROMPTS[:2], unseeded)
    assert torch.equal(rng, torch.get_rng_state())


def test_stop_tokens_strings_and_text(hf_engine):
    from transformers import AutoTokenizer

    greedy = hf_engine.generate(PROMPTS[:1], SamplingConfig(max_tokens=12, temperature=0.0, detokenize=True))[0][0]
    ids = greedy.token_ids
    k = next(i for i in range(2, 12) if ids[i] not in ids[:i])
    s = hf_engine.generate(PROMPTS[:1], SamplingConfig(max_tokens=12, temperature=0.0, stop_token_ids=[ids[k]]))[0][0]
    assert (s.token_ids, s.finish_reason, s.stop_reason, len(s.logprobs)) == (ids[: k + 1], "stop", ids[k], k + 1)
    tok = AutoTokenizer.from_pretrained(hf_engine.config.model)
    assert greedy.text == tok.decode(ids, skip_special_tokens=True)
    stop = greedy.text[len(greedy.text) // 2 :][:3]
    s = hf_engine.generate(PROMPTS[:1], SamplingConfig(max_tokens=12, temperature=0.0, stop=[stop], detokenize=True))[
        0
    ][0]
    assert s.finish_reason == "stop" and s.stop_reason == stop and stop not in s.text
    assert s.token_ids == ids[: len(s.token_ids)] and len(s.token_ids) < 12


def test_no_tokenizer_dir_and_checkpoint_sampling_defaults(rollout_models, weights, hf_models):
    """Token ids only (no tokenizer files); the dir's generation_config.json (top_k=2, T=0.1) is ignored."""
    from mindrl.rollout.hf_engine import HFEngine

    engine = HFEngine(
        RolloutConfig(model=rollout_models["a_notok"], dtype="float32", max_model_len=128, load_format="auto")
    )
    sampling = SamplingConfig(max_tokens=10, temperature=1.0, n=4, seed=1)
    out = engine.generate(PROMPTS, sampling)
    assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, out, sampling) <= TOL
    # Under top_k=2 / T=0.1 the logprobs would be near 0; at T=1 over 1024 tokens they are not.
    assert max(lp for samples in out for s in samples for lp in s.logprobs) < -1.0
    with pytest.raises(ValueError, match="need a tokenizer"):
        engine.generate(PROMPTS, SamplingConfig(max_tokens=4, detokenize=True))
    with pytest.raises(ValueError, match="infer_tensor_parallel_size must be 1"):
        HFEngine(RolloutConfig(model=rollout_models["a_notok"], infer_tensor_parallel_size=2))
