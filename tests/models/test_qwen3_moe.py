"""A tiny Qwen3-MoE (8 experts, top-2 with renormalised weights, layer 1 dense through `mlp_only_layers`) on
megatron-core's own MoE layer: the HF config maps to megatron's MoE fields, HF -> megatron -> HF is bit-exact, and
megatron's logits land as close to the exact (fp64) ones as HF's own fp32 forward does; in fp64 they pass
`mindrl-convert check`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mindrl.batch import Batch, pad_rows
from mindrl.checkpoint import convert, mcore_ckpt
from mindrl.models.hf_config import ModelConfigError, ModelSpec
from mindrl.workers.rl_model import PPOLossSettings
from tests.checkpoint.test_convert import assert_bit_exact
from tests.models import moe_rank_fns

# hidden 64, 4 heads / 2 KV heads of head_dim 32, experts of width 64; layers 0 and 2 are MoE layers.
TINY_MOE = dict(
    arch="qwen3_moe", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=(1,), seed=41,
)  # fmt: skip
SEQ = 32


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory) -> str:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3_moe") / "hf"), **TINY_MOE)


@pytest.fixture(scope="module")
def saved_tp2(moe_hf, tmp_path_factory, get_pool) -> str:
    out = str(tmp_path_factory.mktemp("qwen3_moe_tp2") / "mcore")
    convert.hf2mcore(moe_hf, out, 2, 1, pool=get_pool())
    return out


def router_probs(hf_dir: str, ids: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each MoE layer's routing probabilities (softmax over all experts), [tokens, experts], from HF's forward."""
    import transformers

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=dtype, experts_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits
    return [torch.softmax(r.double(), -1) for r in logits]


@pytest.fixture(scope="module")
def reference(moe_hf):
    """(ids, HF fp64 logits, HF fp32 logits, the fp64 router's smallest top-k margin over all MoE layers and tokens,
    the largest |fp32 - fp64| of a routing probability)."""
    ids = torch.randint(0, 1021, (2, SEQ), generator=torch.Generator().manual_seed(7))
    k = TINY_MOE["num_experts_per_tok"]
    exact, fp32 = router_probs(moe_hf, ids, torch.float64), router_probs(moe_hf, ids, torch.float32)
    margin = min((top[:, k - 1] - top[:, k]).min().item() for top in (p.topk(k + 1, -1).values for p in exact))
    router_err = max((a - b).abs().max().item() for a, b in zip(exact, fp32))
    return (
        ids,
        convert.hf_outputs(moe_hf, ids, torch.float64),
        convert.hf_outputs(moe_hf, ids, torch.float32),
        margin,
        router_err,
    )


def test_config_maps_to_megatron_moe(moe_hf):
    from mindrl.checkpoint.hf_io import HFCheckpoint
    from mindrl.models.weight_map import expected_hf_names, mcore_param_names

    spec = ModelSpec.from_hf_dir(moe_hf)
    assert (spec.family, spec.qk_layernorm, spec.num_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size) == (
        "qwen3_moe", True, 8, 2, 64,
    )  # fmt: skip
    assert spec.moe_layers == (0, 2) and spec.norm_topk_prob and spec.moe_aux_loss_coeff == 0.001
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec  # as a checkpoint's meta stores it
    cfg = spec.transformer_config()
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.ffn_hidden_size) == (8, 2, 64, 128)
    assert (cfg.moe_router_score_function, cfg.moe_router_pre_softmax, cfg.moe_layer_freq) == (
        "softmax",
        False,
        [1, 0, 1],
    )
    assert (cfg.moe_token_dispatcher_type, cfg.moe_grouped_gemm, cfg.moe_aux_loss_coeff) == ("alltoall", False, 0.001)
    assert sorted(HFCheckpoint(moe_hf).keys()) == sorted(expected_hf_names(spec))
    names = mcore_param_names(spec)
    assert "decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names and "decoder.layers.1.mlp.router.weight" not in names


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_only_layers": [3]}, "mlp_only_layers"),
        ({"mlp_only_layers": [0, 1, 2]}, "no MoE layer"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
)
def test_bad_moe_configs_name_the_field(moe_hf, change, field):
    with open(f"{moe_hf}/config.json") as f:
        cfg = {**json.load(f), **change}
    with pytest.raises(ModelConfigError, match=field):
        ModelSpec.from_hf_config(cfg, source="moe/config.json")


