"""The planner on every shipped config (seconds, no worker, no model), its numbers against hand computations
and megatron's formulas, the rank layout against megatron's RankGenerator, the CLI and --json."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from omegaconf import OmegaConf

from mindrl.cli import plan as plan_cli
from mindrl.config import ConfigError, load_config
from mindrl.config.errors import Collector
from mindrl.config.loader import default_config_dir
from mindrl.config.model import ModelArchConfig
from mindrl.plan import PHASES, make_plan, rank_coords, stage_params, to_json, to_text, total_params

SHIPPED = [
    "ppo_qwen25_32b_A3", "grpo_qwen25_32b_A3", "grpo_qwen25_32b_A2", "grpo_qwen25_7b_A3", "grpo_qwen3_8b_A3",
    "ppo_tiny_cpu", "grpo_tiny_cpu", "dapo_qwen25_32b_A3_32k", "dapo_qwen25_32b_A2_20k",
]  # fmt: skip
RECIPES = {
    "ppo_qwen25_32b_A3": "a3", "grpo_qwen25_32b_A3": "a3", "grpo_qwen25_32b_A2": "910b", "grpo_qwen25_7b_A3": "a3",
    "grpo_qwen3_8b_A3": "a3", "dapo_qwen25_32b_A3_32k": "a3", "dapo_qwen25_32b_A2_20k": "910b",
}  # fmt: skip
"""MindSpeed-RL's recipes as they ship them (configs/ differs only in paths and run_dir) and the device each names."""


@pytest.fixture(scope="module")
def cfgs():
    return {name: load_config(name) for name in SHIPPED}


def _hand_qwen25_32b() -> int:
    v, h, layers, a, g, d, f = 152064, 5120, 64, 40, 8, 128, 27648
    per_layer = 2 * h + h * (a + 2 * g) * d + (a + 2 * g) * d + a * d * h + 3 * h * f
    return 2 * v * h + layers * per_layer + h  # untied embedding + head, final norm


def test_qwen25_32b_params_by_hand(cfgs):
    cfg = cfgs["ppo_qwen25_32b_A3"]
    assert total_params(cfg.model) == _hand_qwen25_32b() == 32_763_876_352
    # TP8: every matrix split 8 ways, the 64 x 2 norms and the final norm replicated
    per_rank = stage_params(cfg.model, "actor", 8, 1, 0).total
    assert per_rank == (32_763_876_352 - 129 * 5120) // 8 + 129 * 5120
    critic = total_params(cfg.critic_model, "critic")
    assert critic == 32_763_876_352 - 152064 * 5120 + 5120  # the value head replaces the LM head


def _hand_qwen3(v: int, h: int, layers: int, a: int, g: int, d: int, f: int) -> int:
    per_layer = 2 * h + h * (a + 2 * g) * d + 2 * d + a * d * h + 3 * h * f  # 2 * d: the q and k head norms
    return 2 * v * h + layers * per_layer + h


def test_qwen3_params_by_hand(cfgs):
    """Qwen3-8B as its HF checkpoint counts it; Qwen3-32B's head_dim (kv_channels 128) is not hidden/heads (80)."""
    cfg = cfgs["grpo_qwen3_8b_A3"]
    assert total_params(cfg.model) == _hand_qwen3(151936, 4096, 36, 32, 8, 128, 12288) == 8_190_735_360
    per_rank = stage_params(cfg.model, "actor", 2, 1, 0).total  # the head norms replicated like the layer norms
    assert per_rank == (8_190_735_360 - 36 * (2 * 4096 + 2 * 128) - 4096) // 2 + 36 * (2 * 4096 + 2 * 128) + 4096
    raw = OmegaConf.to_container(OmegaConf.load(f"{default_config_dir()}/model/qwen3_32b.yaml"))["qwen3_32b"]
    col = Collector()
    arch = ModelArchConfig.from_dict({**raw, "name": "qwen3_32b"}, "model.qwen3_32b", col)
    assert arch.head_dim == 128 and arch.qk_layernorm
    assert total_params(arch) == _hand_qwen3(151936, 5120, 64, 64, 8, 128, 25600)


