"""What each rank saves and restores of a model in training: the model, its optimizer state (loadable at any TP / PP
/ DP), LR scheduler and RNG states, bit-exactly; and a weights-only model (the synced reference). Collective calls.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

import torch

from mindrl.checkpoint import mcore_ckpt
from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.checkpoint.iterations import OPTIM_DIR, RANK_STATE_DIR
from mindrl.models.wrappers import unwrap

# The distributed optimizer's on-disk layout. megatron's `fully_reshardable` keeps each parameter's state in model
# space (keyed like the model's tensors), so it reloads onto any TP / PP / DP; `dp_reshardable` (per-DP-rank bucket
# shards, the layout of older checkpoints) reloads only at the TP / PP it was saved with.
DISTOPT_FORMAT = "fully_reshardable"
DP_ONLY_FORMAT = "dp_reshardable"
PLAIN_FORMAT = "plain"
logger = logging.getLogger("mindrl.checkpoint")


class ModelLayout(Protocol):
    """How the saved model is laid out (a worker's `ModelSettings` is one)."""

    tp: int
    pp: int
    dtype: str


def _distributed_optimizers(optimizer) -> list:
    """The megatron DistributedOptimizers inside `optimizer` (a chained optimizer or a single one)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in parts if isinstance(o, DistributedOptimizer)]


def _optim_format(optimizer) -> str:
    return DISTOPT_FORMAT if _distributed_optimizers(optimizer) else PLAIN_FORMAT


def _sharded_optim_state(optimizer, model_sd: dict, is_loading: bool, fmt: str | None = None) -> dict:
    if _distributed_optimizers(optimizer):
        metadata = {"distrib_optim_sharding_type": fmt or DISTOPT_FORMAT}
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading)


def _init_distopt_states(optimizer) -> None:
    """A freshly built DistributedOptimizer has no Adam state yet, and megatron builds its loading state dict from
    the existing state: create it (zeros) with one no-op step. lr and weight decay are 0 during that step, so the
    weights are not touched (the checkpoint overwrites the states in place afterwards)."""
    for dist in _distributed_optimizers(optimizer):
        inner = dist.optimizer
        if inner.state:
            continue
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        try:
            dist._init_optimizer_states_with_dummy_values()
        finally:
            for g, (lr, wd) in zip(inner.param_groups, saved):
                g["lr"], g["weight_decay"] = lr, wd


def _saved_steps(optimizer, loaded) -> list[float]:
    """Adam's step of each DistributedOptimizer as saved (megatron keeps it in the param groups: every parameter
    of one optimizer takes the same number of steps)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    per_part = [loaded] if len(parts) == 1 else [loaded[i] for i in range(len(parts))]
    steps = []
    for part, state in zip(parts, per_part):
        if part in _distributed_optimizers(optimizer):
            values = {g["step"] for g in state["optimizer"]["param_groups"] if g.get("step") is not None}
            if len(values) != 1:
                raise CheckpointError(f"optimizer state has param groups at different Adam steps {sorted(values)}")
            steps.append(float(values.pop()))
    return steps


def _restore_own_steps(optimizer, steps: list[float]) -> None:
    """Megatron's DistributedOptimizer.load_state_dict gives every parameter the SAME `step` tensor, then copies
    the stale pre-load step into it along with the bucket states; torch's Adam increments each parameter's step in
    place, so a shared tensor would also advance once per parameter per step. Either way every later bias
    correction is wrong. Give each parameter its own tensor holding the saved step."""
    for dist, step in zip(_distributed_optimizers(optimizer), steps):
        for state in dist.optimizer.state.values():
            state["step"] = torch.tensor(step, dtype=torch.float32)


def _split_param_states(optimizer, loaded) -> list:
    """Take the model-space parameter states out of `loaded` (megatron's load_state_dict would copy into every
    live state key, `step` included, which the model-space layout does not hold): [(dist optimizer, state)]."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    per_part = [loaded] if len(parts) == 1 else [loaded[i] for i in range(len(parts))]
    dists = _distributed_optimizers(optimizer)
    out = []
    for part, state in zip(parts, per_part):
        if part in dists:
            out.append((part, state.pop("param_state")))
            state.pop("param_state_sharding_type", None)
    return out


def _drop_steps(optimizer) -> None:
    """megatron's model-space loader copies every state key it finds on the live optimizer from the checkpoint,
    which holds no per-parameter `step` (megatron keeps it in the param groups): drop it here, it is restored
    from the saved param groups by _restore_own_steps."""
    for dist in _distributed_optimizers(optimizer):
        for state in dist.optimizer.state.values():
            state.pop("step", None)


RUN_FLAGS = ("fused", "foreach")
"""How this run steps its torch optimizers (set when they were built, e.g. fused Adam where the platform asks for
it): run settings, not state, but kept in the param groups, which a load replaces with the saving run's."""


