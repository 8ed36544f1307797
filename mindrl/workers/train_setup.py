"""Build a trainable megatron actor (DDP + megatron optimizer) from a mindrl checkpoint, and run plain
language-model steps on random tokens: what tools and tests need to move weights away from a checkpoint.
"""

from __future__ import annotations

import torch


def build_trainer(load_dir: str, tp: int, pp: int, lr: float = 1e-2, clip_grad: float = 1.0, dtype: str = "float32"):
    """(spec, ddp_model, optimizer): megatron DDP + megatron's Adam around the checkpoint loaded at TP x PP.

    Call inside a rank (torch.distributed initialised); collective."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindrl.checkpoint.mcore_ckpt import build_and_load

    spec, _, model = build_and_load(load_dir, tp, pp, dtype)
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=False, overlap_grad_reduce=False),
        module=model,
    )
    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=0.01, clip_grad=clip_grad, bf16=dtype == "bfloat16", fp16=False
    )
    return spec, ddp, get_megatron_optimizer(opt_config, [ddp])


def _loss_step(data_iterator, model):
    from mindrl.models.forward import attention_inputs

    ids = next(data_iterator)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    position_ids, mask = attention_inputs(inputs, None)
    per_token = model(inputs, position_ids, mask, labels=labels)  # (b, s) vocab-parallel cross entropy

    def loss_func(output):
        loss = output.float().mean()
        # The schedule divides the returned loss in place: report a copy.
        return loss, {"loss": loss.detach().clone()}

    return per_token, loss_func


def train_steps(
    ddp, optimizer, vocab: int, steps: int, seed: int, first_step: int = 0, batch: int = 4, seq: int = 32
) -> list[float]:
    """`steps` optimizer steps on random tokens (2 micro-batches each) through megatron's schedule; step i's
    tokens depend only on (seed, i). Returns the losses (on every rank: the last stage's, broadcast over PP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    losses = []
    for step in range(first_step, first_step + steps):
        gen = torch.Generator().manual_seed(seed * 100_003 + step)
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
        if not ok:
            raise RuntimeError(f"optimizer step {step} was skipped (non-finite gradients)")
        loss = torch.stack([o["loss"] for o in out]).mean() if out else torch.zeros(())
        group = ps.get_pipeline_model_parallel_group()
        last = torch.distributed.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        torch.distributed.broadcast(loss, src=last, group=group)
        losses.append(loss.item())
    return losses
