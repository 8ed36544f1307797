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


@pytest.mark.parametrize("switches", [(False, False, False), (True, True, True), (False, True, True)])
def test_swap_optimizer_keeps_the_actors_optimizer_state_on_the_host_outside_its_steps(switches):
    """megatron_training.swap_optimizer: the optimizer state is on the device in the optimizer steps (STEP) only,
    not through the update's forward and backward; every other kind, and every other model, as without it."""
    from mindrl.resharding.residency import PLAN_PHASES, STEP

    plain, swap = (
        ResidencySchedule(OffloadConfig(*switches)),
        ResidencySchedule(OffloadConfig(*switches), swap_optimizer=True),
    )
    assert swap.on_device("actor", STEP) == ALL and swap.on_device("actor", "train") == ALL - {"optimizer"}
    assert plain.on_device("actor", STEP) == plain.on_device("actor", "train") == ALL
    for phase in PLAN_PHASES:
        assert "optimizer" not in swap.on_device("actor", phase) or phase == STEP, phase
        assert swap.on_device("actor", phase) | {"optimizer"} == plain.on_device("actor", phase) | {"optimizer"}, phase
        for model in ("reference", "critic", "reward"):
            assert swap.on_device(model, phase) == plain.on_device(model, phase), (model, phase)
    assert swap.actor_offload.kinds == tuple(k for k in KINDS if k == "optimizer" or k in plain.offload.kinds)
    assert swap.describe("actor", "train") == "weights+grads on" and swap.describe("actor", STEP) == "resident"


def test_swapped_optimizer_steps_leave_the_state_on_the_host_and_train_exactly():
    """`TrainStateOffloader.stepping`, what the worker wraps each of the actor's optimizer steps in under
    swap_optimizer: Adam's state (created by the first step inside it) is off the device after each step and on it
    during the step, and the weights are bit-identical to the same steps with the state never moved."""
    import torch

    from mindrl.resharding import TrainStateOffloader

    def run(swap: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        off = TrainStateOffloader([model], opt, OffloadConfig(offload_train_optimizer=True))
        held = []
        for i in range(3):
            opt.zero_grad()
            model(torch.full((4, 16), float(i + 1))).square().sum().backward()
            if swap:
                with off.stepping():
                    opt.step()
                    held.append(off.device_bytes()["optimizer"])
                assert off.device_bytes()["optimizer"] == 0 and off.host_bytes() > 0
            else:
                opt.step()
        return [p.detach().clone() for p in model.parameters()], held, off

    plain, _, _ = run(False)
    swapped, held, off = run(True)
    adam = 2 * (16 * 8 + 8) * 4  # exp_avg and exp_avg_sq of the weight and bias, fp32 (the step counters besides)
    assert all(h >= adam for h in held) and off.host_bytes() >= adam
    assert all(torch.equal(a, b) for a, b in zip(plain, swapped))
