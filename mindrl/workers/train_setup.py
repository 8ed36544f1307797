"""Build a trainable megatron model (DDP + megatron optimizer + LR schedule) from a mindrl checkpoint, and run
plain language-model steps on random tokens: the shared core of the actor, the critic, SFT and the tools.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch

from mindrl.config.settings import LoRASettings, OptimSettings, RecomputeSettings


def build_model_and_optimizer(
    load_dir: str,
    tp: int,
    pp: int,
    optim: OptimSettings,
    total_steps: int,
    dtype: str = "float32",
    sequence_parallel: bool = False,
    iteration: int | str | None = None,
    recompute: RecomputeSettings | None = None,
    value_head: bool = False,
    cp: int = 1,
    lora: LoRASettings | None = None,
    seed: int = 1234,
    ep: int = 1,
    moe: dict[str, Any] | None = None,
    layers_per_stage: tuple[int, ...] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """(spec, ddp_model, optimizer, scheduler) around the checkpoint at load_dir (its latest iteration, or
    `iteration`), built at TP x PP.

    total_steps: optimizer steps the run will take (the LR decay horizon when lr_decay_iters is None).
    recompute: activation recomputation in training (None: none). value_head: train a value-head model (a causal
    LM checkpoint gets a fresh head: `mindrl.checkpoint.loading.build_and_load`). cp: context-parallel size
    (megatron's DDP then reduces the gradients over DP x CP). lora: with lora_target_modules, the loaded model is frozen
    and gets adapters (`mindrl.models.lora.apply_lora`, A seeded by `seed`) before DDP wraps it, so only the adapters
    have gradient buffers and optimizer state. ep: expert-parallel
    size of a MoE model; moe: its router losses' TransformerConfig keys (`ModelArchConfig.moe_training_overrides`;
    None: the checkpoint's). layers_per_stage: each pipeline stage's layer count (None: even).
    Call inside a rank (torch.distributed initialised); collective."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from mindrl.checkpoint.loading import build_and_load

    _check_saved_adapters(load_dir, iteration, lora or LoRASettings())
    adapt = None
    if lora is not None and lora.lora:
        from mindrl.models.lora import apply_lora

        def adapt(model):  # before loading: a LoRA run's own checkpoint (resume) holds the adapters
            apply_lora(model, lora.lora_r, lora.lora_alpha, lora.lora_target_modules, seed)

    spec, _, model = build_and_load(
        load_dir, tp, pp, dtype, sequence_parallel=sequence_parallel, iteration=iteration, recompute=recompute,
        value_head=value_head, cp=cp, ep=ep, adapt=adapt, layers_per_stage=layers_per_stage, **(moe or {}),
    )  # fmt: skip
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=optim.use_distributed_optimizer,
            overlap_grad_reduce=False,
            grad_reduce_in_fp32=True,
        ),
        module=model,
    )
    accumulate_wgrad_in_main_grad(ddp)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    use_fused_adam(optimizer)
    decay = max(optim.lr_decay_iters or total_steps, optim.lr_warmup_iters + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_iters else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_iters,
        lr_decay_steps=decay,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        wsd_decay_steps=max(1, decay // 10) if optim.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style="linear" if optim.lr_decay_style == "WSD" else None,
    )
    return spec, ddp, optimizer, scheduler


def _check_saved_adapters(load_dir: str, iteration: int | str | None, lora: LoRASettings) -> None:
    """The adapters the checkpoint holds are the ones `lora` describes (preflight checks `load`; this also covers a
    resume from the run's own saves)."""
    from mindrl.checkpoint import legacy, mcore_ckpt
    from mindrl.checkpoint.hf_io import CheckpointError

    if legacy.is_legacy(load_dir, iteration):
        return
    iteration = mcore_ckpt.read_tracker(load_dir) if iteration is None else iteration
    _, meta = mcore_ckpt.read_model_meta(load_dir, iteration)
    problems = lora.checkpoint_problems(meta.get("lora"))
    if problems:
        where = os.path.join(mcore_ckpt.iteration_dir(load_dir, iteration), mcore_ckpt.MODEL_META)
        raise CheckpointError(f"{where}: " + "; ".join(f"{key} {message}" for key, message in problems))


def accumulate_wgrad_in_main_grad(ddp) -> None:
    """Let megatron's linear layers in a DDP-wrapped model add their weight gradients straight into DDP's main_grad
    (megatron's gradient_accumulation_fusion), where the platform has the kernel (apex on CUDA, mindrl's on CPU).

    Set on the layers, not in the config the model was built with: a model without DDP (the reference model,
    conversion, parity tests) has no main_grad to add into."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        return
    for module in ddp.modules():
        if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            module.gradient_accumulation_fusion = True


def use_fused_adam(optimizer) -> None:
    """Step megatron's torch Adam(W) with torch's fused kernel where the platform asks for it
    (`Platform.fused_adam`). Idempotent.

    megatron builds torch's optimizer without apex or Transformer Engine and leaves it on the per-tensor loop. The
    flag lives in the param groups, which `load_state_dict` replaces with the saved ones
    (`mindrl.checkpoint.train_state.load_train_state` keeps this run's flags across its load)."""
    from mindrl.platform.detect import current_platform

    if not current_platform().fused_adam:
        return
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):  # apex / TE optimizers are fused already
            continue
        for group in inner.param_groups:
            if not group.get("differentiable"):
                group["fused"], group["foreach"] = True, False


def build_trainer(load_dir: str, tp: int, pp: int, lr: float = 1e-2, clip_grad: float = 1.0, dtype: str = "float32"):
    """(spec, ddp_model, optimizer): megatron DDP + megatron's Adam (constant LR, weight decay 0.01) around the
    checkpoint loaded at TP x PP. Call inside a rank (torch.distributed initialised); collective."""
    optim = OptimSettings(lr=lr, clip_grad=clip_grad, weight_decay=0.01)
    spec, ddp, optimizer, _ = build_model_and_optimizer(load_dir, tp, pp, optim, total_steps=1, dtype=dtype)
    return spec, ddp, optimizer


def _loss_step(data_iterator, model):
    from mindrl.models.forward import attention_inputs, model_device

    ids = next(data_iterator).to(model_device(model))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    position_ids, mask = attention_inputs(inputs, None)
    per_token = model(inputs, position_ids, mask, labels=labels)  # (b, s) vocab-parallel cross entropy

    def loss_func(output):
        loss = output.float().mean()
        # The schedule divides the returned loss in place: report a copy.
        return loss, {"loss": loss.detach().clone()}

    return per_token, loss_func


def train_steps(
    ddp,
    optimizer,
    vocab: int,
    steps: int,
    seed: int,
    first_step: int = 0,
    batch: int = 4,
    seq: int = 32,
    step_context=None,
) -> list[float]:
    """`steps` optimizer steps on random tokens (2 micro-batches each) through megatron's schedule; step i's
    tokens depend only on (seed, i). Returns the losses (on every rank: the last stage's, broadcast over PP).
    step_context: a context manager factory entered around each optimizer step (as `rl_model.ppo_update`'s)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mindrl.models.forward import model_device

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
        with step_context() if step_context is not None else nullcontext():
            ok, _, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {step} was skipped (non-finite gradients)")
        loss = torch.stack([o["loss"] for o in out]).mean() if out else torch.zeros((), device=model_device(ddp))
        group = ps.get_pipeline_model_parallel_group()
        last = torch.distributed.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        torch.distributed.broadcast(loss, src=last, group=group)
        losses.append(loss.item())
    return losses
