"""Separate placement's keys (use_integrated_worker: false): each role's devices, OpenRLHF's merges, and each
contradiction or missing resource named by its key."""

from __future__ import annotations

import pytest

from mindrl.config import ConfigError, load_config
from mindrl.config.placement import device_groups
from mindrl.trainer.worker_groups import require_runnable
from tests.config.test_errors import errors, issue

SEP = ["rl_config.use_integrated_worker=false"]
OWN = [*SEP, "+rl_config.reference_resource.num_npus=2", "rl_config.critic_resource.num_npus=2",
       "rl_config.reward_resource.num_npus=1", "+rl_config.rollout_resource.num_npus=2"]  # fmt: skip


def _groups(cfg):
    rl = cfg.rl_config
    g = device_groups(rl, rl.needs_reference, cfg.critic_config is not None, cfg.reward_config is not None)
    return [(x.roles, x.first, x.size) for x in g]


def test_each_role_on_its_own_devices():
    cfg = load_config("ppo_tiny_cpu_rm", overrides=OWN)
    assert _groups(cfg) == [(("actor",), 0, 2), (("reference",), 2, 2), (("critic",), 4, 2), (("reward",), 6, 1),
                            (("rollout",), 7, 2)]  # fmt: skip
    require_runnable(cfg)  # the engines run on their own devices, fed over the weight group
    assert cfg.rl_config.infer_dp == 2 // cfg.generate_config.infer_tensor_parallel_size  # rollout_resource's devices
    bounded = load_config("ppo_tiny_cpu_rm", overrides=[*OWN, "rl_config.async_mode=bounded"])
    with pytest.raises(ConfigError, match="rl_config.rollout_resource: engines on devices of their own cannot serve .*"
                       r"\(rl_config.async_mode: bounded\)"):  # fmt: skip
        require_runnable(bounded)


def test_merges_and_mindspeed_names():
    cfg = load_config("ppo_tiny_cpu_rm", overrides=[*SEP, "+rl_config.colocate_actor_ref=true",
                      "+rl_config.colocate_critic_reward=true", "+rl_config.ref_reward_offload=true"])  # fmt: skip
    # MindSpeed-RL's layout: the engines in the actor's processes, the reward model on the critic's devices.
    assert _groups(cfg) == [(("actor", "reference", "rollout"), 0, 2), (("critic", "reward"), 2, 2)]
    assert "rl_config.reward_resource" in cfg.ignored_keys  # it equals the critic's: the merge wins, noted
    ms = load_config("ppo_tiny_cpu_rm", overrides=[*OWN[:1], "+rl_config.ref_resource.num_npus=2", *OWN[2:]])
    assert ms.rl_config.reference_resource.num_npus == 2
    integrated = load_config("ppo_tiny_cpu_rm")
    assert _groups(integrated) == [(("actor", "reference", "critic", "reward", "rollout"), 0, 2)]


def test_contradictions_and_missing_devices_name_their_keys():
    err = errors("ppo_tiny_cpu_rm", *SEP, "rl_config.reward_resource.num_npus=3", "+rl_config.colocate_critic_reward=true",
                 "+rl_config.colocate_actor_ref=true", "+rl_config.reference_resource.num_npus=4",
                 "+rl_config.rollout_resource.num_npus=3", "rl_config.num_cpu_devices=4")  # fmt: skip
    issue(err, "rl_config.reward_resource.num_npus", "3 contradicts colocate_critic_reward")
    issue(err, "rl_config.reference_resource.num_npus", "4 contradicts colocate_actor_ref")
    issue(err, "generate_config.infer_tensor_parallel_size", "does not divide the 3 devices",
          "rl_config.rollout_resource.num_npus")  # fmt: skip
    err = errors("ppo_tiny_cpu_rm", *SEP, "~rl_config.critic_resource", "+rl_config.ref_reward_offload=true")
    issue(err, "rl_config.reference_resource.num_npus", "is required", "colocate_actor_ref")
    issue(err, "rl_config.critic_resource.num_npus", "is required")
    issue(err, "rl_config.ref_reward_offload", "set colocate_actor_ref or colocate_critic_reward")
    err = errors("grpo_tiny_cpu", "+reward_config.load=/ckpt/rm", *SEP, "+rl_config.colocate_critic_reward=true",
                 "+rl_config.colocate_actor_ref=true")  # fmt: skip
    issue(err, "rl_config.colocate_critic_reward", "no critic")
    err = errors("ppo_tiny_cpu_rm", *OWN, "rl_config.num_cpu_devices=8")
    issue(err, "rl_config.num_cpu_devices", "cannot hold the 9 devices")
    err = errors(
        "ppo_tiny_cpu_rm", *[o.replace("reference_resource.num_npus=2", "reference_resource.num_npus=3") for o in OWN]
    )
    issue(err, "actor_config.tensor_model_parallel_size", "does not divide the 3 devices",
          "rl_config.reference_resource.num_npus")  # fmt: skip
    err = errors("ppo_tiny_cpu_rm", "+rl_config.colocate_actor_ref=true", "+rl_config.rollout_resource.num_npus=2")
    issue(err, "rl_config.colocate_actor_ref", "switch of separate placement")
    issue(err, "rl_config.rollout_resource", "must not be set", "use_integrated_worker: false")


def test_reference_sync_needs_the_reference_beside_the_actor():
    err = errors("ppo_tiny_cpu_rm", *OWN, "+rl_config.sync_ref_model=true")
    issue(err, "rl_config.sync_ref_model", "colocate_actor_ref: true")
    over = [*SEP, "+rl_config.colocate_actor_ref=true", "+rl_config.sync_ref_model=true"]
    assert load_config("ppo_tiny_cpu_rm", overrides=over).rl_config.sync_ref_model
