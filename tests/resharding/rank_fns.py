"""Module-level functions the resharding tests run on pool ranks (a small megatron trainer included)."""

from __future__ import annotations

import torch


def stream_checkpoint(load_dir: str, tp: int, pp: int, bucket_size_mb: float) -> dict:
    """Load the checkpoint at TP x PP, stream it, return {hf_name: tensor copy} and the stream's stats."""
    from mindrl.checkpoint.convert import _load_rank
    from mindrl.resharding import WeightStreamer

    spec, _, model = _load_rank(load_dir, tp, pp, None)
    streamer = WeightStreamer(model, spec, bucket_size_mb)
    out = {}
    for name, tensor in streamer.stream():
        assert name not in out, f"{name} emitted twice"
        out[name] = tensor.clone()  # what a rollout engine's load_weights does: copy, drop the view
    return {"tensors": out, "order": list(out), "stats": streamer.stats}


def stream_critic_error(hf_dir: str) -> str:
    """The error a critic raises (caught here: a raising rank would tear the shared pool down)."""
    from mindrl.models.builder import build_model
    from mindrl.models.hf_config import ModelSpec
    from mindrl.platform.launch import init_model_parallel
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
def build_trainer(load_dir: str, tp: int, pp: int, lr: float = 1e-2):
    """(spec, ddp_model, optimizer): megatron DDP + megatron's fp32 Adam around the loaded checkpoint."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindrl.checkpoint.convert import _load_rank

    spec, _, model = _load_rank(load_dir, tp, pp, "float32")
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=False, overlap_grad_reduce=False),
        module=model,
    )
    # clip_grad=0: platform/adapt.py does not wrap the clip called from ChainedOptimizer.step (see report).
    opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, clip_grad=0.0, bf16=False, fp16=False)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    return spec, ddp, optimizer


def _loss_step(data_iterator, model):
    from mindrl.models.forward import attention_inputs

    ids = next(data_iterator)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    position_ids, mask = attention_inputs(inputs, None)
    per_token = model(inputs, position_ids, mask, labels=labels)  # (b, s) vocab-parallel cross entropy

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return per_token, loss_func


def train_steps(ddp, optimizer, vocab: int, steps: int, seed: int, batch: int = 4, seq: int = 32) -> list[float]:
    """`steps` optimizer steps on random tokens (2 micro-batches each) through megatron's schedule.
    Returns the losses (on every rank: the last stage's, broadcast over PP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    losses = []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        micro = list(ids.chunk(2))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=_loss_step,
            data_iterator=iter(micro),
            model=[ddp],
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=micro[0].shape[0],
            forward_only=False,
        )
        ok, _, _ = optimizer.step()
        assert ok
        loss = torch.stack([o["loss"] for o in out]).mean() if out else torch.zeros(())
        group = ps.get_pipeline_model_parallel_group()
        last = torch.distributed.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        torch.distributed.broadcast(loss, src=last, group=group)
        losses.append(loss.item())
    return losses


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
