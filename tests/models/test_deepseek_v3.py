"""A tiny DeepSeek-V3 (multi-latent attention with a query bottleneck, YaRN RoPE with DeepSeek's mscale, layer 0 dense,
then MoE layers of 16 routed experts + 1 shared, the sigmoid router with its correction bias choosing 4 experts within
the 2 best of 4 groups, scaled by 2.5) on megatron-core's own MLA and MoE: the HF config maps to megatron's fields,
HF -> megatron -> HF is bit-exact at TP / EP / PP, and megatron's logits land as close to the exact (fp64) ones as
HF's own fp32 forward does; in fp64 they pass `mindrl-convert check`."""

from __future__ import annotations

import json

import pytest
import torch

from mindrl.checkpoint import convert, mcore_ckpt
from mindrl.models.hf_config import ModelConfigError, ModelSpec
from tests.checkpoint.test_convert import assert_bit_exact

# hidden 64, 4 heads of q/k 32 nope + 16 rope and v 32, latents q 48 / kv 32; layer 0 dense, layers 1-3 MoE.
TINY_DSV3 = dict(
    arch="deepseek_v3", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=128,
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_group=4, topk_group=2, seed=43,
)  # fmt: skip
SEQ = 32


@pytest.fixture(scope="module")
def dsv3_hf(tmp_path_factory) -> str:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_dsv3") / "hf"), **TINY_DSV3)


@pytest.fixture(scope="module")
def saved_tp2(dsv3_hf, tmp_path_factory, get_pool) -> str:
    out = str(tmp_path_factory.mktemp("dsv3_tp2") / "mcore")
    convert.hf2mcore(dsv3_hf, out, 2, 1, pool=get_pool())
    return out


def routing_margins(hf_dir: str, ids: torch.Tensor) -> tuple[float, float]:
    """(the smallest margin of the router's choices, over every MoE layer and token: between the last group chosen
    and the first left out, and between the last expert chosen within the chosen groups and the first left out;
    the largest |fp32 - fp64| of a choice score). The choice scores are sigmoid(logits) + the correction bias."""
    import transformers

    k = TINY_DSV3["num_experts_per_tok"]
    scores = {}
    for dtype in (torch.float64, torch.float32):
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, dtype=dtype, experts_implementation="eager")
        routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
        if dtype == torch.float64:  # the exact router (transformers takes it in fp32)
            import functools

            for r in routers:
                r.forward = functools.partial(convert._deepseek_router_in_dtype, r)
        with torch.no_grad():
            logits = model(input_ids=ids, output_router_logits=True).router_logits
        scores[dtype] = [
            torch.sigmoid(x.double()) + r.e_score_correction_bias.double() for x, r in zip(logits, routers)
        ]
    margin = float("inf")
    group, group_k = routers[0].num_group, routers[0].topk_group
    for choice in scores[torch.float64]:
        grouped = choice.view(-1, group, choice.shape[-1] // group)
        group_scores = grouped.topk(2, -1).values.sum(-1).sort(-1, descending=True).values
        margin = min(margin, (group_scores[:, group_k - 1] - group_scores[:, group_k]).min().item())
        keep = torch.zeros_like(group_scores).scatter_(1, grouped.topk(2, -1).values.sum(-1).topk(group_k, -1)[1], 1)
        masked = choice.masked_fill(~keep.bool().repeat_interleave(choice.shape[-1] // group, 1), float("-inf"))
        top = masked.topk(k + 1, -1).values
        margin = min(margin, (top[:, k - 1] - top[:, k]).min().item())
    err = max((a - b).abs().max().item() for a, b in zip(scores[torch.float64], scores[torch.float32]))
    return margin, err


@pytest.fixture(scope="module")
def reference(dsv3_hf):
    """(ids, HF fp64 logits, HF fp32 logits, the fp64 router's smallest choice margin, its fp32 error)."""
    ids = torch.randint(0, 1021, (2, SEQ), generator=torch.Generator().manual_seed(7))
    margin, router_err = routing_margins(dsv3_hf, ids)
    exact = convert.hf_outputs(dsv3_hf, ids, torch.float64)
    return ids, exact, convert.hf_outputs(dsv3_hf, ids, torch.float32), margin, router_err


def test_config_maps_to_megatron_mla_and_moe(dsv3_hf):
    from mindrl.checkpoint.hf_io import HFCheckpoint
    from mindrl.models.weight_map import expected_hf_names, mcore_param_names

    spec = ModelSpec.from_hf_dir(dsv3_hf)
    assert (spec.family, spec.is_mla, spec.head_dim, spec.moe_layers) == ("deepseek_v3", True, 48, (1, 2, 3))
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.v_head_dim) == (48, 32, 16, 32)
    assert (spec.yarn_factor, spec.yarn_original_max_position_embeddings, spec.yarn_mscale_all_dim) == (4.0, 512, 1.0)
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec  # as a checkpoint's meta stores it
    cfg = spec.transformer_config()
    assert type(cfg).__name__ == "MLATransformerConfig" and cfg.multi_latent_attention
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        48, 32, 32, 16, 32,
    )  # fmt: skip
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim) == ("yarn", 4.0, 1.0, 1.0)
    assert (cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias, cfg.moe_router_bias_update_rate) == (
        "sigmoid", True, 0.0,
    )  # fmt: skip
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert (cfg.moe_layer_freq, cfg.moe_shared_expert_intermediate_size, cfg.apply_rope_fusion) == (
        [0, 1, 1, 1], 32, False,
    )  # fmt: skip
    assert spec.transformer_config(dtype="bfloat16").moe_router_dtype == "fp32"  # transformers' router in fp32
    assert sorted(HFCheckpoint(dsv3_hf).keys()) == sorted(expected_hf_names(spec))
    names = mcore_param_names(spec)
    assert "decoder.layers.1.mlp.router.expert_bias" in names and "decoder.layers.0.mlp.linear_fc1.weight" in names
    assert "decoder.layers.3.mlp.shared_experts.linear_fc2.weight" in names
    assert "decoder.layers.2.self_attention.linear_kv_up_proj.weight" in names


