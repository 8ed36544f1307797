"""A tiny Qwen3-MoE (configs/model/tiny_qwen3_moe.yaml with 3 layers) through mindrl-train's code path. DAPO
(dapo_tiny_cpu: dynamic sampling, the overlong buffer, clip-higher, token-level loss, no KL term and no reference
model): the actor at expert parallelism 2 (megatron's all-to-all dispatcher on gloo, the load-balancing loss in the
update), its weights resharded every iteration into one vLLM engine per rank (each rank gathers the experts of the
other EP rank), and the every-step check that the engine samples from the trained policy; two optimizer steps per
batch with routing replay (R2: the old-logprob pass's routing replayed in both steps' updates). GRPO at TP2 x EP2
and at PP2 x EP2 with uneven stages (2 + 1 layers), the two layouts' first iteration against each other within
fp32's own error on the same tokens (transformers fp32 against fp64)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.trainer.rl_helpers import _config, _train, check_layouts, checkpoint_tensors
from tests.trainer.test_dapo_e2e import _dapo_overrides, _groups, _penalty

pytestmark = pytest.mark.slow  # starts Ray and worker processes that import vLLM and megatron

MOE = ["model=tiny_qwen3_moe", "megatron_training.model=tiny_qwen3_moe", "actor_config.model=tiny_qwen3_moe",
       "model.tiny_qwen3_moe.num_layers=3"]  # fmt: skip
LAYOUTS = {  # 4 ranks each: TP2 x DP2 and PP2 x DP2, EP2 carved out of DP; one engine per rank
    "tp2ep2": ["actor_config.tensor_model_parallel_size=2", "actor_config.sequence_parallel=true"],
    "pp2ep2": ["actor_config.tensor_model_parallel_size=1", "actor_config.pipeline_model_parallel_size=2",
               "+actor_config.num_layer_list='2,1'"],
}  # fmt: skip


def _experts(ckpt: Path, scratch) -> dict:
    tensors = checkpoint_tensors(ckpt, scratch)
    return {k: v for k, v in tensors.items() if not k.startswith("optim/") and ".mlp." in k}


def test_tiny_qwen3_moe_dapo_at_ep2(moe_assets, tmp_path):
    # _dapo_overrides: a reward that varies on the random policy (the overlong penalty, responses stopping at the
    # first digit), dynamic sampling on it, 4 of the 8 prompts trained in 2 mini-batches (off-policy: the
    # old-logprob pass runs and records the routing that both updates replay)
    overrides = [*MOE, "actor_config.tensor_model_parallel_size=1", "actor_config.expert_model_parallel_size=2",
                 "generate_config.infer_tensor_parallel_size=1", "megatron_training.train_iters=2",
                 *_dapo_overrides(moe_assets), "+rl_config.router_replay_mode=R2"]  # fmt: skip
    cfg = _config("dapo_tiny_cpu", moe_assets, tmp_path, *overrides)
    rl = cfg.rl_config
    assert cfg.model.is_moe and cfg.actor_config.ep == 2 and rl.actor_dp == 2
    assert not rl.needs_reference and rl.clip_ratio_high > rl.clip_ratio_low and rl.loss_agg_mode == "token-mean"
    assert not rl.on_policy and rl.num_mini_batches == 2 and rl.router_replay_mode == "R2"
    assert cfg.model.moe_training_overrides()["moe_aux_loss_coeff"] == 0.001
    run_dir, results, lines, rollouts = _train(cfg)
    assert len(lines) == 2
    filtered = 0
    for m in lines:
        # fp32: the engines sample from the trained policy, at the first iteration and after an update
        assert m["rollout/logprob_diff_mean"] < 1e-3, m["rollout/logprob_diff_mean"]
        assert m["actor/skipped_updates"] == 0 and m["actor/grad_norm"] > 0 and m["actor/kl_loss"] == 0
        assert m["actor/moe_load_balancing_loss"] > 0  # the router's loss, logged per MoE layer and micro-batch
        # each expert's tokens over its even share, over both MoE layers' experts
        assert 0 <= m["actor/moe_expert_load_min"] <= 1 <= m["actor/moe_expert_load_max"] <= 4
        # the share of the replayed choices the routers would have made themselves (real tokens, both steps)
        assert 0.5 < m["actor/moe_replay_agreement"] <= 1.0
        # dynamic sampling: a group is dropped exactly when its rewards (with the overlong penalty) are all equal;
        # the trained groups' shaped score is the rule reward plus DAPO's penalty
        groups = _groups([r for r in rollouts if r["iteration"] == m["iteration"]], rl.n_samples_per_prompt)
        for g in groups:
            metric = [r["reward"] + _penalty(r["response_length"]) for r in g]
            assert (max(metric) == min(metric)) == (g[0]["dynamic_sampling"] == "filtered"), g
        fate = [g[0]["dynamic_sampling"] for g in groups]
        assert fate.count("trained") == rl.filter_groups_train_batch_size
        assert m["train/filtered_groups"] == fate.count("filtered") and m["train/generated_groups"] == len(groups)
        filtered += fate.count("filtered")
        trained = [r for g in groups if g[0]["dynamic_sampling"] == "trained" for r in g]
        shaped = [r["reward"] + _penalty(r["response_length"]) for r in trained]
        assert math.isclose(m["critic/score/mean"], sum(shaped) / len(shaped), abs_tol=1e-6)
    keys = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "actor/pg_loss", "actor/moe_replay_agreement",
            "actor/ppo_kl", "actor/pg_clipfrac", "train/filtered_groups", "reward/overlong_penalty")  # fmt: skip
    print({k: [m.get(k) for m in lines] for k in keys})
    assert filtered > 0  # the filter ran on this model's rollouts
    # Every expert of both EP ranks and the routers trained, and the saved experts keep their global numbers.
    start, trained = _experts(moe_assets / "actor", tmp_path), _experts(Path(run_dir) / "ckpt_actor", tmp_path)
    assert sorted(trained) == sorted(start)
    assert any("router" in k for k in trained) and all(not trained[k].equal(start[k]) for k in trained)


def test_tiny_qwen3_moe_grpo_tp2ep2_and_uneven_pp2(moe_assets, tmp_path):
    # entropy_coeff: the random policy's rewards are all 0 (zero advantages); the entropy term (and the routers'
    # load-balancing loss) moves the weights, so iteration 2's check sees the stream of updated weights
    common = [*MOE, "actor_config.expert_model_parallel_size=2",
              "rl_config.actor_resource.num_npus=4", "generate_config.infer_tensor_parallel_size=1",
              "rl_config.entropy_coeff=0.01", "megatron_training.train_iters=2", "rl_config.use_tensorboard=false"]  # fmt: skip
    runs = {}
    for name, layout in LAYOUTS.items():
        cfg = _config("grpo_tiny_cpu", moe_assets, tmp_path / name, *common, *layout)
        assert cfg.model.num_layers == 3 and cfg.actor_config.ep == 2 and cfg.rl_config.actor_dp == 2
        run_dir, _, lines, rollouts = _train(cfg)
        assert len(lines) == 2
        for m in lines:  # 8 experts a layer, top 2 (at most 4x an even share)
            assert m["actor/grad_norm"] > 0 and m["actor/skipped_updates"] == 0
            assert m["actor/moe_load_balancing_loss"] > 0
            assert 0 <= m["actor/moe_expert_load_min"] <= 1 <= m["actor/moe_expert_load_max"] <= 4, m
        runs[name] = (Path(run_dir), lines, [r for r in rollouts if r["iteration"] == 1])
    check_layouts(moe_assets, runs, torch.float32)
    print({n: [m["actor/moe_load_balancing_loss"] for m in lines] for n, (_, lines, _) in runs.items()})
    # Every expert of both EP ranks and the routers of all three layers trained, whatever stage held them.
    start = _experts(moe_assets / "actor", tmp_path)
    assert {k.split(".mlp.")[0] for k in start if "router" in k} == {f"decoder.layers.{i}" for i in range(3)}
    for run_dir, _, _ in runs.values():
        trained = _experts(run_dir / "ckpt_actor", tmp_path)
        assert sorted(trained) == sorted(start) and all(not trained[k].equal(start[k]) for k in trained)
