"""The run's worker groups on one placement group: integrated mode (every model on every bundle) or separate
placement (each device group of mindrl.config.placement on its own bundles; docs/placement.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mindrl.config.errors import ConfigError, Issue
from mindrl.config.placement import device_groups, job_devices
from mindrl.workers import from_config
from mindrl.workers.critic_worker import CriticWorker
from mindrl.workers.group import WorkerGroup, device_placement_group, worker_threads
from mindrl.workers.integrated_worker import IntegratedWorker
from mindrl.workers.reference_worker import ReferenceWorker
from mindrl.workers.results import DeviceLedger
from mindrl.workers.reward_worker import RewardWorker
from mindrl.workers.rollout_worker import RolloutWorker

WORKER = {"actor": IntegratedWorker, "reference": ReferenceWorker, "critic": CriticWorker, "reward": RewardWorker,
          "rollout": RolloutWorker}  # fmt: skip


@dataclass
class ModelGroups:
    """The groups and the first device (bundle) of each; `reference` is None when the actor's processes hold it."""

    pg: Any
    actor: WorkerGroup
    critic: WorkerGroup | None = None
    reward_model: WorkerGroup | None = None
    reference: WorkerGroup | None = None
    rollout: WorkerGroup | None = None
    """The engines on devices of their own (rollout_resource); None when they run in the actor's processes."""
    first_device: dict[str, int] = field(default_factory=dict)

    def device_ledgers(self, ledgers: dict[str, list[DeviceLedger]]) -> list[DeviceLedger]:
        """Group name -> its ranks' ledgers (rank order) -> one merged ledger per device of the job."""
        by_device: dict[int, list[DeviceLedger]] = {}
        for name, parts in ledgers.items():
            for i, part in enumerate(parts):
                by_device.setdefault(self.first_device[name] + i, []).append(part)
        return [DeviceLedger.merge(by_device[d]) for d in sorted(by_device)]


def total_devices(cfg) -> int:
    """Bundles the run reserves: actor_resource.num_npus, or the sum of separate placement's device groups."""
    return job_devices(cfg)


def require_runnable(cfg) -> None:
    """Engines on devices of their own (rollout_resource) serve the trainer's own rollouts only: not together with
    rollout servers or async_mode bounded's samplers, which generate elsewhere."""
    rl, gen = cfg.rl_config, cfg.generate_config
    if rl.use_integrated_worker or rl.rollout_resource is None:
        return
    why = ("generate_config.rollout_mode: server" if gen.rollout_mode == "server"
           else "rl_config.async_mode: bounded" if rl.async_mode == "bounded" else None)  # fmt: skip
    if why:
        why = f"engines on devices of their own cannot serve a run whose rollouts come from elsewhere ({why})"
        raise ConfigError([Issue("rl_config.rollout_resource", why, cfg.source)], cfg.config_name)


def reserve(cfg):
    """The placement group: one bundle per device of the job (`total_devices`)."""
    return device_placement_group(total_devices(cfg))


def build_groups(cfg, pg, has_reward: bool, created: list) -> ModelGroups:
    """Spawn every model's ranks on `pg` (`reserve`), each group appended to `created` as it starts (for the caller's
    cleanup). Integrated mode: the actor takes half of each device and the critic and the reward model split the
    rest. Separate placement: the processes of a device group split its devices."""
    rl = cfg.rl_config
    groups = device_groups(rl, rl.needs_reference, rl.needs_critic, has_reward)
    threads = worker_threads(pg, sum(g.size for g in groups))  # a node's cores shared among the job's ranks on it
    env = from_config.worker_env(cfg)  # also in the job's runtime env, which a Ray started elsewhere lacks
    out = ModelGroups(pg, None)  # type: ignore[arg-type]
    for g in groups:
        # The engines run in the actor's processes unless they have devices of their own; so does a reference
        # merged onto the actor's devices.
        merged = ("rollout", "reference") if "actor" in g.roles else ()
        roles = [r for r in g.roles if r not in merged or r == g.roles[0]]
        share = 1.0 / len(roles) if not rl.use_integrated_worker else None
        for role in roles:
            fraction = share or (0.5 if role == "actor" else 0.5 / (len(roles) - 1))
            group = WorkerGroup(WORKER[role], role, pg, g.size, fraction, threads[g.first : g.first + g.size], g.first,
                                env=env)  # fmt: skip
            created.append(group)
            out.first_device[role] = g.first
            setattr(out, {"reward": "reward_model"}.get(role, role), group)
    return out
