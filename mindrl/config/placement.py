"""Which roles share which devices: integrated mode (every role on the actor's devices) or separate placement
(`use_integrated_worker: false`, each role on its own `*_resource`, with OpenRLHF's merges). docs/placement.md."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("actor", "reference", "critic", "reward", "rollout")
RESOURCE_KEY = {
    "actor": "actor_resource",
    "reference": "reference_resource",
    "critic": "critic_resource",
    "reward": "reward_resource",
    "rollout": "rollout_resource",
}


@dataclass(frozen=True)
class DeviceGroup:
    """Devices [first, first + size) of the job and the roles that run on them (the first role owns the
    resource key; the others are merged onto it)."""

    roles: tuple[str, ...]
    first: int
    size: int

    @property
    def devices(self) -> range:
        return range(self.first, self.first + self.size)

    @property
    def key(self) -> str:
        return f"rl_config.{RESOURCE_KEY[self.roles[0]]}.num_npus"


def device_groups(rl, has_reference: bool, has_critic: bool, has_reward: bool) -> list[DeviceGroup]:
    """The job's device groups in placement order (actor, reference, critic, reward, rollout), from a validated
    rl_config. Integrated mode: one group of actor_resource.num_npus devices holding every role."""
    present = {"actor": True, "reference": has_reference, "critic": has_critic, "reward": has_reward,
               "rollout": True}  # fmt: skip
    if rl.use_integrated_worker:
        return [DeviceGroup(tuple(r for r in ROLES if present[r]), 0, rl.world_size)]
    host = {  # the role whose devices a merged role runs on
        "reference": "actor" if rl.colocate_actor_ref else None,
        "reward": "critic" if rl.colocate_critic_reward else None,
        "rollout": "actor" if rl.rollout_resource is None else None,
    }
    groups: list[DeviceGroup] = []
    first = 0
    for role in ROLES:
        if not present[role] or host.get(role):
            continue
        merged = tuple(r for r in ROLES if present[r] and host.get(r) == role)
        size = int(getattr(rl, RESOURCE_KEY[role]).num_npus)
        groups.append(DeviceGroup((role, *merged), first, size))
        first += size
    return groups


def job_devices(cfg) -> int:
    """Devices of the whole job (a validated RLConfig): actor_resource.num_npus, or the sum of separate placement's
    groups."""
    rl = cfg.rl_config
    return sum(g.size for g in device_groups(rl, rl.needs_reference, rl.needs_critic, cfg.reward_config is not None))


def check(cfg, col) -> dict[str, tuple[int | None, str]]:
    """Separate placement's rules that span sections (each present role has its devices; merges that contradict
    the resources or have no host). Returns role -> (its devices, the key that sets them) for the layout checks."""
    rl = cfg.rl_config
    actor = (rl.actor_resource.num_npus, "rl_config.actor_resource.num_npus")
    if rl.use_integrated_worker:
        return dict.fromkeys(ROLES, actor)
    has_ref, has_critic, has_reward = rl.needs_reference, cfg.critic_config is not None, cfg.reward_config is not None
    out = {"actor": actor}
    if rl.colocate_actor_ref:
        if not has_ref:
            col.ignore("rl_config.colocate_actor_ref", "there is no reference model (no KL term)")
        out["reference"] = actor
    else:
        out["reference"] = _own(rl, col, "reference", has_ref, "a KL term needs a reference model; or set "
                                "colocate_actor_ref: true to run it on the actor's devices")  # fmt: skip
    if rl.sync_ref_model and has_ref and not rl.colocate_actor_ref:
        col.add("rl_config.sync_ref_model", "mixes the actor into the reference in place, so the reference must sit "
                "with the actor: set colocate_actor_ref: true (separate placement)")  # fmt: skip
    out["critic"] = _own(rl, col, "critic", has_critic, "the critic (adv_estimator gae) needs its own devices")
    if rl.colocate_critic_reward and has_reward:
        if not has_critic:
            col.add("rl_config.colocate_critic_reward", "puts the reward model on the critic's devices, but there is "
                    f"no critic (adv_estimator {rl.adv_estimator}); give it reward_resource instead")  # fmt: skip
        c, r = rl.critic_resource, rl.reward_resource
        if c is not None and r is not None and r.num_npus != c.num_npus:
            col.add("rl_config.reward_resource.num_npus", f"{r.num_npus} contradicts colocate_critic_reward: true "
                    f"(the reward model runs on the critic's {c.num_npus} devices); remove one of them")  # fmt: skip
        elif r is not None:
            col.ignore(
                "rl_config.reward_resource", "colocate_critic_reward puts the reward model on the critic's devices"
            )
        out["reward"] = out["critic"]
    else:
        if rl.colocate_critic_reward:
            col.ignore("rl_config.colocate_critic_reward", "there is no reward model (reward_config)")
        out["reward"] = _own(rl, col, "reward", has_reward, "a reward model (reward_config) needs its own devices; or "
                             "set colocate_critic_reward: true to run it on the critic's")  # fmt: skip
    out["rollout"] = actor if rl.rollout_resource is None else _own(rl, col, "rollout", True, "")
    if not any(col.is_bad(f"rl_config.{k}", f"rl_config.{k}.num_npus") for k in RESOURCE_KEY.values()):
        total = sum(g.size for g in device_groups(rl, has_ref, has_critic, has_reward))
        if rl.num_cpu_devices is not None and rl.num_cpu_devices < total:
            col.add("rl_config.num_cpu_devices", f"{rl.num_cpu_devices} stand-in devices cannot hold the {total} "
                    "devices of the separate placement (the sum of the roles' num_npus; mindrl-plan lists them)")  # fmt: skip
    return out


def _own(rl, col, role: str, present: bool, why: str) -> tuple[int | None, str]:
    """A role on its own devices: its resource must be set (with num_npus) when the role is present."""
    key = f"rl_config.{RESOURCE_KEY[role]}"
    res = getattr(rl, RESOURCE_KEY[role])
    if not present:
        if res is not None:
            col.ignore(key, f"there is no {role} model in this run")
        return None, f"{key}.num_npus"
    if res is None or res.num_npus is None:
        col.add(f"{key}.num_npus", f"is required with use_integrated_worker: false: {why}")
        return None, f"{key}.num_npus"
    return res.num_npus, f"{key}.num_npus"
