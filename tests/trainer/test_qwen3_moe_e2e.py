"""A tiny Qwen3-MoE (configs/model/tiny_qwen3_moe.yaml) through mindrl-train's code path: GRPO with the actor at
expert parallelism 2 (megatron's all-to-all dispatcher on gloo, the load-balancing loss in the update), its weights
resharded every iteration into one vLLM engine per rank (each rank gathers the experts of the other EP rank), and
the every-step check that the engine samples from the trained policy; two epochs per batch with routing replay
(R2: the old-logprob pass's routing replayed in both epochs' updates)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.rl_helpers import _config, _train, checkpoint_tensors

pytestmark = pytest.mark.slow  # starts Ray and worker processes that import vLLM and megatron

MOE = ["model=tiny_qwen3_moe", "megatron_training.model=tiny_qwen3_moe", "actor_config.model=tiny_qwen3_moe"]


def _experts(ckpt: Path, scratch) -> dict:
    tensors = checkpoint_tensors(ckpt, scratch)
    return {k: v for k, v in tensors.items() if not k.startswith("optim/") and ".mlp." in k}


def test_tiny_qwen3_moe_grpo_at_ep2(moe_assets, tmp_path):
    overrides = [*MOE, "actor_config.tensor_model_parallel_size=1", "actor_config.expert_model_parallel_size=2",
                 "generate_config.infer_tensor_parallel_size=1", "megatron_training.train_iters=2",
                 "rl_config.use_tensorboard=false",
                 # routing replay: two epochs over each batch, so that the old-logprob pass runs and records the
                 # routing that both epochs' updates replay
                 "rl_config.epochs=2", "+rl_config.router_replay_mode=R2"]  # fmt: skip
    cfg = _config("grpo_tiny_cpu", moe_assets, tmp_path, *overrides)
    assert cfg.model.is_moe and cfg.actor_config.ep == 2 and cfg.rl_config.actor_dp == 2
    assert not cfg.rl_config.on_policy and cfg.rl_config.router_replay_mode == "R2"
    assert cfg.model.moe_training_overrides()["moe_aux_loss_coeff"] == 0.001
    run_dir, results, lines, rollouts = _train(cfg)
    assert len(lines) == 2
    for m in lines:
        # fp32: the engines sample from the trained policy, at the first iteration and after an update
        assert m["rollout/logprob_diff_mean"] < 1e-3, m["rollout/logprob_diff_mean"]
        assert m["actor/skipped_updates"] == 0 and m["actor/grad_norm"] > 0
        assert m["actor/moe_load_balancing_loss"] > 0  # the router's loss, logged per MoE layer and micro-batch
        # each expert's tokens over its even share, over both MoE layers' experts
        assert 0 <= m["actor/moe_expert_load_min"] <= 1 <= m["actor/moe_expert_load_max"] <= 4
        # the share of the replayed choices the routers would have made themselves (real tokens, both epochs)
        assert 0.5 < m["actor/moe_replay_agreement"] <= 1.0
    keys = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "actor/pg_loss", "actor/moe_replay_agreement",
            "actor/ppo_kl")  # fmt: skip
    print({k: [m.get(k) for m in lines] for k in keys})
    # Every expert of both EP ranks and the routers trained, and the saved experts keep their global numbers.
    start, trained = _experts(moe_assets / "actor", tmp_path), _experts(Path(run_dir) / "ckpt_actor", tmp_path)
    assert sorted(trained) == sorted(start)
    assert any("router" in k for k in trained) and all(not trained[k].equal(start[k]) for k in trained)