def test_layouts_must_divide_the_experts(moe_hf, pool, tmp_path):
    spec = ModelSpec.from_hf_dir(moe_hf)
    with pytest.raises(ModelConfigError, match="moe_intermediate_size"):
        spec.validate_layout(128, 1)
    with pytest.raises(ModelConfigError, match="num_experts=8"):
        spec.validate_layout(1, 1, ep=3)
    with pytest.raises(ValueError, match="EP=4"):  # 4 ranks at TP2 leave 2 DP ranks
        convert.hf2mcore(moe_hf, str(tmp_path / "m"), 2, 1, pool=pool, ep=4)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 2)])
def test_round_trip_is_bit_exact(moe_hf, pool, tmp_path, tp, pp, ep):
    """Saved from TP x EP ranks (each EP rank writes its own experts), written back to HF from one rank."""
    convert.hf2mcore(moe_hf, str(tmp_path / "mcore"), tp, pp, pool=pool, ep=ep)
    spec, meta = mcore_ckpt.read_model_meta(str(tmp_path / "mcore"))
    assert (meta["tp"], meta["pp"], spec.family, spec.moe_layers) == (tp, pp, "qwen3_moe", (0, 2))
    convert.mcore2hf(str(tmp_path / "mcore"), str(tmp_path / "hf"), pool=pool)
    assert_bit_exact(moe_hf, str(tmp_path / "hf"))


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logits_match_hf_within_its_own_fp32_error(pool, saved_tp2, reference, tp, ep):
    """Saved at TP2, loaded at TP1 / TP2, each at EP1 / EP2 (tokens exchanged by the all-to-all dispatcher). The bound is measured here: HF's own fp32 forward vs the exact (fp64) one.
    Top-k routing is discontinuous, so the router's smallest top-k margin on these tokens must dwarf fp32's error:
    otherwise a token could take other experts on rounding alone."""
    ids, exact, hf32, margin, router_err = reference
    gap = (hf32.double() - exact).abs().max().item()
    assert exact.abs().max() > 0.1 and gap > 0
    assert margin > 100 * router_err, f"router top-k margin {margin:.3g} vs its fp32 error {router_err:.3g}: a near tie"
    ours = convert.megatron_outputs(pool, saved_tp2, tp, 1, ids, ep=ep)
    ours64 = convert.megatron_outputs(pool, saved_tp2, tp, 1, ids, dtype="float64", ep=ep)
    diff, diff64 = (ours.double() - exact).abs().max().item(), (ours64 - exact).abs().max().item()
    print(
        f"TP{tp} EP{ep}: fp32 |megatron - exact| {diff:.3g}, fp64 {diff64:.3g}, HF fp32 gap {gap:.3g}; "
        f"router top-k margin {margin:.3g}, its fp32 error {router_err:.3g}"
    )
    assert diff <= 4 * gap
    assert diff64 <= convert.GAP_FRACTION * gap  # `mindrl-convert check`'s default bound


def test_convert_check_passes_its_default(moe_hf, saved_tp2, pool):
    """`check` in fp64 at TP2 x EP2: the routers' softmax in fp64 on both sides (megatron's and transformers' take
    it in fp32)."""
    res = convert.check(moe_hf, saved_tp2, 2, 1, pool=pool, ep=2)
    print(f"check TP2 EP2: fp64 |megatron - HF| {res.max_abs_diff:.3g}, tol {res.tol:.3g}")
    assert res.ok and res.max_abs_output > 0.1


