"""The actor's and the critic's megatron computations on an RL batch (see `mindrl.batch`): response logprobs,
values, and PPO updates through megatron's pipeline schedule. Runs inside a rank; every function is
collective over the model's world. The losses themselves come from `mindrl.algorithms`.

Response token t of a row sits at column P + t of input_ids (P = the batch's prompt width) and is predicted
by the output at column P + t - 1, so the outputs for the responses are columns [P - 1, P - 1 + R).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from mindrl.algorithms import agg_loss, count_tokens_and_seqs, kl_loss, masked_mean, policy_loss, value_loss
from mindrl.batch import Batch
from mindrl.models.forward import attention_inputs
from mindrl.models.vocab_parallel import vocab_parallel_logprobs


@dataclass(frozen=True)
class PPOLossSettings:
    """Loss knobs of the actor and critic updates (rl_config)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = None
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    """KL(policy || reference) in the actor loss; 0 when the KL is in the reward."""
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    cliprange_value: float | None = 0.5
    rollout_is_threshold: float | None = None
    """Truncated importance sampling cap on pi_old / pi_rollout (None: off)."""
    temperature: float = 1.0
    """The sampling temperature: logprobs are those of softmax(logits / temperature)."""


def _response_slice(output: torch.Tensor, mb: Batch) -> torch.Tensor:
    p, r = mb.meta["prompt_length"], mb["responses"].shape[1]
    return output[:, p - 1 : p - 1 + r]


def _model_inputs(mb: Batch):
    ids = mb["input_ids"]
    position_ids, mask = attention_inputs(ids, mb["attention_mask"])
    return ids, position_ids, mask


def _schedule(model, micro: list[Batch], step_fn, forward_only: bool, collect: bool = False):
    width = micro[0]["input_ids"].shape[1]
    return get_forward_backward_func()(
        forward_step_func=step_fn,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=len(micro),
        seq_length=width,
        micro_batch_size=len(micro[0]),
        forward_only=forward_only,
        collect_non_loss_data=collect,
    )


def _micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    n = len(batch)
    mbs = min(micro_batch_size, n)
    if n % mbs:
        raise ValueError(f"{n} rows do not split into micro-batches of {mbs}")
    return batch.split(n // mbs)


# ---------------------------------------------------------------------------------------------- forward only


@torch.no_grad()
def response_logprobs(model, batch: Batch, micro_batch_size: int, temperature: float) -> torch.Tensor | None:
    """(rows, R) logprob of each response token under softmax(logits / temperature); None off the last stage."""

    def step(data_iterator, model):
        mb = next(data_iterator)
        output = model(*_model_inputs(mb))

        def collect(output_tensor, non_loss_data=True):
            lp, _ = vocab_parallel_logprobs(_response_slice(output_tensor, mb), mb["responses"], temperature)
            return lp * mb["response_mask"]

        return output, collect

    return _forward_only(model, batch, micro_batch_size, step)


@torch.no_grad()
def response_values(model, batch: Batch, micro_batch_size: int) -> torch.Tensor | None:
    """(rows, R) the critic's value of the state before each response token; None off the last stage."""

    def step(data_iterator, model):
        mb = next(data_iterator)
        output = model(*_model_inputs(mb))

        def collect(output_tensor, non_loss_data=True):
            return _response_slice(output_tensor, mb).squeeze(-1).float() * mb["response_mask"]

        return output, collect

    return _forward_only(model, batch, micro_batch_size, step)


def _forward_only(model, batch: Batch, micro_batch_size: int, step) -> torch.Tensor | None:
    was_training = model.training
    model.eval()
    try:
        outputs = _schedule(model, _micro_batches(batch, micro_batch_size), step, forward_only=True, collect=True)
    finally:
        model.train(was_training)
    return torch.cat(outputs) if ps.is_pipeline_last_stage() else None


# ---------------------------------------------------------------------------------------------- updates


def _global_counts(batch: Batch) -> tuple[float, float]:
    """(valid tokens, valid sequences) of the whole mini-batch over all data-parallel ranks."""
    t = torch.tensor(count_tokens_and_seqs(batch["response_mask"]), dtype=torch.float64)
    torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t[0]), float(t[1])


def _actor_loss(mb: Batch, s: PPOLossSettings, agg: dict, num_micro: int, output: torch.Tensor):
    mask = mb["response_mask"]
    logits = _response_slice(output, mb)
    log_prob, entropy = vocab_parallel_logprobs(logits, mb["responses"], s.temperature, with_entropy=True)
    # Exactly on-policy (no old-logprob recompute): the old policy is the current one, the ratio is 1.
    old = mb["old_log_prob"] if "old_log_prob" in mb else log_prob.detach()
    is_weights = None
    if s.rollout_is_threshold is not None:
        is_weights = torch.exp(old - mb["rollout_log_prob"]).clamp(max=s.rollout_is_threshold) * mask
    pg_loss, m = policy_loss(
        old,
        log_prob,
        mb["advantages"],
        mask,
        s.clip_ratio_low,
        s.clip_ratio_high,
        s.clip_ratio_c,
        s.loss_agg_mode,
        is_weights=is_weights,
        **agg,
    )
    ent = agg_loss(entropy, mask, s.loss_agg_mode, **agg)
    loss = pg_loss - s.entropy_coeff * ent
    kl = torch.zeros(())
    if s.kl_loss_coef > 0:
        kl = kl_loss(log_prob, mb["ref_log_prob"], mask, s.kl_loss_type, s.loss_agg_mode, **agg)
        loss = loss + s.kl_loss_coef * kl
    # Token-weighted shares of the mini-batch (they sum to the mini-batch value over micro-batches and DP).
    share = mask.sum() / agg["global_num_tokens"]
    diff = (log_prob.detach() - mb["rollout_log_prob"]).abs() * mask
    dp = agg["dp_size"]
    metrics = {
        "actor/pg_loss": pg_loss.detach() / dp,
        "actor/entropy": ent.detach() / dp,
        "actor/kl_loss": kl.detach() / dp,
        "actor/pg_clipfrac": m["pg_clipfrac"] * share,
        "actor/pg_clipfrac_lower": m["pg_clipfrac_lower"] * share,
        "actor/ppo_kl": m["ppo_kl"] * share,
        "_diff_sum": diff.sum(),
        "_diff_max": diff.max() if diff.numel() else torch.zeros(()),
    }
    if is_weights is not None:
        metrics["actor/is_weight_mean"] = masked_mean(is_weights, mask) * share
    # The schedule divides by the number of micro-batches and DDP averages over DP: undo both, so the
    # gradient is that of the mini-batch loss normalised by its global token (or sequence) count.
    return loss * num_micro, {k: v.detach().clone() for k, v in metrics.items()}


