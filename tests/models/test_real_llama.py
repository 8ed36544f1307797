"""Llama with SmolLM2's head structure (9 query / 3 KV heads, head_dim 64, tied embeddings) through everything:
HF -> megatron at TP1 / TP3 / PP2 / PP3 and back bit-exact, `mindrl-convert check` (fp64 vs HF's own fp32 gap) passes
and catches one slightly wrong weight, TP2 refused, vLLM's logprobs after a reshard equal megatron's. A tiny random
model in the normal suite (every layout); the real SmolLM2-135M-Instruct (tools/get_model.py) in the slow tests."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mindrl.checkpoint import convert
from mindrl.launch import RankPool
from mindrl.models.hf_config import ModelConfigError
from tests.checkpoint.test_convert import assert_bit_exact

LAYOUTS = [(1, 1), (3, 1), (1, 2), (1, 3)]
TOL = 1e-4  # the issue's bound on |vLLM - megatron| logprobs, as tests/workers/test_hybrid_engine.py


@pytest.fixture(scope="module")
def pool3():
    """TP3 / PP3 need a multiple of 3 ranks: the shared pool has 4."""
    with RankPool(3, timeout_s=600) as p:
        yield p


def _pool_for(tp: int, pp: int, pool, pool3):
    return pool3 if (tp * pp) % 3 == 0 or tp * pp == 1 else pool


@pytest.fixture(scope="module")
def smol_tiny(tmp_path_factory) -> str:
    """SmolLM2's heads (9 / 3, head_dim 64, hidden 576) and tied embeddings; 6 layers (PP2, PP3), a small FFN and
    vocabulary that TP3 divides, random weights of a real model's initial scale (std 0.02)."""
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("smol_tiny") / "hf"), arch="llama", num_heads=9, num_kv_heads=3, hidden_size=576,
        intermediate_size=384, num_layers=6, vocab_size=1020, tie_word_embeddings=True, rope_theta=1e5, seed=45,
        init_std=0.02,
    )  # fmt: skip


def _convert_check_round_trip(hf: str, tmp, tp: int, pp: int, pool) -> convert.CheckResult:
    convert.hf2mcore(hf, str(tmp / "mcore"), tp, pp, pool=pool)
    res = convert.check(hf, str(tmp / "mcore"), pool=pool)
    print(
        f"TP{tp} PP{pp}: max |megatron - HF| in fp64 {res.max_abs_diff:.3g}, HF fp32-vs-fp64 gap {res.reference_gap:.3g}"
        f", max |logit| {res.max_abs_output:.3g}"
    )
    assert res.ok and res.tol == convert.GAP_FRACTION * res.reference_gap
    assert res.max_abs_output > 0.1  # non-trivial logits: a mapping error cannot hide
    convert.mcore2hf(str(tmp / "mcore"), str(tmp / "back"), pool=pool)
    assert_bit_exact(hf, str(tmp / "back"))
    return res


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_tiny_smol_layouts_round_trip_and_check(smol_tiny, pool, pool3, tmp_path, tp, pp):
    _convert_check_round_trip(smol_tiny, tmp_path, tp, pp, _pool_for(tp, pp, pool, pool3))


def test_tp2_is_refused_with_the_reason(smol_tiny, tmp_path):
    with pytest.raises(ModelConfigError) as e:
        convert.hf2mcore(smol_tiny, str(tmp_path / "m"), 2, 1)
    msg = str(e.value)
    assert "TP=2 does not divide num_attention_heads=9" in msg and "TP=2 does not divide num_key_value_heads=3" in msg
    assert not (tmp_path / "m").exists()