@pytest.mark.parametrize(
    "change,field",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"n_group": 3}, "n_group=3"),
        ({"topk_group": 1}, "topk_group=1 must be 2"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"first_k_dense_replace": 4}, "first_k_dense_replace"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim=15 must be even"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 512}}, "mscale_all_dim=1.0 without mscale"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0,
                              "original_max_position_embeddings": 512}}, "attention_factor"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
    ],
)  # fmt: skip
def test_bad_deepseek_configs_name_the_field(dsv3_hf, change, field):
    with open(f"{dsv3_hf}/config.json") as f:
        cfg = {**json.load(f), **change}
    with pytest.raises(ModelConfigError, match=field):
        ModelSpec.from_hf_config(cfg, source="dsv3/config.json")


def test_mtp_layers_are_refused_by_name(dsv3_hf, tmp_path):
    """DeepSeek-V3 / R1 checkpoints store their multi-token prediction module as the layer after the last decoder
    layer (num_nextn_predict_layers: 1): refused as such, with what to do."""
    from mindrl.checkpoint.hf_io import CheckpointError
    from tests.checkpoint.test_convert import _copy, _edit_config, _rewrite_weights

    d = _copy(dsv3_hf, tmp_path / "mtp")
    _edit_config(d, num_nextn_predict_layers=1)
    mtp = {f"model.layers.4.{n}": torch.zeros(2, 2) for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight")}
    _rewrite_weights(d, lambda t: {**t, **mtp})
    with pytest.raises(CheckpointError, match=r"layers \[4\] are multi-token prediction \(MTP\) modules .*"
                       r"num_nextn_predict_layers=1.*model.layers.4.\*"):  # fmt: skip
        convert.validate_hf_checkpoint(d, ModelSpec.from_hf_dir(d))


def test_layouts_must_divide_the_latents(dsv3_hf):
    spec = ModelSpec.from_hf_dir(dsv3_hf)
    with pytest.raises(ModelConfigError, match="q_lora_rank=48"):
        spec.validate_layout(32, 1)
    with pytest.raises(ModelConfigError, match="num_experts=16"):
        spec.validate_layout(1, 1, ep=3)


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 2), (1, 2, 2)])
def test_round_trip_is_bit_exact(dsv3_hf, pool, tmp_path, tp, pp, ep):
    """Saved from TP x PP x EP ranks (PP2: the dense layer and a MoE layer on stage 0), written back to HF from one
    rank; the router's correction bias (a megatron buffer) travels with the weights."""
    convert.hf2mcore(dsv3_hf, str(tmp_path / "mcore"), tp, pp, pool=pool, ep=ep)
    spec, meta = mcore_ckpt.read_model_meta(str(tmp_path / "mcore"))
    assert (meta["tp"], meta["pp"], spec.family, spec.moe_layers) == (tp, pp, "deepseek_v3", (1, 2, 3))
    convert.mcore2hf(str(tmp_path / "mcore"), str(tmp_path / "hf"), pool=pool)
    assert_bit_exact(dsv3_hf, str(tmp_path / "hf"))


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 2)])
def test_logits_match_hf_within_its_own_fp32_error(pool, saved_tp2, reference, tp, pp, ep):
    """Saved at TP2, loaded at TP1 and TP2 x EP2. The bound is measured here: HF's own fp32 forward vs the
    exact (fp64) one. The router's choices are discontinuous, so their smallest margin on these tokens must dwarf
    fp32's error on the choice scores: otherwise a token could take other experts on rounding alone."""
    ids, exact, hf32, margin, router_err = reference
    gap = (hf32.double() - exact).abs().max().item()
    assert exact.abs().max() > 0.1 and gap > 0
    assert margin > 100 * router_err, (
        f"router choice margin {margin:.3g} vs its fp32 error {router_err:.3g}: a near tie"
    )
    ours = convert.megatron_outputs(pool, saved_tp2, tp, pp, ids, ep=ep)
    ours64 = convert.megatron_outputs(pool, saved_tp2, tp, pp, ids, dtype="float64", ep=ep)
    diff, diff64 = (ours.double() - exact).abs().max().item(), (ours64 - exact).abs().max().item()
    print(
        f"TP{tp} PP{pp} EP{ep}: fp32 |megatron - exact| {diff:.3g}, fp64 {diff64:.3g}, HF fp32 gap {gap:.3g}; "
        f"router choice margin {margin:.3g}, its fp32 error {router_err:.3g}"
    )
    assert diff <= 4 * gap
    assert diff64 <= convert.GAP_FRACTION * gap  # `mindrl-convert check`'s default bound