def test_experts_matter(moe_hf, reference, tmp_path):
    """Swapping two experts' weights in a MoE layer moves HF's logits far above the parity bound: the parity above
    covers which expert each weight maps to."""
    import shutil

    from safetensors.torch import load_file, save_file

    ids, exact, hf32, _, _ = reference
    swapped = str(tmp_path / "swapped")
    shutil.copytree(moe_hf, swapped)
    tensors = load_file(f"{moe_hf}/model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.2.mlp.experts.{e}.{proj}.weight" for e in (0, 1))
        tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, f"{swapped}/model.safetensors", metadata={"format": "pt"})
    effect = (convert.hf_outputs(swapped, ids, torch.float64) - exact).abs().max().item()
    gap = (hf32.double() - exact).abs().max().item()
    print(f"max |swapped experts - original| logits {effect:.3g} vs fp32 gap {gap:.3g}")
    assert effect > 1000 * gap


# ------------------------------------------------------------------------------------------------ training
# The PPO actor loss with every term on, and a load-balancing loss 100x Qwen3-MoE's (0.001), so that its share of
# the router's gradient is far above rounding.
TRAIN_LOSS = PPOLossSettings(
    clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coeff=0.05, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
    loss_agg_mode="token-mean",
)  # fmt: skip
AUX = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": None}
NO_AUX = {**AUX, "moe_aux_loss_coeff": 0.0}
# (name, TP, EP, dtype, router losses); 4 ranks: DP = 4 / TP, EP ranks carved out of DP.
TRAIN_LAYOUTS = [
    ("tp1", 1, 1, "float32", AUX),
    ("tp2", 2, 1, "float32", AUX),
    ("ep2", 1, 2, "float32", AUX),
    ("tp2ep2", 2, 2, "float32", AUX),
    ("tp1_fp64", 1, 1, "float64", AUX),
    ("tp1_no_aux", 1, 1, "float32", NO_AUX),
]
# (name, TP, layers per pipeline stage, EP): the 3 layers split unevenly over PP2 (MindSpeed-RL's num_layer_list)
UNEVEN_PP_LAYOUTS = [("pp2_1_2", 1, (1, 2), 1), ("pp2_2_1_ep2", 1, (2, 1), 2), ("tp2pp2_1_2", 2, (1, 2), 1)]
PP_NAMES = [name for name, *_ in UNEVEN_PP_LAYOUTS]


