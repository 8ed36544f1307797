"""mindrl-plan on separate placement: each device group holds only its roles; a group sized alone equals the same
roles' terms in an integrated plan of the same layout; OpenRLHF's 16-device 7B example and MindSpeed-RL's merges."""

from __future__ import annotations

from mindrl.cli.plan import main as plan_main
from mindrl.config import load_config
from mindrl.plan import make_plan, to_json, to_text
from mindrl.plan.planner import make_plan as integrated_plan

SEP = ["rl_config.use_integrated_worker=false", "+rl_config.reference_resource.num_npus=2",
       "rl_config.critic_resource.num_npus=2", "rl_config.reward_resource.num_npus=1",
       "+rl_config.rollout_resource.num_npus=2"]  # fmt: skip


def test_groups_hold_their_roles_and_match_the_integrated_terms():
    sep = make_plan(load_config("ppo_tiny_cpu_rm", overrides=SEP), device="host", device_memory_gib=4)
    assert [(g.roles, g.devices) for g in sep.groups] == [
        (("actor",), [0, 1]), (("reference",), [2, 3]), (("critic",), [4, 5]), (("reward",), [6]), (("rollout",), [7, 8])
    ]  # fmt: skip
    integ = integrated_plan(load_config("ppo_tiny_cpu_rm"), device="host", device_memory_gib=4)
    by_role = {g.roles[0]: g.memory for g in sep.groups}
    # Same layouts (TP 2 on 2 devices): the resident state of each model equals its integrated training-phase terms,
    # and nothing of another model is counted.
    assert by_role["actor"]["actor"]["train"] == integ.memory["actor"]["train"]
    assert by_role["critic"]["critic"]["critic_train"] == integ.memory["critic"]["critic_train"]
    assert by_role["reference"]["reference"]["score"] == integ.memory["reference"]["score"]
    assert (
        by_role["reward"]["reward"]["score"]["activations_bytes"]
        == integ.memory["reward"]["score"]["activations_bytes"]
    )
    assert all(set(m) == {g.roles[0], "total"} for g, m in zip(sep.groups, by_role.values()))
    # Alone on its devices a model stays loaded; the engine never sleeps.
    assert by_role["reference"]["reference"]["train"]["weights_bytes"] > 0
    assert by_role["rollout"]["rollout"]["train"] == by_role["rollout"]["rollout"]["rollout"]
    assert sep.verdict["fits"] and sep.world == 9
    assert "groups" in to_json(sep) and "devices 7-8 (node 0): rollout" in to_text(sep)


def test_merges_offload_the_guest():
    over = ["rl_config.use_integrated_worker=false", "+rl_config.colocate_actor_ref=true",
            "+rl_config.colocate_critic_reward=true", "+rl_config.ref_reward_offload=true"]  # fmt: skip
    plan = make_plan(load_config("ppo_tiny_cpu_rm", overrides=over), device="host", device_memory_gib=4)
    actor, critic = plan.groups
    assert actor.roles == ("actor", "reference", "rollout") and critic.roles == ("critic", "reward")
    assert actor.residency["reference"]["train"] == "offloaded" and critic.residency["reward"]["train"] == "offloaded"
    kept = make_plan(load_config("ppo_tiny_cpu_rm", overrides=over[:-1]), device="host", device_memory_gib=4)
    assert kept.groups[1].residency["reward"]["train"] == "resident"


def test_openrlhf_7b_example_on_16_devices(capsys):
    plan = make_plan(load_config("ppo_qwen25_7b_separate_H100"))
    assert plan.device.key == "h100" and plan.world == 16
    assert [(g.roles[0], len(g.devices)) for g in plan.groups] == [
        ("actor", 4), ("reference", 2), ("critic", 4), ("reward", 2), ("rollout", 4)
    ]  # fmt: skip
    assert plan.rollout.replicas == 4 and plan.verdict["fits"]
    assert plan_main(["--config-name", "ppo_qwen25_7b_separate_H100"]) == 0
    out = capsys.readouterr().out
    assert "separate placement (use_integrated_worker: false): 5 device groups" in out
    assert "devices 12-15 (node 1): rollout  [rl_config.rollout_resource.num_npus]" in out