def test_convert_check_passes_its_default(dsv3_hf, saved_tp2, pool):
    """`check` in fp64, the checkpoint saved at TP2 loaded at PP2 x EP2 (stage 0: the dense layer and a MoE layer)."""
    res = convert.check(dsv3_hf, saved_tp2, 1, 2, pool=pool, ep=2)
    print(f"check PP2 EP2: fp64 |megatron - HF| {res.max_abs_diff:.3g}, tol {res.tol:.3g}")
    assert res.ok and res.max_abs_output > 0.1


@pytest.mark.parametrize("tensor", ["mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight"])
def test_router_bias_and_shared_expert_matter(dsv3_hf, reference, tmp_path, tensor):
    """Zeroing layer 2's router bias (it steers only which experts are chosen) or its shared expert moves HF's logits
    far above the parity bound: the parity above covers both."""
    import shutil

    from safetensors.torch import load_file, save_file

    ids, exact, hf32, _, _ = reference
    changed = str(tmp_path / "changed")
    shutil.copytree(dsv3_hf, changed)
    tensors = load_file(f"{dsv3_hf}/model.safetensors")
    tensors[f"model.layers.2.{tensor}"] = torch.zeros_like(tensors[f"model.layers.2.{tensor}"])
    save_file(tensors, f"{changed}/model.safetensors", metadata={"format": "pt"})
    effect = (convert.hf_outputs(changed, ids, torch.float64) - exact).abs().max().item()
    gap = (hf32.double() - exact).abs().max().item()
    print(f"{tensor} zeroed: max |logits - original| {effect:.3g} vs fp32 gap {gap:.3g}")
    assert effect > 1000 * gap


# ------------------------------------------------------------------------------------------------ training
# (name, TP, EP, dtype); 4 ranks: DP = 4 / TP, EP ranks carved out of DP. TP2 runs sequence parallel.
TRAIN_LAYOUTS = [("tp1", 1, 1, "float32"), ("tp1_fp64", 1, 1, "float64"), ("tp2ep2", 2, 2, "float32")]
NO_ROUTER_LOSS = {"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None}


@pytest.fixture(scope="module")
def layout_grads(saved_tp2, get_pool) -> dict:
    """layout name -> every HF-named gradient of one PPO actor update of the same global batch (~3-10 s each)."""
    from tests.models import moe_rank_fns
    from tests.models.test_qwen3_moe import TRAIN_LOSS, moe_rl_batch

    batch, out = moe_rl_batch(), {}
    for name, tp, ep, dtype in TRAIN_LAYOUTS:
        results = get_pool().run(
            moe_rank_fns.moe_update_grads_rank, saved_tp2, tp, ep, batch, TRAIN_LOSS, dtype, NO_ROUTER_LOSS
        )
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            for k, v in (r["grads"] or {}).items():
                grads.setdefault(k, v.double())
        out[name] = grads
    return out


def test_gradients_agree_across_layouts(dsv3_hf, layout_grads):
    """The PPO loss's gradients at TP2 x EP2 (sequence parallel, tokens exchanged by the all-to-all dispatcher, the
    MLA latents gathered over TP) land as close to the fp64 TP1 run's as TP1's own fp32 run does. Without
    `mindrl.models.mla`'s gather the key/value down projection's gradient was 6.7e-3 off."""
    from mindrl.checkpoint.hf_io import HFCheckpoint
    from tests.models.test_qwen3_moe import _max_diff

    ref = layout_grads["tp1_fp64"]
    trained = {k for k in HFCheckpoint(dsv3_hf).keys() if not k.endswith("e_score_correction_bias")}  # a buffer
    assert sorted(ref) == sorted(trained)
    gap = _max_diff(layout_grads["tp1"], ref)
    scale = max(g.abs().max().item() for g in ref.values())
    assert 0 < gap < 1e-4 * scale
    diff = _max_diff(layout_grads["tp2ep2"], ref)
    print(f"TP2 x EP2: max |grad - fp64 TP1| {diff:.3g} (TP1 fp32: {gap:.3g}; largest grad {scale:.3g})")
    assert diff <= 4 * gap, f"TP2 x EP2: {diff:.3g} vs TP1's own fp32 gap {gap:.3g}"