def test_megatron_bytes_per_parameter(cfgs):
    """Megatron's theoretical memory: 18 bytes per parameter (bf16 weight, fp32 grad, fp32 master + 2 Adam
    moments), 6 + 12/DP with the distributed optimizer."""
    cfg = cfgs["ppo_qwen25_32b_A3"]
    plan = make_plan(cfg)
    lay = plan.layouts["actor"]
    train = plan.memory["actor"]["train"]
    n = lay.params_per_stage[0]
    assert (lay.dp, lay.distributed_optimizer, lay.dtype) == (4, True, "bfloat16")
    assert train["weights_bytes"] + train["grads_bytes"] + train["optimizer_bytes"] == n * (6 + 12 // 4)
    plan = make_plan(load_config("ppo_qwen25_32b_A3", overrides=["megatron_training.use_distributed_optimizer=false"]))
    train = plan.memory["actor"]["train"]
    assert train["weights_bytes"] + train["grads_bytes"] + train["optimizer_bytes"] == n * 18


def test_rank_layout_is_megatrons():
    from megatron.core.parallel_state import RankGenerator

    for tp, pp, world in [(8, 1, 32), (2, 2, 16), (2, 1, 2), (1, 4, 8), (4, 2, 16)]:
        dp = world // (tp * pp)
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        for kind, index in (("tp", 0), ("pp", 1), ("dp", 2)):
            for group in gen.get_ranks(kind):
                coords = [rank_coords(r, tp, pp, world) for r in group]
                assert [c[index] for c in coords] == list(range(len(group))), (kind, tp, pp, group)
                others = {c[:index] + c[index + 1 :] for c in coords}
                assert len(others) == 1, (kind, group)


def test_rank_layout_with_context_parallelism_is_megatrons():
    from megatron.core.parallel_state import RankGenerator

    for tp, pp, cp, world in [(8, 2, 2, 64), (2, 1, 2, 8), (1, 2, 2, 8), (2, 2, 2, 16)]:
        dp = world // (tp * pp * cp)
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        for kind, index in (("tp", 0), ("pp", 1), ("dp", 2), ("cp", 3)):
            for group in gen.get_ranks(kind):
                coords = [rank_coords(r, tp, pp, world, cp) for r in group]
                assert [c[index] for c in coords] == list(range(len(group))), (kind, tp, pp, cp, group)
                assert len({c[:index] + c[index + 1 :] for c in coords}) == 1, (kind, group)


def test_context_parallel_recipes_split_the_activations(cfgs):
    """The CP2 recipes: the actor's layout says CP 2 and DP = 64 / (TP8 x PP2 x CP2) = 2, and the update's
    activations are what CP1 would need over about CP (the attention keeps all keys: a little more)."""
    plan = make_plan(cfgs["dapo_qwen25_32b_A3_32k"])
    lay = plan.layouts["actor"]
    assert (lay.tp, lay.pp, lay.cp, lay.dp) == (8, 2, 2, 2)
    cfg1 = load_config("dapo_qwen25_32b_A3_32k", overrides=["actor_config.context_parallel_size=1"])
    acts = {cp: p.memory["actor"]["train"]["activations_bytes"] for cp, p in ((2, plan), (1, make_plan(cfg1)))}
    assert acts[1] / 2 < acts[2] < 0.6 * acts[1], acts
    assert "CP 2 DP 2" in to_text(plan) and "cp 1)" in to_text(plan)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_plans_in_seconds(cfgs, name):
    t0 = time.perf_counter()
    plan = make_plan(cfgs[name])
    text = to_text(plan)
    assert time.perf_counter() - t0 < 2.0
    assert f"mindrl-plan: {name}" in text and "verdict: " in text and "largest term: " in text
    cfg = cfgs[name]
    assert len(plan.placement) == cfg.rl_config.world_size
    assert plan.rollout.replicas == cfg.rl_config.world_size // cfg.generate_config.infer_tensor_parallel_size
    assert plan.layouts["actor"].dp == cfg.rl_config.actor_dp
    assert ("critic" in plan.layouts) == cfg.rl_config.needs_critic


def test_ppo_32b_verdict_names_the_peak(cfgs):
    plan = make_plan(cfgs["ppo_qwen25_32b_A3"])
    v = plan.verdict
    assert plan.device.key == "a3" and plan.device.memory_bytes == 64 << 30 and plan.device.per_node == 16
    assert {s.node for s in plan.placement} == {0, 1}
    # integrated: actor+ref, critic and engine replica of device 9 sit on node 0, local device 9
    s = plan.placement[9]
    assert (s.node, s.local, s.actor, s.critic, s.engine) == (0, 9, (1, 0, 1), (1, 0, 1), (1, 1))
    assert v["peak_bytes"] == max(plan.memory["total"].values())
    role, phase, term = v["largest_term"].split(".")
    assert plan.memory[role][phase][term] == v["largest_term_bytes"]
    assert v["fits"] == (v["peak_bytes"] <= 64 << 30)
    # the KV cache: what gpu_memory_utilization leaves after the engine's weights and step activations
    eng = plan.memory["rollout"]["rollout"]
    assert eng["weights_bytes"] + eng["activations_bytes"] + eng["kv_cache_bytes"] == int(0.4 * (64 << 30))
    per_token = 2 * 64 * 1 * 128 * 2  # K,V x layers x (8 KV heads / infer TP 8) x head_dim x bf16
    assert plan.kv_cache["bytes_per_token"] == per_token
    assert plan.kv_cache["sequences_at_max_len"] == eng["kv_cache_bytes"] // (4096 * per_token)


def test_ppo_32b_fits_with_the_actor_off_the_device_while_the_critic_trains(cfgs):
    """ppo_qwen25_32b_A3 sets every offload_train_* switch: the actor's weights, grads and optimizer state leave the
    device outside its update (it is on-policy: no old-logprob pass), so the critic's update fits beside nothing of
    the actor's; without the switches the actor's 36.9 GB stay there and the recipe does not fit."""
    plan = make_plan(cfgs["ppo_qwen25_32b_A3"])
    state = ("weights_bytes", "grads_bytes", "optimizer_bytes")
    for phase in ("rollout", "score", "critic_train"):
        assert all(plan.memory["actor"][phase][t] == 0 for t in state), phase
    assert plan.memory["critic"]["score"]["grads_bytes"] == plan.memory["critic"]["score"]["optimizer_bytes"] == 0
    assert plan.residency["actor"]["critic_train"] == "offloaded" and plan.verdict["fits"], plan.verdict
    off = ["generate_config.offload_train_" + k + "=false" for k in ("param", "grad", "optimizer")]
    kept = make_plan(load_config("ppo_qwen25_32b_A3", overrides=off))
    actor = kept.memory["actor"]["critic_train"]
    assert sum(actor[t] for t in state) == sum(plan.memory["actor"]["train"][t] for t in state)
    assert round(sum(actor[t] for t in state) / 1e9, 1) == 36.9
    assert not kept.verdict["fits"] and kept.verdict["peak_phase"] == "critic_train"
    assert kept.verdict["fix"].startswith("generate_config.offload_train_"), kept.verdict


def test_device_memory_override_changes_the_verdict(cfgs):
    from mindrl.rollout.base import full_batch_kv_bytes

    cfg = cfgs["ppo_tiny_cpu"]
    assert make_plan(cfg, device_memory_gib=64).verdict["fits"]
    # No size configured: the engine's own default on CPU, the KV a full batch can fill (capped at 1 GiB)
    m, gen = cfg.model, cfg.generate_config
    full = full_batch_kv_bytes(m.num_layers, m.num_kv_heads, m.head_dim, 4 if gen.dtype == "float32" else 2,
                               gen.max_num_seqs, gen.max_model_len, gen.infer_tensor_parallel_size)  # fmt: skip
    assert make_plan(cfg).memory["rollout"]["rollout"]["kv_cache_bytes"] == min(full, 1 << 30) == full
    cfg = load_config("ppo_tiny_cpu", overrides=["generate_config.kv_cache_memory_gib=1"])
    small = make_plan(cfg, device_memory_gib=0.5)
    assert not small.verdict["fits"]
    role, phase, term = small.verdict["largest_term"].split(".")  # on CPU the engine never sleeps
    assert (role, term) == ("rollout", "kv_cache_bytes") and phase == small.verdict["peak_phase"]
    assert small.verdict["fix"].startswith("generate_config.kv_cache_memory_gib")
    h100 = make_plan(cfgs["grpo_qwen25_7b_A3"], device="h100")
    assert h100.device.memory_bytes == 80 << 30 and h100.device.per_node == 8


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_mindspeed_recipes_fit_the_device_they_name(cfgs, name):
    """Each recipe is planned on the device its name says (_A3: one Atlas A3 die, _A2: a 910B), with that device's
    kernels (the NPU's fused attention and RMSNorm), and fits with at least 5% of the device to spare."""
    plan = make_plan(cfgs[name])
    assert plan.device.key == RECIPES[name]
    assert plan.device.kernels.attention_grouped_kv and not plan.device.kernels.attention_fp32_operands
    headroom = 1 - plan.verdict["peak_bytes"] / plan.device.memory_bytes
    assert plan.verdict["fits"] and headroom >= 0.05, (name, plan.verdict)


def test_device_names_and_kernel_paths():
    from mindrl.plan import memory as mem
    from mindrl.plan.devices import pick_device

    assert pick_device(16, "grpo_qwen25_32b_A2")[0].key == "910b"
    assert pick_device(16, "dapo_qwen25_32b_A2_20k")[0].key == "910b"
    assert pick_device(16, "x", key="A2")[0].key == pick_device(16, "x", key="910b")[0].key == "910b"
    assert pick_device(16, "x", key="h100")[0].kernels == mem.CUDA_PATH
    with pytest.raises(ValueError, match="unknown device 'b200'"):
        pick_device(16, "x", key="b200")
    # 16-bit operands on devices: the attention keeps less than the CPU's fp32 copies, the NPU's least (grouped K/V)
    cfg = load_config("grpo_qwen25_7b_A3")
    args = (cfg.model, 4096, 1, 2, True, 2)
    cpu, cuda, npu = (mem.layer_activation_bytes(*args, path=p) for p in (None, mem.CUDA_PATH, mem.NPU_PATH))
    assert npu < cuda < cpu, (npu, cuda, cpu)


def test_json_keys_are_integers(cfgs):
    obj = json.loads(json.dumps(to_json(make_plan(cfgs["ppo_qwen25_32b_A3"]))))
    mem = obj["memory"]
    for role in ("actor", "critic", "rollout"):
        for phase in ("rollout", "train"):
            for term in ("weights_bytes",):
                assert isinstance(mem[role][phase][term], int)
    assert isinstance(mem["actor"]["train"]["optimizer_bytes"], int)
    assert isinstance(mem["actor"]["train"]["activations_recompute_bytes"], int)
    assert isinstance(mem["rollout"]["rollout"]["kv_cache_bytes"], int)
    assert set(mem["total"]) == {f"{p}_bytes" for p in PHASES}
    for phases in mem.values():
        for terms in phases.values() if isinstance(phases, dict) else ():
            for v in terms.values() if isinstance(terms, dict) else [terms]:
                assert isinstance(v, int) and v >= 0
    assert isinstance(obj["kv_cache"]["sequences_at_max_len"], int)
    assert obj["layouts"]["actor"]["tp"] == 8 and obj["rollout"]["replicas"] == 4


def test_cli_help_text_and_json(capsys):
    with pytest.raises(SystemExit) as e:
        plan_cli.main(["--help"])
    assert e.value.code == 0 and "--device-memory-gib" in capsys.readouterr().out
    assert plan_cli.main(["--config-name", "ppo_tiny_cpu"]) == 0
    assert "verdict: FITS" in capsys.readouterr().out
    assert plan_cli.main(["--config-name", "ppo_qwen25_32b_A3", "--json"]) in (0, 1)
    obj = json.loads(capsys.readouterr().out)
    assert obj["memory"]["actor"]["train"]["weights_bytes"] > 0


def test_mindspeed_configs_folder_as_is(tmp_path, capsys):
    """--config-path to a configs/ folder laid out like MindSpeed-RL's (model/NAME.yaml beside the configs)."""
    from mindrl.config import default_config_dir

    folder = tmp_path / "configs"
    shutil.copytree(default_config_dir(), folder)
    code = plan_cli.main(["--config-name", "grpo_qwen25_32b_A3", "--config-path", str(folder), "--json"])
    assert code in (0, 1)
    assert json.loads(capsys.readouterr().out)["source"] == str(folder / "grpo_qwen25_32b_A3.yaml")


def test_train_dry_run_starts_nothing(capsys):
    from mindrl.cli import train

    assert train.main(["--config-name", "ppo_tiny_cpu", "--dry-run", "--no-check-paths"]) == 0
    assert "verdict: FITS" in capsys.readouterr().out
    import sys

    ray = sys.modules.get("ray")  # not importing it here: importing Ray alone changes os.environ
    assert ray is None or not ray.is_initialized()


def test_bad_config_gives_the_configs_error(capsys):
    code = plan_cli.main(["--config-name", "ppo_tiny_cpu", "actor_config.tensor_model_parallel_size=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "mindrl-plan: error: " in err and "actor_config.tensor_model_parallel_size" in err
    with pytest.raises(ConfigError, match="no config 'ppo_tiny_cpuu'.*did you mean"):
        load_config("ppo_tiny_cpuu")
    assert plan_cli.main(["--config-name", "ppo_tiny_cpuu"]) == 2
    assert "did you mean" in capsys.readouterr().err
    assert plan_cli.main(["--config-name", "ppo_tiny_cpu", "--device-memory-gib", "-1"]) == 2
    assert "--device-memory-gib must be > 0" in capsys.readouterr().err


def test_activations_follow_recompute(cfgs):
    """The update's activations term follows the recompute_* keys: full recomputation of every layer equals the
    alternative figure the plan shows without it (which then goes), each mode keeps less than none, and the
    verdict's fix for activations names recomputation."""
    base = make_plan(cfgs["ppo_qwen25_32b_A3"]).memory["actor"]["train"]
    keys = {
        "full": ["recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=1"],
        "block": ["recompute_granularity=full", "recompute_method=block", "recompute_num_layers=2"],
        "selective": ["recompute_granularity=selective"],
        "activation": ["recompute_activation_function=true"],
    }
    got = {}
    for mode, kv in keys.items():
        cfg = load_config("ppo_qwen25_32b_A3", overrides=[f"+actor_config.{k}" for k in kv])
        plan = make_plan(cfg)
        got[mode] = plan.memory["actor"]["train"]
        assert not any("recompute" in n for n in plan.notes), plan.notes
        assert "recompute" in to_text(plan)
    assert got["full"]["activations_bytes"] == base["activations_recompute_bytes"]
    assert "activations_recompute_bytes" not in got["full"] and "activations_recompute_bytes" in got["selective"]
    for mode in ("block", "selective", "activation"):
        assert got["full"]["activations_bytes"] < got[mode]["activations_bytes"] < base["activations_bytes"], mode
    layout = make_plan(cfgs["ppo_qwen25_32b_A3"]).layouts["actor"]
    assert "recompute_granularity: full" in plan_fix_for_activations(cfgs["ppo_qwen25_32b_A3"], layout)


def plan_fix_for_activations(cfg, layout) -> str:
    from dataclasses import replace

    from mindrl.plan.planner import fix_key

    cannot_raise_tp = replace(layout, tp=cfg.model.num_kv_heads, micro_batch_size=1, sequence_parallel=True)
    return fix_key(cfg, "actor", "train", "activations_bytes", {"actor": cannot_raise_tp}, True)


def test_plan_recipes_tool_tables_a_configs_folder(capsys):
    """tools/plan_recipes.py on the repo's configs/ (a MindSpeed-RL-style folder): every training recipe is a row;
    a recipe that loads shows its device and verdict, the others the config's first error."""
    import os

    from mindrl.config.loader import default_config_dir
    from tools import plan_recipes

    CONFIG_DIR = default_config_dir()  # noqa: N806

    rows = {
        r.recipe: r for r in (plan_recipes.plan_recipe(CONFIG_DIR, n, None) for n in plan_recipes.recipes(CONFIG_DIR))
    }
    assert set(RECIPES) <= set(rows) and "sft_tiny_cpu" not in rows
    assert all(rows[n].loads and rows[n].fits and rows[n].device == d for n, d in RECIPES.items())
    assert plan_recipes.main([CONFIG_DIR, "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| grpo_qwen25_32b_A2 | yes | 910b | FITS |" in out
    assert plan_recipes.main([os.path.join(CONFIG_DIR, "nowhere")]) == 2


def test_swap_optimizer_counts_the_optimizer_state_in_the_steps_only(cfgs):
    """megatron_training.swap_optimizer (ppo_qwen25_32b_A3 with its optimizer switch off): the actor's optimizer state
    leaves every phase and the update's forward / backward, and appears in a 'step' phase of its own, which holds the
    update's weights and grads beside it but not its activations (the micro-batches are done)."""
    keep = ["generate_config.offload_train_optimizer=false"]
    plain = make_plan(load_config("ppo_qwen25_32b_A3", overrides=keep))
    swap = make_plan(load_config("ppo_qwen25_32b_A3", overrides=[*keep, "megatron_training.swap_optimizer=true"]))
    opt = plain.memory["actor"]["train"]["optimizer_bytes"]
    assert opt > 0 and "step" not in plain.memory["total"]
    for phase in ("rollout", "score", "critic_train", "train"):
        assert swap.memory["actor"][phase]["optimizer_bytes"] == 0, phase
        assert swap.memory["total"][f"{phase}_bytes"] == plain.memory["total"][f"{phase}_bytes"] - (
            opt if phase != "score" or plain.memory["actor"]["score"]["optimizer_bytes"] else 0
        ), phase
    step, train = swap.memory["actor"]["step"], plain.memory["actor"]["train"]
    assert step["optimizer_bytes"] == opt and step["activations_bytes"] == 0
    assert step["weights_bytes"] == train["weights_bytes"] and step["grads_bytes"] == train["grads_bytes"]
    assert swap.memory["critic"]["step"] == swap.memory["critic"]["train"]
    assert swap.residency["actor"]["train"] == "weights+grads on" and swap.residency["actor"]["step"] == "resident"
