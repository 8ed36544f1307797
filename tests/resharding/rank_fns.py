"""Module-level functions the resharding tests run on pool ranks (a small megatron trainer included)."""

from __future__ import annotations

import contextlib
import gc

import torch

from mindrl.workers.train_setup import build_trainer, train_steps


def stream_checkpoint(load_dir: str, tp: int, pp: int, bucket_size_mb: float, shm: bool = True) -> dict:
    """Load the checkpoint at TP x PP, stream it, return {hf_name: tensor copy} and the stream's stats.
    shm=False: the gloo transport (MINDRL_RESHARD_SHM=0 while the streamer is built)."""
    import os

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.resharding import WeightStreamer

    spec, _, model = build_and_load(load_dir, tp, pp, None)
    old = os.environ.get("MINDRL_RESHARD_SHM")
    os.environ["MINDRL_RESHARD_SHM"] = "1" if shm else "0"
    try:
        streamer = WeightStreamer(model, spec, bucket_size_mb)
    finally:
        if old is None:
            del os.environ["MINDRL_RESHARD_SHM"]
        else:
            os.environ["MINDRL_RESHARD_SHM"] = old
    out = {}
    for name, tensor in streamer.stream():
        assert name not in out, f"{name} emitted twice"
        out[name] = tensor.clone()  # what a rollout engine's load_weights does: copy, drop the view
    return {"tensors": out, "order": list(out), "stats": streamer.stats}


def stream_own_shards(load_dir: str, tp: int, pp: int) -> dict:
    from megatron.core import parallel_state as ps

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.resharding import WeightStreamer

    spec, _, model = build_and_load(load_dir, tp, pp, None)
    streamer = WeightStreamer(model, spec, 0.05)
    out = {n: (t.clone(), dim) for n, t, dim in streamer.stream_shards()}
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "shards": out, "stats": streamer.stats}


def stream_views_twice(load_dir: str, tp: int, pp: int, bucket_size_mb: float) -> dict:
    """Stream, keeping the emitted tensors themselves (no copy) past the end of the pass; add 1 to every weight;
    stream again, and stream this rank's own shards."""
    from megatron.core import parallel_state as ps

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.resharding import WeightStreamer

    spec, _, model = build_and_load(load_dir, tp, pp, None)
    streamer = WeightStreamer(model, spec, bucket_size_mb)
    views = dict(streamer.stream())
    first = {n: t.clone() for n, t in views.items()}  # read after the pass ended
    first_stats = streamer.stats
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    second = {n: t.clone() for n, t in streamer.stream()}
    shards = {n: (t.clone(), dim) for n, t, dim in streamer.stream_shards()}
    return {
        "first": first,
        "second": second,
        "shards": shards,
        "stats": first_stats,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
    }


def stream_with_full_shm(load_dir: str, tp: int, pp: int, bucket_size_mb: float) -> dict:
    """/dev/shm cannot hold the segments (posix_fallocate fails as on a full tmpfs): the streamer warns and
    exchanges the weights through gloo."""
    import errno
    import os
    import warnings
    from unittest import mock

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.resharding import WeightStreamer

    spec, _, model = build_and_load(load_dir, tp, pp, None)

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    with warnings.catch_warnings(record=True) as caught, mock.patch.object(os, "posix_fallocate", full):
        warnings.simplefilter("always")
        streamer = WeightStreamer(model, spec, bucket_size_mb)
    tensors = {n: t.clone() for n, t in streamer.stream()}
    return {"tensors": tensors, "stats": streamer.stats, "warnings": [str(w.message) for w in caught]}


def stream_after_early_stop(load_dir: str, tp: int, pp: int) -> dict:
    """Each rank's consumer stops at a different item; load_into drains the rest, so the next full pass
    is still matched across ranks (no deadlock) and correct."""
    import itertools

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.resharding import WeightStreamer

    spec, _, model = build_and_load(load_dir, tp, pp, None)
    streamer = WeightStreamer(model, spec, 0.05)
    rank = torch.distributed.get_rank()
    taken = []
    streamer.load_into(lambda it: taken.extend(n for n, _ in itertools.islice(it, 1 + 5 * rank)))
    return {"taken": len(taken), "tensors": {n: t.clone() for n, t in streamer.stream()}}


def stream_critic_error(hf_dir: str) -> str:
    """The error a critic raises (caught here: a raising rank would tear the shared pool down)."""
    from mindrl.launch import init_model_parallel
    from mindrl.models.builder import build_model
    from mindrl.models.hf_config import ModelSpec
    from mindrl.resharding import ReshardError, WeightStreamer

    init_model_parallel(1, 1)
    spec = ModelSpec.from_hf_dir(hf_dir)
    model = build_model(spec, "critic", dtype="float32")
    try:
        WeightStreamer(model, spec)
    except ReshardError as e:
        return str(e)
    return "no error"


