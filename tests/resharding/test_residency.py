"""The residency schedule (`mindrl.resharding.residency`): what each model keeps on the device in each phase, for
each offload_train_* switch, as MindSpeed-RL's workers do."""

from __future__ import annotations

import itertools

import pytest

from mindrl.resharding import KINDS, OffloadConfig
from mindrl.resharding.residency import MODELS, PHASES, ResidencySchedule

ALL = frozenset(KINDS)
NONE: frozenset[str] = frozenset()


@pytest.mark.parametrize("switches", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("actor_forward", [True, False])
def test_actor_keeps_what_its_switches_leave_outside_its_update(switches, actor_forward):
    offload = OffloadConfig(*switches)  # optimizer, grad, param
    s = ResidencySchedule(offload, actor_forward=actor_forward)
    kept = ALL - set(offload.kinds)
    assert s.on_device("actor", "train") == ALL
    assert s.on_device("actor", "rollout") == kept
    assert s.on_device("actor", "critic_train") == kept
    # scoring: its weights for the old logprobs (not on-policy), never grads or optimizer state its switches move
    assert s.on_device("actor", "score") == (kept | {"param"} if actor_forward else kept)
    # the rollout's weight stream reads the weights: they are on the device when it begins
    assert s.on_entry("actor", "rollout") == kept | {"param"}
    assert all(s.on_entry("actor", p) == s.on_device("actor", p) for p in PHASES if p != "rollout")


def test_each_switch_moves_only_its_own_kind():
    base = ResidencySchedule(OffloadConfig())
    for field, kind in (("offload_train_optimizer", "optimizer"), ("offload_train_grad", "grad"),
                        ("offload_train_param", "param")):  # fmt: skip
        s = ResidencySchedule(OffloadConfig(**{field: True}))
        for phase in PHASES:
            diff = base.on_device("actor", phase) - s.on_device("actor", phase)
            assert diff == ({kind} if phase in ("rollout", "critic_train") or (phase == "score" and kind != "param")
                            else NONE), (field, phase)  # fmt: skip
            for model in ("reference", "critic"):
                assert s.on_device(model, phase) == base.on_device(model, phase)


def test_reference_critic_and_engine():
    s = ResidencySchedule(OffloadConfig(True, True, True))
    assert {p: s.on_device("reference", p) for p in PHASES} == {
        "rollout": NONE, "score": {"param"}, "critic_train": NONE, "train": NONE}  # fmt: skip
    assert {p: s.on_device("critic", p) for p in PHASES} == {
        "rollout": NONE, "score": {"param"}, "critic_train": ALL, "train": NONE}  # fmt: skip
    kept = ResidencySchedule(critic_offload=False)
    assert all(kept.on_device("critic", p) == ALL for p in PHASES)
    assert [p for p in PHASES if s.engine_awake(p)] == ["rollout"]
    assert s.describe("critic", "score") == "weights on" and s.describe("actor", "train") == "resident"
    assert s.describe("actor", "rollout") == "offloaded" and s.describe("reference", "score") == "resident"
    with pytest.raises(ValueError, match="unknown model 'engine'"):
        s.on_device("engine", "score")
    assert {p: s.on_device("reward", p) for p in PHASES} == {
        "rollout": NONE, "score": {"param"}, "critic_train": NONE, "train": NONE}  # fmt: skip
    assert all(ResidencySchedule(reward_offload=False).on_device("reward", p) == {"param"} for p in PHASES)
    assert s.describe("reward", "score") == "resident" and s.describe("reward", "train") == "offloaded"
    assert set(MODELS) == {"actor", "reference", "critic", "reward"}


def test_the_trainer_and_the_planner_read_one_schedule():
    from mindrl.config import load_config
    from mindrl.workers import from_config

    cfg = load_config("ppo_tiny_cpu", overrides=["generate_config.offload_train_param=false"])
    s = from_config.residency(cfg)
    assert s.offload == OffloadConfig(True, True, False)
    assert s.actor_forward == (not cfg.rl_config.on_policy)