def _critic_loss(mb: Batch, s: PPOLossSettings, agg: dict, num_micro: int, output: torch.Tensor):
    mask = mb["response_mask"]
    vpreds = _response_slice(output, mb).squeeze(-1).float()
    loss, m = value_loss(vpreds, mb["returns"], mb["values"], mask, s.cliprange_value, s.loss_agg_mode, **agg)
    share = mask.sum() / agg["global_num_tokens"]
    metrics = {"critic/vf_loss": loss.detach() / agg["dp_size"], "critic/vf_clipfrac": m["vf_clipfrac"] * share}
    return loss * num_micro, {k: v.detach().clone() for k, v in metrics.items()}


def _grads_finite(model) -> bool:
    """All ranks agree whether every gradient is finite (a NaN anywhere skips the step everywhere)."""
    bad = torch.zeros(1)
    for buf in getattr(model, "buffers", []):
        if not torch.isfinite(buf.grad_data).all():
            bad[0] = 1
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        if g is not None and not torch.isfinite(g).all():
            bad[0] = 1
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return bad.item() == 0


def ppo_update(
    ddp,
    optimizer,
    scheduler,
    shard: Batch,
    role: str,
    settings: PPOLossSettings,
    micro_batch_size: int,
    num_mini_batches: int,
    epochs: int,
) -> dict[str, float]:
    """Epochs x mini-batches of optimizer steps on this DP rank's shard (see `mindrl.batch.shard_rows`: its
    mini-batch k is its slice of the global mini-batch k). role: "actor" or "critic".

    Returns metrics averaged over the optimizer steps (the same on every rank), plus `<role>/lr`,
    `<role>/grad_norm`, `<role>/skipped_updates` (steps skipped for non-finite loss or gradients)."""
    loss_fn = _actor_loss if role == "actor" else _critic_loss
    dp = ps.get_data_parallel_world_size()
    sums: dict[str, float] = {}
    grad_norms: list[float] = []
    diff_sum, diff_max, diff_count = 0.0, 0.0, 0.0
    steps = skipped = 0
    ddp.train()
    for _ in range(epochs):
        for mini in shard.split(num_mini_batches):
            tokens, seqs = _global_counts(mini)
            agg = {"global_num_tokens": max(tokens, 1.0), "global_num_seqs": max(seqs, 1.0), "dp_size": dp}
            micro = _micro_batches(mini, micro_batch_size)

            def step(data_iterator, model, _n=len(micro), _agg=agg):
                mb = next(data_iterator)
                return model(*_model_inputs(mb)), partial(loss_fn, mb, settings, _agg, _n)

            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            outs = _schedule(ddp, micro, step, forward_only=False)
            local: dict[str, float] = {}
            for out in outs:  # last stage only
                for k, v in out.items():
                    local[k] = max(local.get(k, 0.0), v.item()) if k.endswith("_max") else local.get(k, 0.0) + v.item()
            values = _reduce_metrics(local)
            if role == "actor":
                diff_sum += values.pop("_diff_sum")
                diff_max = max(diff_max, values.pop("_diff_max"))
                diff_count += tokens
            finite = all(math.isfinite(v) for v in values.values()) and _grads_finite(ddp)
            if not finite:
                skipped += 1
                continue
            ok, grad_norm, _ = optimizer.step()
            if not ok:
                skipped += 1
                continue
            scheduler.step(increment=1)
            steps += 1
            grad_norms.append(float(grad_norm) if grad_norm is not None else 0.0)
            for k, v in values.items():
                sums[k] = sums.get(k, 0.0) + v
    metrics = {k: v / max(steps, 1) for k, v in sums.items()}
    metrics[f"{role}/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics[f"{role}/lr"] = float(optimizer.param_groups[0]["lr"])
    metrics[f"{role}/skipped_updates"] = float(skipped)
    if role == "actor":
        metrics["_logprob_diff"] = (diff_sum, diff_count, diff_max)
    return metrics


def _reduce_metrics(local: dict[str, float]) -> dict[str, float]:
    """The last pipeline stage's metric sums, summed over DP (maxima for keys ending in _max); the same dict on
    every rank of the model's world."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        src = torch.distributed.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        box = [local]
        torch.distributed.broadcast_object_list(box, src=src, group=group)
        local = box[0]
    keys = sorted(local)
    sums = torch.tensor([0.0 if k.endswith("_max") else local[k] for k in keys], dtype=torch.float64)
    maxes = torch.tensor([local[k] if k.endswith("_max") else 0.0 for k in keys], dtype=torch.float64)
    group = ps.get_data_parallel_group()
    torch.distributed.all_reduce(sums, group=group)
    torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=group)
    return {k: (m if k.endswith("_max") else v) for k, v, m in zip(keys, sums.tolist(), maxes.tolist())}
