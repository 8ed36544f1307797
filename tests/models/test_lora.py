"""LoRA on megatron's parallel linears against an independent reference: HF + `peft` with the same adapters gives the
same logits and the same adapter gradients as mindrl at TP1, TP2 and PP2. The bound is HF's own fp32 error (fp32 vs
fp64 on these inputs), measured here."""

from __future__ import annotations

import os

import pytest
import torch

import tests.conftest as conftest
from mindrl.models.hf_config import ModelSpec
from mindrl.models.lora import (
    TARGETS,
    LoRAError,
    adapter_mapping,
    adapter_names,
    adapter_shape,
    full_to_peft,
    peft_to_full,
)
from mindrl.models.weight_map import local_to_full, param_mapping, shards_to_hf
from mindrl.plan import adapter_params, stage_params

R, ALPHA = 4, 8.0
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (TP, PP, sequence parallel, full recomputation of every layer)
LAYOUTS = [(1, 1, False, False), (2, 1, False, False), (1, 2, False, False), (2, 1, True, False), (1, 2, False, True)]


@pytest.fixture(scope="module")
def saved(tiny_models, tmp_path_factory) -> str:
    return conftest.tp2_checkpoints({"untied": tiny_models["untied"]}, tmp_path_factory.mktemp("lora_tp2"))["untied"]


@pytest.fixture(scope="module")
def tiny_arch(tiny_models):
    from mindrl.config import load_config

    arch = load_config("ppo_tiny_cpu").model
    spec = ModelSpec.from_hf_dir(tiny_models["untied"])
    assert (arch.num_layers, arch.hidden_size, arch.ffn_size, arch.num_kv_heads, arch.padded_vocab_size) == (
        spec.num_layers, spec.hidden_size, spec.ffn_hidden_size, spec.num_kv_heads, spec.vocab_size)  # fmt: skip
    return arch


@pytest.fixture(scope="module")
def case(tiny_models):
    """(spec, ids, whole adapter matrices): A and B both random, so every adapter has a gradient and moves the
    logits."""
    spec = ModelSpec.from_hf_dir(tiny_models["untied"])
    gen = torch.Generator().manual_seed(11)
    full = {n: 0.2 * torch.randn(adapter_shape(spec, n, R), generator=gen) for n in adapter_names(spec, TARGETS)}
    ids = torch.randint(0, spec.vocab_size, (2, 25), generator=gen)
    return spec, ids, full


def _peft_model(hf_dir: str, spec: ModelSpec, full: dict, dtype: torch.dtype):
    import peft
    import transformers

    from mindrl.checkpoint.convert import _rms_norm_in_dtype

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    if dtype == torch.float64:  # HF keeps fp32 norm statistics whatever the dtype: fp64 all through
        import functools

        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = functools.partial(_rms_norm_in_dtype, module)
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=HF_TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    state = {f"base_model.model.{k}": v for name, t in full.items() for k, v in full_to_peft(spec, name, t)}
    result = peft.set_peft_model_state_dict(model, state)
    assert not [k for k in result.unexpected_keys if "lora" in k], result.unexpected_keys
    return model


def _hf_reference(hf_dir: str, spec: ModelSpec, ids: torch.Tensor, full: dict, dtype: torch.dtype):
    """(logits of ids[:, :-1], the same with the adapters off, {megatron adapter name: whole grad}, {HF name: merged
    weight}) of HF + peft in `dtype`."""
    model = _peft_model(hf_dir, spec, full, dtype)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=inputs).logits
    logits = model(input_ids=inputs).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n.replace(".default", "").removeprefix("base_model.model."): p.grad for n, p in model.named_parameters()
             if p.requires_grad}  # fmt: skip
    out = {}
    for name in full:
        mapping, matrix = adapter_mapping(spec, name)
        parts = [grads[n] for n in mapping.hf_names]
        # A fused linear's one A feeds each projection: its gradient is their sum.
        out[name] = torch.stack(parts).sum(0) if matrix == "A" else peft_to_full(spec, name, parts)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    # peft's own merge (W + scale * B A per projection): what an engine without LoRA layers would be sent.
    merged = {k: v.double() for k, v in model.merge_and_unload().state_dict().items() if k.endswith("proj.weight")}
    return logits.double(), base.double(), {k: v.double() for k, v in out.items()}, merged


@pytest.fixture(scope="module")
def reference(tiny_models, case):
    spec, ids, full = case
    exact = _hf_reference(tiny_models["untied"], spec, ids, {k: v.double() for k, v in full.items()}, torch.float64)
    fp32 = _hf_reference(tiny_models["untied"], spec, ids, full, torch.float32)
    gap = {
        "logits": (fp32[0] - exact[0]).abs().max().item(),
        "grads": max((fp32[2][n] - exact[2][n]).abs().max().item() for n in full),
        "merged": max((fp32[3][n] - exact[3][n]).abs().max().item() for n in exact[3]),
    }
    return exact, gap