def _inner_optimizers(optimizer) -> list:
    return [getattr(part, "optimizer", None) for part in getattr(optimizer, "chained_optimizers", [optimizer])]


def _run_flags(optimizer) -> list[list[dict]]:
    """RUN_FLAGS of every param group of the torch optimizers inside `optimizer`."""
    return [
        [{k: g[k] for k in RUN_FLAGS if k in g} for g in inner.param_groups] if inner is not None else []
        for inner in _inner_optimizers(optimizer)
    ]


def _set_run_flags(optimizer, flags: list[list[dict]]) -> None:
    for inner, groups in zip(_inner_optimizers(optimizer), flags):
        if inner is not None:
            for group, saved in zip(inner.param_groups, groups):
                group.update(saved)


def _lora_meta(model) -> dict | None:
    from mindrl.models.lora import lora_meta

    return lora_meta(model)


def save_train_state(
    model, optimizer, scheduler, spec, role: str, settings: ModelLayout, it_dir: str, optim: bool, rng: bool
) -> None:
    """Collective over the model's world: every rank writes its shards into it_dir (which must exist)."""
    from megatron.core import dist_checkpointing, tensor_parallel

    rank = torch.distributed.get_rank()
    inner = unwrap(model)
    model_sd = inner.sharded_state_dict()
    lora = _lora_meta(model)
    lora_settings = getattr(settings, "lora", None)
    backbone = getattr(inner, "mindrl_backbone", None)  # set by build_and_load
    if lora and backbone and lora_settings is not None and lora_settings.lora_ckpt_filter:
        # Adapters only: the frozen backbone stays where it was loaded from, and the meta says where.
        model_sd = {k: v for k, v in model_sd.items() if ".lora.lora_" in k}
        lora["backbone"] = backbone
    dist_checkpointing.save(model_sd, it_dir)
    if optim:
        os.makedirs(os.path.join(it_dir, OPTIM_DIR), exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(
            _sharded_optim_state(optimizer, inner.sharded_state_dict(), is_loading=False),
            os.path.join(it_dir, OPTIM_DIR),
        )
    state = {
        "scheduler": scheduler.state_dict(),
        "world_size": torch.distributed.get_world_size(),
        "optim_format": _optim_format(optimizer) if optim else None,
        "tp": settings.tp,
        "pp": settings.pp,
    }
    if rng:
        state["torch_rng"] = torch.get_rng_state()
        state["megatron_rng"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    os.makedirs(os.path.join(it_dir, RANK_STATE_DIR), exist_ok=True)
    torch.save(state, os.path.join(it_dir, RANK_STATE_DIR, f"rank_{rank}.pt"))
    torch.distributed.barrier()
    if rank == 0:
        mcore_ckpt.write_model_meta(it_dir, spec, role, settings.tp, settings.pp, settings.dtype, lora)
    torch.distributed.barrier()


def save_weights_only(model, spec, role: str, settings: ModelLayout, root: str) -> None:
    """Collective: `model` as a weights-only checkpoint at root (root/release + a `release` tracker), the form
    build_and_load and mindrl-convert read. Used for the synced reference model (REF_DIR of an iteration)."""

    it_dir = mcore_ckpt.iteration_dir(root, mcore_ckpt.RELEASE)
    if torch.distributed.get_rank() == 0:
        os.makedirs(it_dir, exist_ok=True)
    torch.distributed.barrier()
    mcore_ckpt.save_model(unwrap(model), it_dir)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        mcore_ckpt.write_model_meta(it_dir, spec, role, settings.tp, settings.pp, settings.dtype, _lora_meta(model))
        mcore_ckpt.write_tracker(root, mcore_ckpt.RELEASE)
    torch.distributed.barrier()


def load_train_state(model, optimizer, scheduler, it_dir: str, optim: bool, rng: bool) -> None:
    """Collective: the optimizer state (from any saved TP/PP/DP, dist_checkpointing reshards; a distributed
    optimizer's checkpoint in the older dp_reshardable format only at its saved TP/PP), then this rank's scheduler
    and RNG states.
    The model itself was loaded by build_and_load. Resumes bit-exactly, Adam's per-parameter steps included."""
    from megatron.core import dist_checkpointing, tensor_parallel

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    path = os.path.join(it_dir, RANK_STATE_DIR, f"rank_{rank}.pt")
    if not os.path.isfile(path):
        path = os.path.join(it_dir, RANK_STATE_DIR, "rank_0.pt")  # a smaller world than saved: rank 0's scheduler
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint has no scheduler / RNG state (incomplete save?)")
    state = torch.load(path, weights_only=False)
    if optim:
        optim_dir = os.path.join(it_dir, OPTIM_DIR)
        if not os.path.isdir(optim_dir):
            raise CheckpointError(
                f"{optim_dir} is missing: the checkpoint was saved without optimizer state (no_save_optim); "
                "set no_load_optim: true to resume with a fresh optimizer"
            )
        _check_optim_layout(state, optimizer, it_dir)
        inner = unwrap(model)
        _init_distopt_states(optimizer)
        fmt = state.get("optim_format") or PLAIN_FORMAT
        flags = _run_flags(optimizer)
        with torch.no_grad():
            sharded = _sharded_optim_state(optimizer, inner.sharded_state_dict(), is_loading=True, fmt=fmt)
            loaded = dist_checkpointing.load(sharded, optim_dir)
            steps = _saved_steps(optimizer, loaded)
            param_states = _split_param_states(optimizer, loaded) if fmt == DISTOPT_FORMAT else []
            optimizer.load_state_dict(loaded)
            _drop_steps(optimizer)
            for dist, param_state in param_states:
                dist.load_parameter_state_from_fully_reshardable(param_state)
        _restore_own_steps(optimizer, steps)
        _set_run_flags(optimizer, flags)  # the loaded param groups carry the saving run's flags
    scheduler.load_state_dict(state["scheduler"])
    if rng and "torch_rng" in state:
        if state["world_size"] != world:
            logger.warning(
                "%s was saved by %d ranks, this run has %d: the ranks' torch and megatron RNG states are not "
                "restored (they drive dropout masks, which a different layout draws differently anyway; weights, "
                "optimizer, scheduler, sampler and KL controller are restored, and rollouts still sample as the "
                "saved run would: their seeds come from (seed, iteration, dataset row))",
                it_dir,
                state["world_size"],
                world,
            )
        else:
            torch.set_rng_state(state["torch_rng"])
            tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_rng"])


def _check_optim_layout(state: dict, optimizer, it_dir: str) -> None:
    """The optimizer state on disk must be loadable by this optimizer: the same kind (distributed or not), and for
    a distributed optimizer's dp_reshardable checkpoint (the older format) the same TP / PP (its shards follow
    megatron's gradient buckets)."""
    from megatron.core import parallel_state as ps

    saved, ours = state.get("optim_format"), _optim_format(optimizer)
    if saved is None:  # written before the format was recorded: the plain optimizer's layout
        saved = PLAIN_FORMAT
    distributed = {DISTOPT_FORMAT, DP_ONLY_FORMAT}
    if (saved in distributed) != (ours in distributed):
        what = {
            DISTOPT_FORMAT: "use_distributed_optimizer: true",
            DP_ONLY_FORMAT: "use_distributed_optimizer: true",
            PLAIN_FORMAT: "use_distributed_optimizer: false",
        }
        raise CheckpointError(
            f"{os.path.join(it_dir, OPTIM_DIR)} was saved with {what[saved]}, this run has {what[ours]}: set it "
            "back to resume the optimizer, or set no_load_optim: true to start a fresh one"
        )
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    if saved == DP_ONLY_FORMAT and (state.get("tp"), state.get("pp")) != (tp, pp):
        raise CheckpointError(
            f"{os.path.join(it_dir, OPTIM_DIR)} holds distributed-optimizer state saved at TP={state.get('tp')} "
            f"PP={state.get('pp')}; it reloads onto any DP size but only at that TP/PP, and this run has TP={tp} "
            f"PP={pp}: resume at the saved TP/PP, or set no_load_optim: true"
        )
