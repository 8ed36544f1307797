"""Supervised fine-tuning on megatron-core (MindSpeed-LLM's `--stage sft`), the warm start PPO/GRPO load: the driver
holds the loop, `RankPool` ranks the model; the loss is defined in docs/sft.md."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from mindrl.config.megatron import dataset_output_prefix
from mindrl.config.sft import SFTConfig, SFTTrainingConfig, split_counts
from mindrl.data.handlers import IGNORE_INDEX
from mindrl.platform.detect import current_platform

# ------------------------------------------------------------------------------------------------ data


class SFTDataset:
    """Instruction samples written by mindrl-preprocess (AlpacaStyleInstructionHandler): per document,
    input_ids and labels of the same length, labels = -100 over the prompt, then the response ids.

    Split into contiguous train / valid / test document ranges by `split` (megatron's --split)."""

    def __init__(self, data_path: str, split: str = "100,0,0") -> None:
        from mindrl.data.indexed import IndexedDataset
        from mindrl.data.preprocess import dataset_prefix

        prefix = dataset_output_prefix(data_path)
        self.input_ids = IndexedDataset(dataset_prefix(prefix, "input_ids"))
        self.labels = IndexedDataset(dataset_prefix(prefix, "labels"))
        self.lengths = np.asarray(self.input_ids.sequence_lengths, dtype=np.int64)
        n_train, n_valid, n_test = split_counts(len(self.lengths), split)
        self.ranges = {
            "train": (0, n_train),
            "valid": (n_train, n_train + n_valid),
            "test": (n_train + n_valid, len(self)),
        }

    def __len__(self) -> int:
        return len(self.lengths)

    def num(self, part: str) -> int:
        start, end = self.ranges[part]
        return end - start

    def doc(self, part: str, i: int) -> int:
        """The document id of sample i of a split."""
        return self.ranges[part][0] + i

    def sample(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        return self.input_ids[doc].astype(np.int64), self.labels[doc].astype(np.int64)


def collate(samples: list[tuple[np.ndarray, np.ndarray]], width: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded model inputs and shifted targets, all (b, width):

    input_ids, attention_mask (1 = real token), labels (the next token's id, 0 where there is no loss),
    loss_mask (1 where the next token is a response token: labels != -100 and inside the sample).
    Samples longer than `width` are cut; position width-1 then predicts the first dropped token if it is a
    response token, so the cut costs no supervision that fits."""
    from mindrl.batch import pad_rows

    ids = [s[0][:width] for s in samples]
    targets = [
        np.concatenate([s[1][1 : width + 1], np.full(1, IGNORE_INDEX)])[: min(len(s[0]), width)] for s in samples
    ]
    input_ids, attention_mask = pad_rows(ids, pad_token_id, left=False, width=width)
    labels, _ = pad_rows(targets, IGNORE_INDEX, left=False, width=width)
    loss_mask = (labels != IGNORE_INDEX).to(torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels.clamp(min=0),  # megatron's cross entropy needs a valid id everywhere; masked below
        "loss_mask": loss_mask,
    }


def batch_width(lengths: np.ndarray, mt: SFTTrainingConfig) -> int:
    """Padded length of a step whose samples have `lengths`: the longest (rounded up to pad_to_multiple_of,
    at most seq_length) with variable_seq_lengths, else seq_length; a multiple of TP under sequence parallel."""
    width = mt.seq_length
    if mt.variable_seq_lengths:
        longest = int(min(lengths.max(), mt.seq_length))
        width = min(-(-longest // mt.pad_to_multiple_of) * mt.pad_to_multiple_of, mt.seq_length)
    if mt.sequence_parallel:
        tp = mt.tensor_model_parallel_size
        width = -(-width // tp) * tp
    return width


# ------------------------------------------------------------------------------------------------ ranks
@dataclass
class _RankState:
    mt: SFTTrainingConfig
    ddp: Any
    optimizer: Any
    scheduler: Any
    data: SFTDataset
    pad_token_id: int


_STATE: _RankState | None = None


def _state() -> _RankState:
    if _STATE is None:
        raise RuntimeError("SFT rank state is not set up (call _rank_setup first)")
    return _STATE


def _rank_setup(mt_dict: dict, pad_token_id: int) -> dict:
    """Build the model (from mt.load), optimizer and LR schedule on this rank; keep them for the steps."""
    global _STATE
    from mindrl.launch import init_model_parallel
    from mindrl.workers.train_setup import build_model_and_optimizer

    mt = SFTTrainingConfig(**mt_dict)
    tp, pp = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size
    optim = mt.optim_settings(lr_warmup_iters=mt.warmup_iters)
    _, ddp, optimizer, scheduler = build_model_and_optimizer(
        mt.load, tp, pp, optim, mt.train_iters, mt.dtype, mt.sequence_parallel, recompute=mt.recompute_settings()
    )
    # As megatron's training loop does: fp16 scales the loss before backward (a no-op scale of 1 otherwise).
    ddp.config.grad_scale_func = optimizer.scale_loss
    init_model_parallel(tp, pp, seed=mt.seed)  # same layout: only reseeds (loading reseeded with the default)
    _STATE = _RankState(mt, ddp, optimizer, scheduler, SFTDataset(mt.data_path, mt.split), pad_token_id)
    return {"num_params": sum(p.numel() for p in ddp.module.parameters())}


def _rank_teardown() -> None:
    global _STATE
    _STATE = None


def _local_micro_batches(st: _RankState, docs: list[int]) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's contiguous slice of the global batch `docs`, as padded micro-batches."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = len(docs) // dp
    mine = docs[rank * per_rank : (rank + 1) * per_rank]
    width = batch_width(st.data.lengths[docs], st.mt)
    mbs = min(st.mt.micro_batch_size, len(mine))
    return [
        collate([st.data.sample(d) for d in mine[i : i + mbs]], width, st.pad_token_id)
        for i in range(0, len(mine), mbs)
    ]


def _global_sum(values: list[float]) -> list[float]:
    """Sums over data-parallel ranks of per-rank numbers (float64, so token counts stay exact)."""
    from megatron.core import parallel_state as ps

    t = torch.tensor(values, dtype=torch.float64, device=current_platform().device())
    torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    return t.tolist()


def _loss_func(mb: dict, scale: float, output: torch.Tensor):
    """output: (b, s) per-token cross entropy from the last stage. Returns the loss that megatron's schedule
    divides by the number of micro-batches (and DDP averages over DP): `scale` = num_micro * dp / global_tokens
    undoes both, so the gradient is that of sum(loss over the global batch's response tokens) / their count."""
    loss_sum = (output.float() * mb["loss_mask"]).sum()
    return loss_sum * scale, {"loss_sum": loss_sum.detach().clone(), "tokens": mb["loss_mask"].sum()}


def _forward_step(data_iterator, model, scale: float):
    from mindrl.models.forward import attention_inputs, model_device

    device = model_device(model)
    mb = {k: v.to(device) for k, v in next(data_iterator).items()}
    position_ids, mask = attention_inputs(mb["input_ids"], mb["attention_mask"])
    output = model(mb["input_ids"], position_ids, mask, labels=mb["labels"])
    return output, partial(_loss_func, mb, scale)


def _run_schedule(st: _RankState, micro: list[dict], forward_only: bool, scale: float) -> tuple[float, float]:
    """(loss sum, response tokens) over the micro-batches, summed over the pipeline's last stage and DP."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    outs = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, scale=scale),
        data_iterator=iter(micro),
        model=[st.ddp],
        num_microbatches=len(micro),
        seq_length=micro[0]["input_ids"].shape[1],
        micro_batch_size=micro[0]["input_ids"].shape[0],
        forward_only=forward_only,
    )
    local = torch.zeros(2, dtype=torch.float64, device=current_platform().device())
    for o in outs:  # empty off the last stage
        local += torch.stack([o["loss_sum"].double(), o["tokens"].double()])
    torch.distributed.all_reduce(local, group=ps.get_pipeline_model_parallel_group())
    loss_sum, tokens = _global_sum(local.tolist())
    return loss_sum, tokens


def _rank_train_step(docs: list[int]) -> dict[str, float]:
    """One optimizer step on the global batch `docs` (document ids); metrics are the same on every rank."""
    st = _state()
    micro = _local_micro_batches(st, docs)
    local_tokens = float(sum(mb["loss_mask"].sum().item() for mb in micro))
    (global_tokens,) = _global_sum([local_tokens])
    dp = st.mt.dp
    scale = len(micro) * dp / max(global_tokens, 1.0)
    lr = float(st.optimizer.param_groups[0]["lr"])
    st.ddp.train()
    st.ddp.zero_grad_buffer()
    st.optimizer.zero_grad()
    loss_sum, tokens = _run_schedule(st, micro, forward_only=False, scale=scale)
    loss = loss_sum / max(tokens, 1.0)
    grad_norm, skipped = float("nan"), 1.0
    if np.isfinite(loss) and tokens > 0:  # every rank agrees: the numbers were all-reduced
        ok, norm, _ = st.optimizer.step()
        if ok:  # fp16's loss scaler skips steps with overflowing gradients
            st.scheduler.step(increment=1)
            grad_norm, skipped = float(norm) if norm is not None else 0.0, 0.0
    return {
        "sft/loss": loss,
        "sft/lr": lr,
        "sft/grad_norm": grad_norm,
        "sft/loss_tokens": tokens,
        "sft/skipped": skipped,
    }


@torch.no_grad()
def _rank_evaluate(batches: list[list[int]]) -> dict[str, float]:
    """Token-mean loss over the response tokens of all `batches` (document ids), forward only."""
    st = _state()
    total, tokens = 0.0, 0.0
    st.ddp.eval()
    try:
        for docs in batches:
            s, n = _run_schedule(st, _local_micro_batches(st, docs), forward_only=True, scale=1.0)
            total, tokens = total + s, tokens + n
    finally:
        st.ddp.train()
    return {"sft/val_loss": total / max(tokens, 1.0), "sft/val_tokens": tokens}


def _rank_save(it_dir: str) -> None:
    from mindrl.checkpoint.mcore_ckpt import save_model

    save_model(_state().ddp.module, it_dir)


# ------------------------------------------------------------------------------------------------ driver
@dataclass
class SFTResult:
    """What a run did: where its outputs are, and every step's metrics."""

    run_dir: str
    save_dir: str
    iterations: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    """Per step: the metrics logged (sft/val_loss only on evaluation steps)."""
    saved_iterations: list[int] = field(default_factory=list)


def _pad_token_id(tokenizer_dir: str) -> int:
    """The tokenizer's padding id (else its end-of-sequence id, else 0); padding never carries loss."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for pad in (tok.pad_token_id, tok.eos_token_id, 0):
        if pad is not None:
            return int(pad)
    return 0


def _valid_batches(data: SFTDataset, mt: SFTTrainingConfig) -> list[list[int]]:
    """eval_iters batches of global_batch_size, cycling through the validation split in order: every
    evaluation scores the same samples, so the curve compares like with like."""
    n = data.num("valid")
    size = mt.global_batch_size
    return [[data.doc("valid", (k * size + j) % n) for j in range(size)] for k in range(mt.eval_iters)]


def _save(pool, cfg: SFTConfig, spec: Any, iteration: int) -> None:
    """A mindrl checkpoint of `iteration`: the model (collective), its meta, hf_files, then the tracker."""
    from mindrl.checkpoint import mcore_ckpt
    from mindrl.checkpoint.hf_io import carry_files

    mt = cfg.megatron_training
    it_dir = mcore_ckpt.iteration_dir(mt.save, iteration)
    if os.path.isdir(it_dir):  # a rerun of the same iteration replaces it (dist_checkpointing wants it empty)
        shutil.rmtree(it_dir)
    os.makedirs(it_dir)
    pool.run(_rank_save, it_dir)
    tp, pp = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size
    mcore_ckpt.write_model_meta(it_dir, spec, "actor", tp, pp, mt.dtype)
    # Config + tokenizer travel with the weights, so mcore2hf and the RL workers find them.
    src = os.path.join(mt.load, mcore_ckpt.HF_FILES)
    dst = os.path.join(mt.save, mcore_ckpt.HF_FILES)
    if os.path.abspath(src) != os.path.abspath(dst):
        carry_files(src if os.path.isdir(src) else mt.tokenizer_name_or_path, dst)
    mcore_ckpt.write_tracker(mt.save, iteration)


def console_line(iteration: int, total: int, m: dict[str, float], eta: str) -> str:
    """`iter 10/200 | loss 1.234 | val 1.301 | lr 1.0e-04 | grad_norm 0.87 | 5120 tok/s | 0.21 s | ETA 40s`."""
    parts = [f"iter {iteration}/{total}", f"loss {m['sft/loss']:.4f}"]
    if "sft/val_loss" in m:
        parts.append(f"val_loss {m['sft/val_loss']:.4f}")
    parts += [f"lr {m['sft/lr']:.2e}", f"grad_norm {m['sft/grad_norm']:.3g}", f"{m['sft/tokens_per_s']:.0f} tok/s"]
    parts += [f"{m['timing/iteration']:.2f} s", f"ETA {eta}"]
    return " | ".join(parts)


def train_sft(cfg: SFTConfig, pool=None, log=print) -> SFTResult:
    """Run SFT as configured (validated: see mindrl.config.sft); `pool`: a RankPool of world_size ranks to run
    on (default: a new one). Writes metrics to the run dir and checkpoints to megatron_training.save."""
    from mindrl.checkpoint.mcore_ckpt import read_model_meta
    from mindrl.data.prompt_dataset import ResumableShuffleSampler
    from mindrl.launch import RankPool
    from mindrl.trainer.metrics import MetricsLogger, format_eta

    mt = cfg.megatron_training
    t_start = time.perf_counter()
    run_dir = mt.run_dir or os.path.join("outputs", cfg.config_name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "sft_config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
    spec, _ = read_model_meta(mt.load)
    data = SFTDataset(mt.data_path, mt.split)
    sampler = ResumableShuffleSampler(data.num("train"), mt.global_batch_size, seed=mt.seed)
    valid = _valid_batches(data, mt) if mt.eval_interval else []
    pad_id = _pad_token_id(mt.tokenizer_name_or_path)
    tp, pp = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size

    own_pool = pool is None
    if own_pool:
        pool = RankPool(mt.world_size, threads=max(1, (os.cpu_count() or 1) // mt.world_size))
    elif pool.world_size != mt.world_size:
        raise ValueError(f"the rank pool has {pool.world_size} ranks but megatron_training.world_size={mt.world_size}")
    result = SFTResult(run_dir=run_dir, save_dir=mt.save, iterations=mt.train_iters, seconds=0.0)
    metrics_log = MetricsLogger(run_dir, mt.train_iters, use_tensorboard=mt.use_tensorboard, console=False)
    try:
        info = pool.run(_rank_setup, mt.to_dict(), pad_id)[0]
        log(
            f"[mindrl-sft] {spec.architecture} ({info['num_params'] / 1e6:.2f}M params on rank 0), "
            f"TP{tp} x PP{pp} x DP{mt.dp}; {data.num('train')} train / {data.num('valid')} valid samples; "
            f"{mt.train_iters} steps of {mt.global_batch_size} samples"
        )
        batches = iter(sampler)
        seconds: list[float] = []
        for iteration in range(1, mt.train_iters + 1):
            docs = [data.doc("train", i) for i in next(batches)]
            t0 = time.perf_counter()
            metrics = pool.run(_rank_train_step, docs)[0]
            elapsed = time.perf_counter() - t0
            seconds.append(elapsed)
            tokens = float(np.minimum(data.lengths[docs], mt.seq_length).sum())
            metrics["sft/tokens_per_s"] = tokens / elapsed
            metrics["timing/iteration"] = elapsed
            last = iteration == mt.train_iters
            if valid and (iteration % mt.eval_interval == 0 or last):
                t1 = time.perf_counter()
                metrics.update(pool.run(_rank_evaluate, valid)[0])
                metrics["timing/evaluate"] = time.perf_counter() - t1
            if last or (mt.save_interval and iteration % mt.save_interval == 0):
                t1 = time.perf_counter()
                _save(pool, cfg, spec, iteration)
                metrics["timing/save"] = time.perf_counter() - t1
                result.saved_iterations.append(iteration)
            metrics_log.log(iteration, metrics)
            result.history.append(metrics)
            if iteration % mt.log_interval == 0 or last or "sft/val_loss" in metrics:
                eta = format_eta(float(np.median(seconds)) * (mt.train_iters - iteration))
                log(console_line(iteration, mt.train_iters, metrics, eta))
        pool.run(_rank_teardown)
    finally:
        metrics_log.close()
        if own_pool:
            pool.close()
    result.seconds = time.perf_counter() - t_start
    return result