def test_peft_layout_round_trips(case):
    """megatron's fused adapters -> PEFT's per-projection ones -> back is exact; unequal q/k/v A's are refused."""
    spec, _, full = case
    for name, t in full.items():
        mapping, _ = adapter_mapping(spec, name)
        pairs = full_to_peft(spec, name, t)
        assert [n for n, _ in pairs] == list(mapping.hf_names)
        assert torch.equal(peft_to_full(spec, name, [v for _, v in pairs]), t)
    qkv_a = "decoder.layers.0.self_attention.linear_qkv.lora.lora_A.weight"
    parts = [v.clone() for _, v in full_to_peft(spec, qkv_a, full[qkv_a])]
    parts[1][0, 0] += 1
    with pytest.raises(LoRAError, match="k_proj.lora_A.weight differs from .*q_proj"):
        peft_to_full(spec, qkv_a, parts)


@pytest.mark.parametrize("tp,pp,sp,recompute", LAYOUTS)
def test_lora_matches_peft(pool, saved, case, reference, tiny_arch, tp, pp, sp, recompute):
    """The trainer's model with LoRA (DDP, megatron's optimizer) against HF + peft: logits with and without the
    adapters, and the adapters' gradients; then one optimizer step moves every adapter and no backbone weight."""
    from tests.models.lora_rank import lora_outputs

    spec, ids, full = case
    (logits_ref, base_ref, grads_ref, merged_ref), gap = reference
    args = (saved, tp, pp, sp, recompute, ids, R, ALPHA, list(TARGETS), full)
    results = [r for r in pool.run(lora_outputs, *args) if r]
    logits = next(r["logits"] for r in results if r["logits"] is not None)[..., : spec.vocab_size].double()
    base = next(r["base_logits"] for r in results if r["base_logits"] is not None)[..., : spec.vocab_size].double()
    shards: dict[str, list] = {}
    weight_shards: dict[str, list] = {}
    for r in sorted(results, key=lambda r: r["tp_rank"]):
        for name, g in r["grads"].items():
            shards.setdefault(name, []).append(g)
        for name, w in r["merged"].items():
            weight_shards.setdefault(name, []).append(w)
    merged = {hf: t.double() for name, ws in weight_shards.items()
              for hf, t in shards_to_hf(spec, param_mapping(spec, name), ws)}  # fmt: skip
    assert sorted(merged) == sorted(merged_ref), "every adapted weight is merged once"
    streamed = next(r["streamed"] for r in results if r["streamed"] is not None)
    assert sorted(streamed) == sorted(merged_ref), "the reshard sends every adapted weight merged"
    assert sorted(shards) == sorted(full), "every adapter of the model got a gradient on some rank"
    grads = {n: local_to_full(adapter_mapping(spec, n)[0], s).double() for n, s in shards.items()}
    for r in results:
        assert not r["backbone_trainable"] and not r["backbone_changed"], "the backbone is frozen"
        assert r["step_ok"] and r["adapters_changed"], "one step moves every adapter"
        assert r["optimizer_params"] == r["adapter_params"] > 0, "the optimizer holds the adapters only"
        # The planner's counts (mindrl.plan: configs/model/tiny_qwen2.yaml is this model) are the built model's.
        want = (
            stage_params(tiny_arch, "actor", tp, pp, r["pp_rank"]).total,
            adapter_params(tiny_arch, TARGETS, R, tp, pp),
        )
        assert (r["numel"], r["trainable_numel"]) == (want[0] + want[1], want[1])

    diff = {
        "logits": (logits - logits_ref).abs().max().item(),
        "base_logits": (base - base_ref).abs().max().item(),
        "grads": max((grads[n] - grads_ref[n]).abs().max().item() for n in full),
        "merged": max((merged[n] - merged_ref[n]).abs().max().item() for n in merged_ref),
        "streamed": max((streamed[n].double() - merged_ref[n]).abs().max().item() for n in merged_ref),
    }
    effect = (logits_ref - base_ref).abs().max().item()
    print(f"tp{tp} pp{pp} sp{int(sp)} recompute{int(recompute)}: max |mindrl - HF+peft fp64| {diff}; HF fp32-vs-fp64 gap {gap}; adapters move logits "
          f"by {effect:.3g}, max |adapter grad| {max(g.abs().max().item() for g in grads_ref.values()):.3g}")  # fmt: skip
    assert effect > 100 * gap["logits"], "the adapters change the logits far beyond the bound"
    assert min(g.abs().max().item() for g in grads_ref.values()) > 100 * gap["grads"], "every adapter has a gradient"
    assert diff["logits"] <= 10 * gap["logits"]
    assert diff["base_logits"] <= 10 * gap["logits"]
    assert diff["grads"] <= 10 * gap["grads"]
    assert diff["merged"] <= 10 * gap["merged"]
    assert diff["streamed"] <= 10 * gap["merged"]


