"""Module-level functions the distributed-optimizer tests run on pool ranks: train a megatron model straight, or
with a save / fresh build / load in the middle, and return everything a resume must restore."""

from __future__ import annotations

import torch

from mindrl.workers.train_setup import OptimSettings, build_model_and_optimizer, train_steps
from tests.workers.ppo_rank_fns import flat, full_hf_tensors


def inner_optimizers(optimizer) -> list:
    """The torch optimizers under megatron's (chained) optimizer."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def optimizer_state(optimizer) -> list[dict[str, torch.Tensor]]:
    """This rank's optimizer state, in the inner optimizers' parameter order: the parameter it updates (the fp32
    main shard under bf16 / the distributed optimizer) and its Adam state (step, exp_avg, exp_avg_sq)."""
    out = []
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state.get(p, {})
                entry = {"param": p.detach().clone()}
                entry.update({k: torch.as_tensor(v).detach().clone() for k, v in state.items()})
                out.append(entry)
    return out


def step_tensors_shared(optimizer) -> int:
    """How many parameters share their `step` tensor with another parameter (0 when each has its own)."""
    seen, shared = {}, 0
    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                key = id(step)
                shared += key in seen
                seen[key] = True
    return shared


def full_optimizer_state(ddp, optimizer, spec) -> dict[str, dict[str, torch.Tensor]]:
    """The distributed optimizer's state as full, unsharded HF-named tensors: {"param" (fp32 main), "exp_avg",
    "exp_avg_sq", "step"} -> {hf name: tensor}, this pipeline stage's parameters. Each DP rank owns one range of
    every parameter's flattened buffer (megatron's `param_map`): the ranges are scattered into zeros and summed over
    the optimizer's DP group (disjoint ranges: an exact sum), then gathered over TP by the weight map's rules. Layout
    independent, so a state saved at one TP x PP x DP can be compared with the one loaded at another, bit for bit.
    Collective over the DP and TP groups."""
    from mindrl.resharding.stream import local_params

    kinds = ("param", "exp_avg", "exp_avg_sq", "step")
    owned = {}  # model param -> (its optimizer, the fp32 shard this DP rank updates): only params it owns a part of
    dists = getattr(optimizer, "chained_optimizers", [optimizer])
    for dist in dists:
        for models, shards in ((dist.model_float16_groups, dist.shard_fp32_from_float16_groups),
                               (dist.model_fp32_groups, dist.shard_fp32_groups)):  # fmt: skip
            for model_group, shard_group in zip(models, shards):
                owned.update({m: (dist, sh) for m, sh in zip(model_group, shard_group)})
    full: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for model_param in local_params(ddp, spec).values():  # the same order on every DP rank
        out = {}
        for kind in kinds:
            flat = torch.zeros(model_param.numel(), dtype=torch.float32)
            if model_param in owned:
                dist, shard = owned[model_param]
                rng = dist._get_model_param_range_map(model_param)["param"]
                value = shard if kind == "param" else dist.optimizer.state[shard][kind]
                # the step is one scalar per parameter: written over the owned range like the rest
                flat[rng.start : rng.end] = value.item() if kind == "step" else value.detach().float().reshape(-1)
            torch.distributed.all_reduce(flat, group=dists[0].data_parallel_group)
            out[kind] = flat.view(model_param.shape)
        full[model_param] = out
    from tests.workers.ppo_rank_fns import full_hf_tensors

    return {kind: full_hf_tensors(ddp, spec, grads=False, local_of=lambda p, k=kind: full[p][k]) for kind in kinds}


def _build(load_dir: str, tp: int, optim: OptimSettings, dtype: str, total_steps: int, pp: int = 1):
    return build_model_and_optimizer(load_dir, tp, pp, optim, total_steps=total_steps, dtype=dtype)


def _report(spec, ddp, optimizer, losses: list[float], steps_shared: int | None = None) -> dict:
    return {
        "losses": losses,
        "weights": full_hf_tensors(ddp, spec, grads=False),
        "optim": optimizer_state(optimizer),
        "shared_steps": step_tensors_shared(optimizer) if steps_shared is None else steps_shared,
        "fused": [group.get("fused") for inner in inner_optimizers(optimizer) for group in inner.param_groups],
    }


def train_straight(
    load_dir: str, tp: int, optim: OptimSettings, dtype: str, steps: int, seed: int, pp: int = 1
) -> dict:
    """`steps` optimizer steps from load_dir (train_steps' random-token LM loss, deterministic per step)."""
    spec, ddp, optimizer, _ = _build(load_dir, tp, optim, dtype, steps, pp)
    losses = train_steps(ddp, optimizer, spec.vocab_size, steps, seed)
    return _report(spec, ddp, optimizer, losses)


def train_resumed(
    load_dir: str, tp: int, optim: OptimSettings, dtype: str, steps: int, seed: int, save_root: str,
    save_format: str | None = None,
) -> dict:  # fmt: skip
    """steps // 2 steps, save_train_state into save_root (driver-side rename + tracker as the trainer does),
    then a fresh model + optimizer built from that checkpoint, load_train_state, and the remaining steps.
    save_format: the distributed optimizer's layout to save in (an older checkpoint's), instead of today's."""
    import mindrl.checkpoint.train_state as ckpt
    from mindrl.checkpoint.iterations import begin_iteration, finalize_iteration
    from mindrl.checkpoint.train_state import load_train_state, save_train_state
    from mindrl.workers.settings import ModelSettings

    half = steps // 2
    rank = torch.distributed.get_rank()
    spec, ddp, optimizer, scheduler = _build(load_dir, tp, optim, dtype, steps)
    losses = train_steps(ddp, optimizer, spec.vocab_size, half, seed)
    settings = ModelSettings(load=load_dir, tp=tp, pp=1, optim=optim, total_steps=steps, dtype=dtype)
    tmp = begin_iteration(save_root, half) if rank == 0 else None
    tmp_list = [tmp]
    torch.distributed.broadcast_object_list(tmp_list, src=0)
    for inner in inner_optimizers(optimizer):  # saved as a run before fused Adam saved: the per-tensor loop's flags
        for group in inner.param_groups:
            group["fused"] = None
    current = ckpt.DISTOPT_FORMAT
    ckpt.DISTOPT_FORMAT = save_format or current
    try:
        save_train_state(ddp, optimizer, scheduler, spec, "actor", settings, tmp_list[0], optim=True, rng=True)
    finally:
        ckpt.DISTOPT_FORMAT = current
    if rank == 0:
        finalize_iteration(save_root, half, tmp_list[0], None)
    torch.distributed.barrier()
    del ddp, optimizer, scheduler

    spec, ddp, optimizer, scheduler = _build(save_root, tp, optim, dtype, steps)
    from mindrl.checkpoint.mcore_ckpt import iteration_dir

    load_train_state(ddp, optimizer, scheduler, iteration_dir(save_root, half), optim=True, rng=True)
    shared_after_load = step_tensors_shared(optimizer)
    losses += train_steps(ddp, optimizer, spec.vocab_size, steps - half, seed, first_step=half)
    return _report(spec, ddp, optimizer, losses, steps_shared=max(shared_after_load, step_tensors_shared(optimizer)))


def ppo_train_rank(load_dir: str, tp: int, batch, loss, optim: OptimSettings, dtype: str, mini: int, epochs: int,
                   micro_batch_size: int) -> dict:  # fmt: skip
    """`epochs` x `mini` actor PPO steps (ppo_update, as the driver sends it: this rank's shard_rows shard). Returns
    the metrics on every rank; the HF-named fp32 weights after training and the clipped gradients of the last step
    on the DP-0, TP-0 rank (None elsewhere)."""
    from megatron.core import parallel_state as ps

    from mindrl.batch import shard_rows
    from mindrl.workers.rl_model import ppo_update

    spec, ddp, optimizer, scheduler = _build(load_dir, tp, optim, dtype, mini * epochs)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    shard = batch.index(shard_rows(len(batch), dp, mini)[dp_rank])
    metrics = flat(ppo_update(ddp, optimizer, scheduler, shard, "actor", loss, micro_batch_size, mini, epochs))
    weights = full_hf_tensors(ddp, spec, grads=False)
    keep = dp_rank == 0 and ps.get_tensor_model_parallel_rank() == 0
    return {"metrics": metrics, "weights": weights if keep else None, "dp": dp}


def train_resumed_elsewhere(
    load_dir: str, save_at: tuple[int, int], load_at: tuple[int, int], optim: OptimSettings, steps: int, seed: int,
    save_root: str,
) -> dict:  # fmt: skip
    """steps // 2 steps at TP x PP save_at, save_train_state, a fresh model + optimizer at TP x PP load_at (DP
    follows) built from that checkpoint, load_train_state and the remaining steps; with the save and load times
    and the full optimizer state just before the save and just after the load (`full_optimizer_state`)."""
    import time

    from mindrl.checkpoint.iterations import begin_iteration, finalize_iteration
    from mindrl.checkpoint.mcore_ckpt import iteration_dir
    from mindrl.checkpoint.train_state import load_train_state, save_train_state
    from mindrl.workers.settings import ModelSettings

    half = steps // 2
    rank = torch.distributed.get_rank()
    (tp_save, pp_save), (tp_load, pp_load) = save_at, load_at
    spec, ddp, optimizer, scheduler = _build(load_dir, tp_save, optim, "float32", steps, pp_save)
    losses = train_steps(ddp, optimizer, spec.vocab_size, half, seed)
    settings = ModelSettings(load=load_dir, tp=tp_save, pp=pp_save, optim=optim, total_steps=steps, dtype="float32")
    tmp_list = [begin_iteration(save_root, half) if rank == 0 else None]
    torch.distributed.broadcast_object_list(tmp_list, src=0)
    saved_state = full_optimizer_state(ddp, optimizer, spec)
    t0 = time.perf_counter()
    save_train_state(ddp, optimizer, scheduler, spec, "actor", settings, tmp_list[0], optim=True, rng=True)
    save_s = time.perf_counter() - t0
    if rank == 0:
        finalize_iteration(save_root, half, tmp_list[0], None)
    torch.distributed.barrier()
    del ddp, optimizer, scheduler
    spec, ddp, optimizer, scheduler = _build(save_root, tp_load, optim, "float32", steps, pp_load)
    t0 = time.perf_counter()
    load_train_state(ddp, optimizer, scheduler, iteration_dir(save_root, half), optim=True, rng=True)
    load_s = time.perf_counter() - t0
    loaded_state = full_optimizer_state(ddp, optimizer, spec)
    losses += train_steps(ddp, optimizer, spec.vocab_size, steps - half, seed, first_step=half)
    out = _report(spec, ddp, optimizer, losses)
    out.update(save_s=save_s, load_s=load_s, saved_state=saved_state, loaded_state=loaded_state)
    return out