def test_check_catches_one_slightly_wrong_weight(smol_tiny, pool3, tmp_path):
    """One element of one matrix off by 1e-3 of its row's mean |w|: a logit change below HF's own fp32 error (no fp32
    comparison could see it), far above the fp64 agreement of the correct checkpoint."""
    convert.hf2mcore(smol_tiny, str(tmp_path / "mcore"), 3, 1, pool=pool3)
    bad = str(tmp_path / "bad")
    shutil.copytree(smol_tiny, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    w = tensors["model.layers.3.mlp.down_proj.weight"]
    w[7, 11] += 1e-3 * w[7].abs().mean()
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    good = convert.check(smol_tiny, str(tmp_path / "mcore"), pool=pool3)
    wrong = convert.check(bad, str(tmp_path / "mcore"), pool=pool3)
    print(f"good {good.max_abs_diff:.3g}, one weight off {wrong.max_abs_diff:.3g}, fp32 gap {wrong.reference_gap:.3g}")
    assert good.ok and not wrong.ok
    assert wrong.max_abs_diff < wrong.reference_gap  # invisible in fp32


def test_tiny_smol_vllm_logprobs_match_megatron_after_a_reshard(smol_tiny, pool3, tmp_path):
    """Trained at TP3 (two optimizer steps), resharded into vLLM at TP1: the sampled tokens' logprobs agree."""
    from mindrl.workers.hybrid_check import CheckSettings, check_rank

    convert.hf2mcore(smol_tiny, str(tmp_path / "m"), 3, 1, pool=pool3)
    settings = CheckSettings(3, 1, 1, steps=1, cycles=2, max_tokens=12)
    results = pool3.run(check_rank, str(tmp_path / "m"), smol_tiny, settings)
    gaps = [c["rollout/logprob_diff_max"] for c in results[0]["cycles"]]
    print(f"vLLM vs megatron max |logprob diff| per cycle: {gaps}")
    assert max(gaps) <= TOL and results[0]["cycles"][0]["generated_tokens"] > 0


# ------------------------------------------------------------------------------------ the real SmolLM2 (slow)
@pytest.mark.slow
def test_smollm2_model_file_and_template_match_the_checkpoint(smollm2_hf, tmp_path):
    """get_model again is a no-op; configs/model/smollm2_135m.yaml describes the checkpoint (the preflight's own
    comparison) and the `smollm2` template renders exactly the tokenizer's chat template."""
    import transformers
    from omegaconf import OmegaConf

    from mindrl.checkpoint import mcore_ckpt
    from mindrl.config.errors import Collector
    from mindrl.config.model import ModelArchConfig
    from mindrl.data.templates import get_template
    from mindrl.models.hf_config import ModelSpec
    from mindrl.preflight import _check_checkpoint
    from tools.get_model import get_model

    assert get_model("smollm2", log=None) == smollm2_hf
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "configs", "model", "smollm2_135m.yaml")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)["smollm2_135m"]  # as the config loader reads it
    col = Collector()
    arch = ModelArchConfig.from_dict({**raw, "name": "smollm2_135m"}, "model.smollm2_135m", col)
    # A checkpoint description of the real model (weights are not needed for this comparison).
    spec = ModelSpec.from_hf_dir(smollm2_hf)
    it_dir = mcore_ckpt.iteration_dir(str(tmp_path / "m"), mcore_ckpt.RELEASE)
    os.makedirs(it_dir)
    mcore_ckpt.write_model_meta(it_dir, spec, "actor", 1, 1, "float32")
    mcore_ckpt.write_tracker(str(tmp_path / "m"), mcore_ckpt.RELEASE)
    _check_checkpoint(col, "actor_config.load", str(tmp_path / "m"), arch, value_model=False)
    assert not col.issues, col.issues
    assert (spec.rope_theta, spec.norm_eps, spec.tie_word_embeddings) == (raw["rotary_base"], 1e-5, True)

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    t = get_template("smollm2")
    for system in ("", "Answer with just the number."):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "7 + 5?"}]
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert t.render_prompt("7 + 5?", system=system) == want
        assert want + t.render_response("12") == tok.apply_chat_template(
            [*msgs, {"role": "assistant", "content": "12"}], tokenize=False
        )
    assert t.stop_words == (tok.eos_token,)
    assert json.load(open(os.path.join(smollm2_hf, "config.json")))["rms_norm_eps"] == 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 3)])
def test_smollm2_layouts_round_trip_and_check(smollm2_hf, pool3, tmp_path, tp, pp):
    """The real 30-layer model: bit-exact round trip, and the check passes where a fixed 1e-5 in fp32 did not. At the
    layouts that split its heads and vocabulary (TP3) and its layers (PP3); every LAYOUTS entry's mapping is the tiny
    model's test above, and the real model at TP1 is the next test's (and the recipe's) conversion."""
    _convert_check_round_trip(smollm2_hf, tmp_path, tp, pp, pool3)


def _logprobs(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """[batch, response] logprobs (temperature 1) of ids[:, start:] from the logits of the whole sequences."""
    return torch.log_softmax(logits[:, start - 1 : -1].double(), -1).gather(-1, ids[:, start:].unsqueeze(-1))[..., 0]


@pytest.mark.slow
def test_smollm2_vllm_logprobs_match_megatron_after_a_reshard(smollm2_hf, tmp_path):
    """The real weights streamed from megatron (TP1) into one vLLM engine: its logprobs of what it sampled against
    megatron's recomputation, each also against the exact (fp64) logprobs and against HF's own fp32 error there."""
    from mindrl.workers.hybrid_check import CheckSettings, check_rank

    with RankPool(1, threads=2, timeout_s=600) as one:
        convert.hf2mcore(smollm2_hf, str(tmp_path / "m"), 1, 1, pool=one)
        settings = CheckSettings(1, 1, 1, steps=0, cycles=1, num_prompts=2, max_tokens=12)
        results = one.run(check_rank, str(tmp_path / "m"), smollm2_hf, settings)
        samples = results[0]["samples"]
        ids = torch.tensor([prompt + response for prompt, response, _ in samples])  # equal lengths (ignore_eos)
        start = len(samples[0][0])
        ours = _logprobs(convert.megatron_outputs(one, str(tmp_path / "m"), 1, 1, ids), ids, start)
    gap = results[0]["cycles"][0]["rollout/logprob_diff_max"]
    engine = torch.tensor([lp for _, _, lp in samples], dtype=torch.float64)
    exact = _logprobs(convert.hf_outputs(smollm2_hf, ids, torch.float64), ids, start)
    hf32 = _logprobs(convert.hf_outputs(smollm2_hf, ids, torch.float32), ids, start)
    err = {name: (lp - exact).abs().max().item() for name, lp in (("vLLM", engine), ("megatron", ours), ("HF", hf32))}
    print(f"SmolLM2 TP1 -> vLLM TP1: max |logprob diff| {gap:.3g}; fp32 vs exact (fp64) logprobs: {err}")
    # The converted checkpoint's fp32 forward is as close to the exact logprobs as HF's own fp32 forward.
    assert err["megatron"] <= 2 * err["HF"]
    # Engine and actor are two fp32 computations of the same weights (different kernels, batch shapes): their gap is
    # bounded by fp32's own error on this model and CPU, measured here as HF's, not by a fixed number (9.9e-5 against
    # the issue's 1e-4 on one CPU, with HF's error 1.6e-5).
    assert gap <= 10 * err["HF"]