def test_adapters_save_and_reshard_exactly(pool, saved, case, tmp_path):
    """Saved at TP2 with mindrl's dist-checkpoint writer and loaded into fresh LoRA models (other initial adapters) at
    TP1, TP2 and PP2: every adapter comes back bit for bit, whole after the TP gather (the split matrices declared
    as split, linear_fc1's B as [gate; up] per rank), and the backbone is the checkpoint's."""
    from tests.models.lora_rank import load_lora, save_lora

    spec, _, full = case
    it_dir = str(tmp_path / "lora_tp2")
    pool.run(save_lora, saved, it_dir, 2, 1, R, ALPHA, list(TARGETS), full)
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        results = [r for r in pool.run(load_lora, saved, it_dir, tp, pp, R, ALPHA, list(TARGETS)) if r]
        shards: dict[str, list] = {}
        for r in sorted(results, key=lambda r: r["tp_rank"]):
            for name, t in r["adapters"].items():
                shards.setdefault(name, []).append(t)
        assert sorted(shards) == sorted(full)
        for name, s in shards.items():
            assert torch.equal(local_to_full(adapter_mapping(spec, name)[0], s), full[name]), f"tp{tp} pp{pp} {name}"


def test_peft_adapter_directory_round_trips_and_loads_in_peft(tiny_models, case, tmp_path):
    """mindrl's adapters written as a PEFT directory: `peft` loads it onto the base model and gives the logits of the
    same adapters set in memory, bit for bit; read back, the matrices are mindrl's. A directory mindrl's fused layers
    cannot hold is refused, naming the file and the reason."""
    import json

    import peft
    import transformers

    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.checkpoint.peft_io import load_peft_adapter, save_peft_adapter

    spec, ids, full = case
    hf_dir = tiny_models["untied"]
    out = str(tmp_path / "adapter")
    save_peft_adapter(out, spec, full, R, ALPHA, list(TARGETS), hf_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        want = _peft_model(hf_dir, spec, full, torch.float32).eval()(input_ids=ids).logits
    assert torch.equal(got, want)
    back = load_peft_adapter(out, spec)
    assert (back.lora_r, back.lora_alpha, back.lora_target_modules) == (R, ALPHA, list(TARGETS))
    assert sorted(back.tensors) == sorted(full) and all(torch.equal(back.tensors[n], full[n]) for n in full)

    cfg = json.load(open(f"{out}/adapter_config.json"))
    json.dump({**cfg, "target_modules": ["q_proj", "o_proj"]}, open(f"{out}/adapter_config.json", "w"))
    with pytest.raises(CheckpointError, match=r"adapter_config.json: \['q_proj'\] adapted without the other"):
        load_peft_adapter(out, spec)
    json.dump({**cfg, "use_rslora": True}, open(f"{out}/adapter_config.json", "w"))
    with pytest.raises(CheckpointError, match="rsLoRA"):
        load_peft_adapter(out, spec)


@pytest.mark.parametrize("ckpt_filter", [False, True])
def test_trainer_state_resumes_exactly(pool, saved, case, tmp_path, ckpt_filter):
    """At TP2: the trainer's LoRA model saves its train state after one step (mindrl's trainer save; with
    lora_ckpt_filter the adapters only, the meta naming the backbone's checkpoint); a fresh model (other initial
    adapters) built from that save with the state loaded, as a resumed actor is, takes the second step to the same
    adapters and backbone bit for bit."""
    from tests.models.lora_rank import resume_lora

    _, ids, _ = case
    args = (saved, str(tmp_path / "ckpt"), 2, 1, ids, R, ALPHA, list(TARGETS), ckpt_filter)
    results = [r for r in pool.run(resume_lora, *args) if r]
    assert results
    for r in results:
        assert r["num_adapters"] > 0 and r["loaded_saved"] and r["second_step_moved"], r
        assert r["adapters_equal"] and r["backbone_equal"]
        lora = r["meta"]["lora"]
        assert (lora["lora_r"], lora["lora_alpha"], lora["lora_target_modules"]) == (R, ALPHA, list(TARGETS))
        if ckpt_filter:
            assert not r["saved_backbone"], "lora_ckpt_filter saves the adapters only"
            assert lora["backbone"]["load"] == os.path.abspath(saved)
        else:
            assert r["saved_backbone"] and "backbone" not in lora


def test_hf_model_plus_peft_adapter_converts_at_any_layout(pool, tiny_models, case, reference, tmp_path):
    """An HF model + a PEFT adapter written by peft itself -> `mindrl-convert hf2mcore --adapter` at TP2 and at PP2:
    the checkpoint, as every loader builds it, gives HF + peft's logits (fp64 reference, within 10x peft's own
    fp32-vs-fp64 gap), and `mcore2hf --adapter-only` writes peft's adapter file back bit for bit. An adapter that does
    not fit the model is refused before any rank starts, naming the tensor and the file; LoRA keys that are not the
    adapter's are refused at load (preflight) and at the worker's load, naming the key and the file."""
    import json

    from safetensors.torch import load_file

    from mindrl.checkpoint import convert
    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.config import ConfigError
    from mindrl.config.settings import LoRASettings
    from mindrl.preflight import load_config
    from mindrl.workers.train_setup import _check_saved_adapters
    from tests.models.lora_rank import checkpoint_logits

    spec, ids, full = case
    (logits_ref, _, _, _), gap = reference
    hf_dir, peft_dir = tiny_models["untied"], str(tmp_path / "peft")
    _peft_model(hf_dir, spec, full, torch.float32).save_pretrained(peft_dir)
    peft_tensors = load_file(f"{peft_dir}/adapter_model.safetensors")
    for tp, pp in [(2, 1), (1, 2)]:
        ckpt = str(tmp_path / f"ckpt_tp{tp}pp{pp}")
        convert.hf2mcore(hf_dir, ckpt, tp, pp, adapter=peft_dir, pool=pool)
        logits = next(x for x in pool.run(checkpoint_logits, ckpt, tp, pp, ids[:, :-1]) if x is not None)
        diff = (logits[..., : spec.vocab_size].double() - logits_ref).abs().max().item()
        print(f"hf2mcore --adapter at tp{tp} pp{pp}: max |logits - HF+peft fp64| {diff:.3g}, gap {gap['logits']:.3g}")
        assert diff <= 10 * gap["logits"]
        back = str(tmp_path / f"back_tp{tp}pp{pp}")
        convert.mcore2hf(ckpt, back, adapter_only=True, pool=pool)
        written = load_file(f"{back}/adapter_model.safetensors")
        assert sorted(written) == sorted(peft_tensors)
        assert all(written[k].dtype == v.dtype and torch.equal(written[k], v) for k, v in peft_tensors.items())

    meta = f"{ckpt}/release/mindrl_model.json"
    source = f"{peft_dir}/adapter_config.json"
    with pytest.raises(ConfigError) as e:
        load_config("grpo_tiny_cpu", overrides=[
            f"actor_config.load={ckpt}", "+actor_config.lora_target_modules=[linear_qkv,linear_fc1]",
            "+actor_config.lora_r=8", "+rl_config.share_backbone=true"])  # fmt: skip
    text = str(e.value)
    assert f"actor_config.lora_r: is 8, but the checkpoint's adapters have rank 4 (actor_config.load: {meta}, " \
           f"converted from {source})" in text  # fmt: skip
    assert "actor_config.lora_target_modules: is ['linear_qkv', 'linear_fc1'], but the checkpoint's adapters" in text
    assert "actor_config.lora_alpha: is 16, but the checkpoint's adapters were trained with 8" in text
    with pytest.raises(CheckpointError, match=f"{meta}: lora_alpha is 16, but"):
        _check_saved_adapters(ckpt, None, LoRASettings(list(TARGETS), lora_r=R, lora_alpha=16))
    with pytest.raises(CheckpointError, match="lora_target_modules is not set, but the checkpoint holds LoRA"):
        _check_saved_adapters(ckpt, None, LoRASettings())
    _check_saved_adapters(ckpt, None, LoRASettings(list(TARGETS), lora_r=R, lora_alpha=ALPHA))

    cfg = json.load(open(source))
    json.dump({**cfg, "r": 8}, open(source, "w"))
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: .*lora_A.weight has shape \(4, 128\), but "
                       r"r = 8 \(.*adapter_config.json\) and the model imply \(8, 128\)"):  # fmt: skip
        convert.hf2mcore(hf_dir, str(tmp_path / "refused"), adapter=peft_dir, pool=pool)
    json.dump({**cfg, "modules_to_save": ["lm_head"]}, open(source, "w"))
    with pytest.raises(CheckpointError, match="modules_to_save"):
        convert.hf2mcore(hf_dir, str(tmp_path / "refused"), adapter=peft_dir, pool=pool)
    assert not os.path.exists(tmp_path / "refused")
