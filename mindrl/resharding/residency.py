"""Which state of each model is on the device in each phase of an integrated iteration (MindSpeed-RL's
`offload_train_*` semantics): the one schedule the workers follow and the planner sizes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mindrl.resharding.offload import KINDS, OffloadConfig

PHASES = ("rollout", "score", "critic_train", "train")
"""An iteration: rollout (the engine awake), scoring (old / reference logprobs, critic values, reward-model scores), the
critic's update, then the actor's update."""
STEP = "step"
"""Within the actor's update ("train"), its optimizer steps: a phase of its own where `swap_optimizer` keeps the
optimizer state on the host through the forward and backward passes and brings it to the device only for them."""
PLAN_PHASES = (*PHASES, STEP)
"""Every phase `on_device` answers for; the planner sizes STEP apart only with swap_optimizer."""
MODELS = ("actor", "reference", "critic", "reward")
TERMS = {"param": "weights", "grad": "grads", "optimizer": "optimizer"}
"""Offload kind -> the ledger's and the planner's name of that term."""


@dataclass(frozen=True)
class ResidencySchedule:
    """What each model keeps on the device, by phase (`on_device`).

    - actor: everything while it updates (train); while the engine runs (rollout) and during the critic's update,
      only the kinds whose `offload_train_*` switch is off; during scoring also its weights when it computes old
      logprobs (not on-policy), never its grads or optimizer state unless their switch is off;
    - reference: its weights during scoring (its forward) only;
    - critic (`critic_offload`): its weights during scoring, everything during its update, nothing otherwise;
    - reward (the reward model, forward only: weights only): its weights during scoring, nothing otherwise (always
      on the device without `reward_offload`).
    With `swap_optimizer` the actor's optimizer state is on the device only in STEP (its optimizer steps), as if
    offload_train_optimizer were on, and also off it through the update's forward and backward ("train").
    The rollout engine is awake during the rollout only (asleep elsewhere where the platform has sleep mode).
    """

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """The actor's switches (generate_config.offload_train_*)."""
    actor_forward: bool = True
    """The actor computes old logprobs while scoring (False on-policy: they are the rollout's)."""
    critic_offload: bool = True
    """The critic leaves the device outside its own phases (MindSpeed-RL always offloads it)."""
    reward_offload: bool = True
    """The reward model leaves the device outside scoring."""
    reference_offload: bool = True
    """The reference leaves the device outside scoring (False: on devices of its own, separate placement)."""
    swap_optimizer: bool = False
    """The actor's optimizer state comes to the device for its optimizer steps only (megatron_training.swap_optimizer)."""

    @property
    def actor_offload(self) -> OffloadConfig:
        """The kinds the actor moves off the device around the rollout: its switches, plus the optimizer state with
        swap_optimizer (which is never on the device outside a step)."""
        if self.swap_optimizer and not self.offload.offload_train_optimizer:
            return replace(self.offload, offload_train_optimizer=True)
        return self.offload

    def on_device(self, model: str, phase: str) -> frozenset[str]:
        """The kinds (`mindrl.resharding.offload.KINDS`) of `model`'s state on the device during `phase`."""
        if model not in MODELS or phase not in PLAN_PHASES:
            raise ValueError(f"unknown model {model!r} or phase {phase!r}: expected one of {MODELS} and {PLAN_PHASES}")
        kept = frozenset(KINDS) - frozenset(self.actor_offload.kinds)
        if model != "actor" and phase == STEP:
            phase = "train"
        if model == "actor":
            if phase == STEP:
                return frozenset(KINDS)
            if phase == "train":
                return frozenset(KINDS) - ({"optimizer"} if self.swap_optimizer else set())
            if phase == "score" and self.actor_forward:
                return kept | {"param"}
            return kept
        if model == "reference":
            return frozenset({"param"}) if phase == "score" or not self.reference_offload else frozenset()
        if model == "reward":
            return frozenset({"param"}) if phase == "score" or not self.reward_offload else frozenset()
        if not self.critic_offload:
            return frozenset(KINDS)
        return {"score": frozenset({"param"}), "critic_train": frozenset(KINDS)}.get(phase, frozenset())

    def on_entry(self, model: str, phase: str) -> frozenset[str]:
        """What `model` holds when `phase` begins: `on_device`, except that the actor's weights stay on the device
        into the rollout, whose weight stream reads them (the hybrid engine offloads them once streamed)."""
        on = self.on_device(model, phase)
        return on | {"param"} if model == "actor" and phase == "rollout" else on

    @staticmethod
    def engine_awake(phase: str) -> bool:
        return phase == "rollout"

    def describe(self, model: str, phase: str) -> str:
        """'resident', 'offloaded', or which terms are on the device ('weights on')."""
        on = self.on_device(model, phase)
        if model in ("reference", "reward"):
            return "resident" if on else "offloaded"
        if on == frozenset(KINDS):
            return "resident"
        return "offloaded" if not on else "+".join(TERMS[k] for k in KINDS if k in on) + " on"