def moe_rl_batch() -> Batch:
    """Eight rows, prompts of 1-8 tokens and responses of 1-9, with old / rollout / reference logprobs and
    advantages that make every loss term non-zero. The first row's prompt + response is odd: under TP2's sequence
    parallelism its micro-batch gets a padding column, which the router's losses and load must not count."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 8, 5, 1, 7, 4, 6, 2)]
    responses = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (8, 4, 7, 1, 9, 6, 4, 8)]
    prompt_ids, prompt_mask = pad_rows(prompts, pad=0, left=True)
    response_ids, response_mask = pad_rows(responses, pad=0, left=False)
    mask = response_mask.float()

    def logprobs() -> torch.Tensor:
        return (-7.0 + 0.3 * torch.randn(response_ids.shape, generator=g)) * mask

    batch = Batch(
        {
            "input_ids": torch.cat([prompt_ids, response_ids], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "responses": response_ids,
            "response_mask": response_mask,
        },
        meta={"prompt_length": prompt_ids.shape[1]},
    )
    batch.update(
        {
            "old_log_prob": logprobs(),
            "rollout_log_prob": logprobs(),
            "ref_log_prob": logprobs(),
            "advantages": torch.randn(response_ids.shape, generator=g) * mask,
        }
    )
    return batch


@pytest.fixture(scope="module")
def layout_grads(saved_tp2, get_pool) -> dict:
    """layout name -> {"grads": every HF-named gradient, "metrics"}: one PPO actor update of the same global batch per layout (~2 s each)."""
    batch, out = moe_rl_batch(), {}
    for name, tp, ep, dtype, moe in TRAIN_LAYOUTS:
        results = get_pool().run(moe_rank_fns.moe_update_grads_rank, saved_tp2, tp, ep, batch, TRAIN_LOSS, dtype, moe)
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            for k, v in (r["grads"] or {}).items():
                grads.setdefault(k, v.double())
        out[name] = {"grads": grads, "metrics": results[0]["metrics"]}
    for name, tp, stages, ep in UNEVEN_PP_LAYOUTS:
        results = get_pool().run(moe_rank_fns.moe_update_grads_rank, saved_tp2, tp, ep, batch, TRAIN_LOSS, "float32",
                                 AUX, stages)  # fmt: skip
        grads = {}
        for r in results:  # each stage's TP rank 0 holds its own layers' gradients
            for k, v in (r["grads"] or {}).items():
                grads.setdefault(k, v.double())
        out[name] = {"grads": grads, "metrics": results[0]["metrics"]}
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_gradients_with_aux_loss_agree_across_layouts(moe_hf, layout_grads):
    """The PPO loss's and the load-balancing loss's gradients at TP2, EP2 and TP2 x EP2 (tokens exchanged by the
    all-to-all dispatcher, expert grads reduced over the expert data-parallel ranks) equal TP1's: each lands as close
    to the fp64 run's as TP1's own fp32 run does (the bound is measured here)."""
    from mindrl.checkpoint.hf_io import HFCheckpoint

    ref = layout_grads["tp1_fp64"]["grads"]
    assert sorted(ref) == sorted(HFCheckpoint(moe_hf).keys())
    gap = _max_diff(layout_grads["tp1"]["grads"], ref)
    scale = max(g.abs().max().item() for g in ref.values())
    assert 0 < gap < 1e-4 * scale
    for name in ("tp2", "ep2", "tp2ep2"):
        diff = _max_diff(layout_grads[name]["grads"], ref)
        loss_gap = abs(layout_grads[name]["metrics"]["actor/pg_loss"] - layout_grads["tp1"]["metrics"]["actor/pg_loss"])
        print(f"{name}: max |grad - fp64 TP1| {diff:.3g} (TP1 fp32: {gap:.3g}; largest grad {scale:.3g}); "
              f"pg_loss vs TP1 {loss_gap:.3g}")  # fmt: skip
        assert diff <= 4 * gap, f"{name}: {diff:.3g} vs TP1's own fp32 gap {gap:.3g}"


def test_uneven_pipeline_stages(layout_grads):
    """num_layer_list's uneven stages (megatron's pipeline layout): the 3 layers as 1 + 2 and, at EP2, 2 + 1 over
    PP2 train as TP1 does. Gradients within TP1's own fp32 gap (fp64 TP1, measured in this test), and the update's
    first metrics within the other layouts' own spread. With the load-balancing loss: it counts the real tokens only
    (`rl_model._padding_mask`); counting PP's padding moved the routers' gradients by 0.031 from TP1's."""
    base, ref = layout_grads["tp1"], layout_grads["tp1_fp64"]
    gap = _max_diff(layout_grads["tp1"]["grads"], ref["grads"])
    spread = max(abs(layout_grads[n]["metrics"][k] - layout_grads["tp1"]["metrics"][k])
                 for n in ("tp2", "ep2", "tp2ep2") for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"))  # fmt: skip
    for name in PP_NAMES:
        diff = _max_diff(layout_grads[name]["grads"], base["grads"])
        metrics = {k: abs(layout_grads[name]["metrics"][k] - base["metrics"][k])
                   for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss")}  # fmt: skip
        print(f"{name}: max |grad - TP1| {diff:.3g} (TP1 fp32 vs fp64: {gap:.3g}); metrics vs TP1 {metrics} "
              f"(layouts' spread {spread:.3g})")  # fmt: skip
        assert diff <= 4 * gap, f"{name}: {diff:.3g} vs TP1's own fp32 gap {gap:.3g}"
        assert max(metrics.values()) <= 4 * spread, (name, metrics, spread)


def test_aux_loss_trains_the_router(layout_grads):
    """moe_aux_loss_coeff reaches training: the load-balancing loss the update logs (per MoE layer and micro-batch)
    is the same at every layout, and with it the router's gradient moves far beyond rounding."""
    base = layout_grads["tp1"]
    aux = base["metrics"]["actor/moe_load_balancing_loss"]
    assert 1.0 <= aux < 8.0  # the Switch loss: 1 for an even load, num_experts at most
    assert "actor/moe_load_balancing_loss" not in layout_grads["tp1_no_aux"]["metrics"]  # no loss, none logged
    # PP pads every micro-batch to the batch's widths (8 + 9 columns here, the rows' own 2 to 17): the router is
    # told the padding (megatron's padding_mask), which neither loss nor load counts (counted, PP2 1 + 2 had logged
    # 1.227 for TP1's 1.314 on an earlier batch)
    for name in ("tp2", "ep2", "tp2ep2", *PP_NAMES):
        assert math.isclose(layout_grads[name]["metrics"]["actor/moe_load_balancing_loss"], aux, rel_tol=1e-5), name
    # Each expert's routed tokens over its even share, min / max / std over both MoE layers' experts: counted once
    # per token at every layout (TP's sequence-parallel slices, EP's and DP's ranks summed), so the same numbers
    # where the routers choose the same experts (their gradients agree to fp32 rounding, above)
    load = {k: v for k, v in base["metrics"].items() if "moe_expert_load" in k}
    assert sorted(load) == [f"actor/moe_expert_load_{s}" for s in ("max", "min", "std")]
    assert (
        load["actor/moe_expert_load_min"] < 1 < load["actor/moe_expert_load_max"]
        and load["actor/moe_expert_load_std"] > 0
    )
    for name in ("tp2", "ep2", "tp2ep2", "tp1_no_aux", *PP_NAMES):
        assert {k: layout_grads[name]["metrics"][k] for k in load} == pytest.approx(load, rel=1e-12), name
    gap = _max_diff(base["grads"], layout_grads["tp1_fp64"]["grads"])
    without = layout_grads["tp1_no_aux"]["grads"]
    router = max(
        (base["grads"][k] - without[k]).abs().max().item() for k in base["grads"] if k.endswith("mlp.gate.weight")
    )
    print(load)
    print(f"load-balancing loss {aux:.4g} per layer and micro-batch; it moved the router grads by {router:.3g} "
          f"(fp32 gap {gap:.3g})")  # fmt: skip
    assert router > 100 * gap


def test_engine_weight_names_are_the_checkpoints(moe_hf):
    """The names the rollout engine accepts are the checkpoint's, one per expert (transformers 5 fuses a layer's
    experts into 3-D tensors in memory; the weight stream and vLLM's loader name them per expert)."""
    from transformers import AutoConfig

    from mindrl.models.weight_map import expected_hf_names
    from mindrl.rollout.vllm_engine import hf_weight_names

    names, required, _ = hf_weight_names(AutoConfig.from_pretrained(moe_hf))
    assert names == required == set(expected_hf_names(ModelSpec.from_hf_dir(moe_hf)))
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in names


def test_routing_replay(saved_tp2, get_pool, layout_grads):
    """Routing replay (R2, rl_config.router_replay_mode): the old-logprob pass records each token's experts in the
    batch's layout (the same table whether its micro-batches are padded at TP1 or packed at TP2 x EP2), and an
    update given that table routes by it: replaying the recorded choices trains exactly as the router's own
    routing does (gradients within TP1's fp32 gap, every choice the router's own), and choices moved by one
    expert change the gradients far beyond it (the replay is what routes)."""
    from mindrl.workers.rl_model import ROUTED_EXPERTS

    batch = moe_rl_batch()
    tables, runs = {}, {}
    for name, tp, ep, packed, shift in (("tp1", 1, 1, False, 0), ("tp2ep2_shifted", 2, 2, True, 1)):
        results = get_pool().run(moe_rank_fns.moe_replay_rank, saved_tp2, tp, ep, batch, TRAIN_LOSS, AUX, packed,
                                 shift)  # fmt: skip
        table = torch.full((len(batch), batch["input_ids"].shape[1], 2, 2), -1, dtype=torch.int16)
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            table[torch.as_tensor(r["rows"])] = r["routed"]
            for k, v in (r["grads"] or {}).items():
                grads.setdefault(k, v.double())
        tables[name], runs[name] = table, {"grads": grads, "metrics": results[0]["metrics"]}
    real = batch["attention_mask"].bool()
    assert ROUTED_EXPERTS == "routed_experts" and tables["tp1"].shape == (8, 17, 2, 2)
    assert torch.equal(tables["tp1"][real], tables["tp2ep2_shifted"][real])
    assert ((tables["tp1"][real] >= 0) & (tables["tp1"][real] < 8)).all()
    gap = _max_diff(layout_grads["tp1"]["grads"], layout_grads["tp1_fp64"]["grads"])
    own = _max_diff(runs["tp1"]["grads"], layout_grads["tp1"]["grads"])
    moved = _max_diff(runs["tp2ep2_shifted"]["grads"], layout_grads["tp2ep2"]["grads"])
    agree = {n: r["metrics"]["actor/moe_replay_agreement"] for n, r in runs.items()}
    print(f"replayed own choices: grads {own:.3g} from TP1's (fp32 gap {gap:.3g}); shifted by one expert: "
          f"{moved:.3g}; agreement {agree}")  # fmt: skip
    assert own <= 4 * gap and agree["tp1"] == 1.0
    assert moved > 1e3 * gap and agree["tp2ep2_shifted"] < 0.5


@pytest.mark.parametrize("layout", ["padded", "prefix_groups", "packed"])
def test_replay_cells_follow_the_micro_batch_layouts(layout):
    """Routing replay's map from a micro-batch's cells to the model's input columns (`rl_model._model_cells`), and
    the padding mask the routers get: every real token's cell points at the model column holding that token, for
    padded rows, prefix groups (2 prompts x 2 samples sharing them) and packed rows; padding is marked as such."""
    from mindrl.models.packing import pack_rows
    from mindrl.workers import rl_model

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (3, 5)]
    prompts = [prompts[0], prompts[0], prompts[1], prompts[1]]  # each prompt's 2 samples follow it
    responses = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (4, 2, 6, 1)]
    prompt_ids, prompt_mask = pad_rows(prompts, pad=0, left=True)
    response_ids, response_mask = pad_rows(responses, pad=0, left=False)
    mb = Batch({"input_ids": torch.cat([prompt_ids, response_ids], 1),
                "attention_mask": torch.cat([prompt_mask, response_mask], 1),
                "responses": response_ids, "response_mask": response_mask},
               meta={"prompt_length": prompt_ids.shape[1]})  # fmt: skip
    if layout == "prefix_groups":
        mb.meta[rl_model._SAMPLES] = 2
    elif layout == "packed":
        mb.meta[rl_model._PACKED] = pack_rows(mb["input_ids"], mb["attention_mask"], prompt_ids.shape[1], 4)
    ids = rl_model._model_inputs(mb)[0]
    cells, b, s = rl_model._model_cells(mb)
    assert ids.shape == (b, s) and cells.shape == mb["input_ids"].shape
    real = mb["attention_mask"].bool()
    assert (cells[real] >= 0).all()
    assert torch.equal(ids.flatten()[cells[real]], mb["input_ids"][real])
    padding = rl_model._padding_mask(mb)
    assert padding.shape == (b, s) and not padding.flatten()[cells[real]].any()
    assert int((~padding).sum()) == (int(real.sum()) if layout != "prefix_groups" else 3 + 4 + 2 + 5 + 6 + 1)
