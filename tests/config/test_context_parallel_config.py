"""context_parallel_size / context_parallel_algo at load: per role, in the world's arithmetic (DP = devices / (TP x PP
x CP)), their errors naming the key and the file, and MindSpeed-RL's CP2 recipes loading unchanged."""

from __future__ import annotations

from mindrl.config import load_config
from tests.config.test_errors import errors, issue


def test_cp_sets_the_role_and_the_dp():
    cfg = load_config("grpo_tiny_cpu", overrides=["actor_config.tensor_model_parallel_size=1",
                                                  "actor_config.context_parallel_size=2"])  # fmt: skip
    assert cfg.actor_config.cp == 2 and cfg.actor_config.context_parallel_algo == "megatron_cp_algo"
    assert cfg.rl_config.actor_dp == 1  # 2 devices / (TP1 x PP1 x CP2)
    assert "actor_config.context_parallel_size" not in cfg.ignored_keys
    # megatron_training's value is the roles' default, as for the other layout keys (MindSpeed-RL's merge)
    cfg = load_config("grpo_tiny_cpu", overrides=["+megatron_training.context_parallel_size=2",
                                                  "actor_config.tensor_model_parallel_size=1"])  # fmt: skip
    assert cfg.actor_config.cp == 2 and cfg.rl_config.actor_dp == 1


def test_cp_errors_name_the_key():
    issue(errors("grpo_tiny_cpu", "actor_config.context_parallel_size=2"), "actor_config.context_parallel_size",
          "TP x PP x CP = 2 x 1 x 2 = 4 does not divide the 2 devices")  # fmt: skip
    issue(errors("grpo_tiny_cpu", "actor_config.context_parallel_size=0"), "actor_config.context_parallel_size",
          "must be >= 1")  # fmt: skip
    issue(errors("grpo_tiny_cpu", "+actor_config.context_parallel_algo=ulysses_cp_algo"),
          "actor_config.context_parallel_algo", "'ulysses_cp_algo' is not supported; use megatron_cp_algo")  # fmt: skip


def test_mindspeed_cp2_recipes_load():
    for name in ("dapo_qwen25_32b_A3_32k", "dapo_qwen25_32b_A2_20k"):
        cfg = load_config(name)
        a = cfg.actor_config
        assert (a.tp, a.pp, a.cp, a.context_parallel_algo) == (8, 2, 2, "megatron_cp_algo"), name
        assert cfg.rl_config.use_remove_padding and cfg.rl_config.actor_dp == 2