# ------------------------------------------------------------------------------------- training
def train_save_and_stream(load_dir: str, tp: int, pp: int, steps: int, it_dir: str, bucket_size_mb: float) -> dict:
    """Train K steps, save the trained model to it_dir (collective), then stream it."""
    from mindrl.checkpoint import mcore_ckpt
    from mindrl.resharding import WeightStreamer

    spec, ddp, optimizer = build_trainer(load_dir, tp, pp)
    losses = train_steps(ddp, optimizer, spec.vocab_size, steps, seed=11)
    mcore_ckpt.save_model(ddp.module, it_dir)
    streamer = WeightStreamer(ddp, spec, bucket_size_mb)
    tensors = {name: t.clone() for name, t in streamer.stream()}
    return {"tensors": tensors, "losses": losses}


# ------------------------------------------------------------------------------------- offload
def _optimizer_states(optimizer) -> list[torch.Tensor]:
    from mindrl.resharding.offload import _inner_optimizers, _tensors

    return [t for inner in _inner_optimizers(optimizer) for t in _tensors(list(inner.state.values()))]


def trainer_tensors(ddp, optimizer) -> list[torch.Tensor]:
    """Everything the trainer keeps on the device, found independently of the offloader: the model's
    state dict (params and buffers), DDP's grad buffers, the optimizer's state."""
    out = [t for t in ddp.module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
    out += [p.main_grad for p in ddp.module.parameters()] + [b.grad_data for b in ddp.buffers]
    return out + _optimizer_states(optimizer)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def offload_round_trip(load_dir: str, tp: int, pp: int, before: int = 2, after: int = 2) -> dict:
    """Reference: before+after steps. Same run with a rollout in the middle: reshard_to_infer (offload
    optimizer + grads, stream, offload params) then reshard_to_train. Everything must match exactly."""
    from mindrl.resharding import OffloadConfig, ShardingManager, TrainStateOffloader, WeightStreamer

    spec, ddp, optimizer = build_trainer(load_dir, tp, pp)
    ref_losses = train_steps(ddp, optimizer, spec.vocab_size, before + after, seed=5)
    ref_final = [t.detach().clone() for t in list(ddp.module.parameters()) + _optimizer_states(optimizer)]
    del ddp, optimizer
    gc.collect()  # DDP's hooks hold the model in reference cycles: free it before the allocator is read below

    spec, ddp, optimizer = build_trainer(load_dir, tp, pp)
    losses = train_steps(ddp, optimizer, spec.vocab_size, before, seed=5)
    snapshot = [t.detach().clone() for t in trainer_tensors(ddp, optimizer)]
    offloader = TrainStateOffloader([ddp], optimizer, OffloadConfig(True, True, True))
    manager = ShardingManager(WeightStreamer(ddp, spec, 0.25), offloader)
    bytes_before = storage_bytes(trainer_tensors(ddp, optimizer))
    kinds_before = offloader.device_bytes()
    received = {}
    # The engine's copy of each weight, kept on the host: on a device, the platform allocator's figures below are
    # then the trainer's own bytes.
    to_infer = manager.reshard_to_infer(lambda it: received.update((n, t.to("cpu", copy=True)) for n, t in it))
    bytes_offloaded = storage_bytes(trainer_tensors(ddp, optimizer))
    kinds_offloaded = offloader.device_bytes()
    host_bytes = offloader.host_bytes()
    to_train = manager.reshard_to_train()
    bytes_after = storage_bytes(trainer_tensors(ddp, optimizer))
    identical = all(
        torch.equal(a.reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
        for a, b in zip(snapshot, trainer_tensors(ddp, optimizer))
    )
    # The steps after the rollout with swap_optimizer's schedule: the optimizer state on the host between steps, on
    # the device only in each step (TrainStateOffloader.stepping, what the worker wraps the actor's steps in).
    offloader.offload(["optimizer"])
    swapped = {"in_step": [], "between": []}

    @contextlib.contextmanager
    def step():
        with offloader.stepping():
            yield
            swapped["in_step"].append(offloader.device_bytes()["optimizer"])
        swapped["between"].append(offloader.device_bytes()["optimizer"])

    losses += train_steps(ddp, optimizer, spec.vocab_size, after, seed=5, first_step=before, step_context=step)
    offloader.onload()
    final = [t.detach() for t in list(ddp.module.parameters()) + _optimizer_states(optimizer)]
    return {
        "ref_losses": ref_losses,
        "losses": losses,
        "final_equal": len(final) == len(ref_final) and all(torch.equal(a, b) for a, b in zip(final, ref_final)),
        "restored_identical": identical,
        "bytes_before": bytes_before,
        "bytes_offloaded": bytes_offloaded,
        "bytes_after": bytes_after,
        "kinds_before": kinds_before,
        "kinds_offloaded": kinds_offloaded,
        "host_bytes": host_bytes,
        "received": len(received),
        "swapped": swapped,
        "moved": {**to_infer.offload_before.moved_bytes, **to_infer.offload_after.moved_bytes},
        "onloaded": to_train.moved_bytes,
        # the platform allocator's bytes (0 on CPU): before the offload, with everything offloaded, after the onload
        "allocated": {
            "before": to_infer.offload_before.allocated_before,
            "offloaded": (to_infer.offload_after or to_infer.offload_before).allocated_after,
            "onloaded": to_train.allocated_after,
        },
    }
