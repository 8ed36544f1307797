"""The machinery shared by mindrl's offline trainers (SFT, reward model, DPO): `RankPool` ranks hold a megatron model,
optimizer and LR schedule; the driver draws batches, evaluates, saves and logs (console, JSONL, TensorBoard)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mindrl.platform.detect import current_platform


class SplitData:
    """Documents split into contiguous train / valid / test ranges by `split` (megatron's --split); a trainer's
    dataset adds its samples and `tokens`."""

    def __init__(self, num_docs: int, split: str) -> None:
        from mindrl.config.sft import split_counts

        n_train, n_valid, _ = split_counts(num_docs, split)
        self.num_docs = num_docs
        self.ranges = {
            "train": (0, n_train),
            "valid": (n_train, n_train + n_valid),
            "test": (n_train + n_valid, num_docs),
        }

    def __len__(self) -> int:
        return self.num_docs

    def num(self, part: str) -> int:
        start, end = self.ranges[part]
        return end - start

    def doc(self, part: str, i: int) -> int:
        """The document id of sample i of a split."""
        return self.ranges[part][0] + i

    def tokens(self, docs: list[int], seq_length: int) -> float:
        """Tokens a step on `docs` computes (each sequence cut to seq_length)."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------ ranks
@dataclass
class RankState:
    mt: Any
    """The validated megatron_training section (`SFTTrainingConfig` or a subclass)."""
    ddp: Any
    optimizer: Any
    scheduler: Any
    data: Any
    pad_token_id: int


_STATE: RankState | None = None


def state() -> RankState:
    if _STATE is None:
        raise RuntimeError("the trainer's rank state is not set up (call setup_rank first)")
    return _STATE


def setup_rank(mt: Any, data: Any, pad_token_id: int, value_head: bool = False) -> dict:
    """Build the model (from mt.load; value_head: a value-head model), optimizer and LR schedule on this rank and
    keep them for the steps."""
    global _STATE
    from mindrl.launch import init_model_parallel
    from mindrl.workers.train_setup import build_model_and_optimizer

    tp, pp = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size
    optim = mt.optim_settings(lr_warmup_iters=mt.warmup_iters)
    # mt.lora_target_modules (mindrl-sft only): the loaded model is frozen and only its adapters train
    lora = mt if getattr(mt, "lora", False) else None
    _, ddp, optimizer, scheduler = build_model_and_optimizer(
        mt.load, tp, pp, optim, mt.train_iters, mt.dtype, mt.sequence_parallel, recompute=mt.recompute_settings(),
        value_head=value_head, lora=lora, seed=mt.seed, layers_per_stage=layers_per_stage(mt),
    )  # fmt: skip
    # As megatron's training loop does: fp16 scales the loss before backward (a no-op scale of 1 otherwise).
    ddp.config.grad_scale_func = optimizer.scale_loss
    init_model_parallel(tp, pp, seed=mt.seed)  # same layout: only reseeds (loading reseeded with the default)
    _STATE = RankState(mt, ddp, optimizer, scheduler, data, pad_token_id)
    params = list(ddp.module.parameters())
    return {
        "num_params": sum(p.numel() for p in params),
        "num_trained": sum(p.numel() for p in params if p.requires_grad),
    }


def layers_per_stage(mt: Any) -> tuple[int, ...] | None:
    """num_layer_list's stages (None: unset, megatron's even split)."""
    counts = mt.layer_list()
    return tuple(counts) if counts is not None else None


def teardown_rank() -> None:
    global _STATE
    _STATE = None


def local_docs(docs: list[int]) -> list[int]:
    """This data-parallel rank's contiguous slice of the global batch `docs`."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = len(docs) // dp
    return docs[rank * per_rank : (rank + 1) * per_rank]


def global_sum(values: list[float]) -> list[float]:
    """Sums over data-parallel ranks of per-rank numbers (float64, so token counts stay exact)."""
    from megatron.core import parallel_state as ps

    t = torch.tensor(values, dtype=torch.float64, device=current_platform().device())
    torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    return t.tolist()


def run_schedule(st: RankState, micro: list[dict], forward_step, forward_only: bool, keys: tuple[str, ...]) -> list:
    """megatron's schedule of `forward_step` over the micro-batches; the sums of the loss functions' reported `keys`
    over the micro-batches, the pipeline's last stage and DP (the same on every rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    first = next(iter(micro[0].values()))
    outs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=[st.ddp],
        num_microbatches=len(micro),
        seq_length=first.shape[1],
        micro_batch_size=first.shape[0],
        forward_only=forward_only,
    )
    local = torch.zeros(len(keys), dtype=torch.float64, device=current_platform().device())
    for o in outs:  # empty off the last stage
        local += torch.stack([o[k].double() for k in keys])
    torch.distributed.all_reduce(local, group=ps.get_pipeline_model_parallel_group())
    return global_sum(local.tolist())


@torch.no_grad()
def evaluate_sums(st: RankState, batches: list[list[int]], micro_batches: Callable[[list[int]], list[dict]],
                  forward_step, keys: tuple[str, ...]) -> list[float]:  # fmt: skip
    """`run_schedule`'s sums of `keys` over all `batches` (document ids), forward only, the model in eval mode."""
    total = np.zeros(len(keys))
    st.ddp.eval()
    try:
        for docs in batches:
            total += run_schedule(st, micro_batches(docs), forward_step, True, keys)
    finally:
        st.ddp.train()
    return total.tolist()


def per_pair(stats: list[float], names: tuple[str, ...], prefix: str) -> dict[str, float]:
    """Sums (the last one the pair count) as per-pair means named `prefix + name`, and `prefix + "pairs"`."""
    *sums, pairs = stats
    n = max(pairs, 1.0)
    return {**{f"{prefix}{name}": x / n for name, x in zip(names, sums, strict=True)}, f"{prefix}pairs": pairs}


def train_step(st: RankState, run: Callable[[], float]) -> tuple[float, float]:
    """Zero the gradients, `run()` forward and backward (returns the step's global loss), and step the optimizer
    unless the loss is not finite (every rank agrees: the numbers were all-reduced). (grad_norm, skipped)."""
    st.ddp.train()
    st.ddp.zero_grad_buffer()
    st.optimizer.zero_grad()
    loss = run()
    if np.isfinite(loss):
        ok, norm, _ = st.optimizer.step()
        if ok:  # fp16's loss scaler skips steps with overflowing gradients
            st.scheduler.step(increment=1)
            return float(norm) if norm is not None else 0.0, 0.0
    return float("nan"), 1.0


def current_lr(st: RankState) -> float:
    return float(st.optimizer.param_groups[0]["lr"])


def save_rank(it_dir: str) -> dict | None:
    """Save this rank's shards of the model into it_dir (collective); the adapters' settings for the meta (None
    without LoRA)."""
    from mindrl.checkpoint.mcore_ckpt import save_model
    from mindrl.models.lora import lora_meta

    save_model(state().ddp.module, it_dir)
    return lora_meta(state().ddp.module)


# ------------------------------------------------------------------------------------------------ driver
@dataclass
class TrainResult:
    """What a run did: where its outputs are, and every step's metrics."""

    run_dir: str
    save_dir: str
    iterations: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    """Per step: the metrics logged (the validation metrics only on evaluation steps)."""
    saved_iterations: list[int] = field(default_factory=list)


@dataclass
class Recipe:
    """What differs between the offline trainers; the rank functions are module-level (they travel to the ranks)."""

    name: str
    """Names the tool (`mindrl-<name>`) and the saved config (`<name>_config.json`)."""
    role: str
    """The role written in the checkpoint's meta: "actor" (a causal LM) or "critic" (a value-head model)."""
    rank_setup: Callable[..., dict]
    """(mt_dict, pad_token_id) -> {"num_params": ...}, run on every rank."""
    rank_train_step: Callable[[list[int]], dict[str, float]]
    rank_evaluate: Callable[[list[list[int]]], dict[str, float]]
    console_line: Callable[[int, int, dict[str, float], str], str]
    val_key: str
    """A metric present only on evaluation steps (forces a console line)."""


def pad_token_id(tokenizer_dir: str) -> int:
    """The tokenizer's padding id (else its end-of-sequence id, else 0); padding never carries loss."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for pad in (tok.pad_token_id, tok.eos_token_id, 0):
        if pad is not None:
            return int(pad)
    return 0


def valid_batches(data: SplitData, mt: Any) -> list[list[int]]:
    """eval_iters batches of global_batch_size, cycling through the validation split in order: every
    evaluation scores the same samples, so the curve compares like with like."""
    n = data.num("valid")
    size = mt.global_batch_size
    return [[data.doc("valid", (k * size + j) % n) for j in range(size)] for k in range(mt.eval_iters)]


def save_checkpoint(pool, mt: Any, spec: Any, role: str, iteration: int) -> None:
    """A mindrl checkpoint of `iteration`: the model (collective), its meta, hf_files (the spec's config.json: a
    value model's differs from the causal LM it started from), then the tracker."""
    from mindrl.checkpoint import mcore_ckpt
    from mindrl.checkpoint.hf_io import carry_files

    it_dir = mcore_ckpt.iteration_dir(mt.save, iteration)
    if os.path.isdir(it_dir):  # a rerun of the same iteration replaces it (dist_checkpointing wants it empty)
        shutil.rmtree(it_dir)
    os.makedirs(it_dir)
    lora = pool.run(save_rank, it_dir)[0]
    tp, pp = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size
    mcore_ckpt.write_model_meta(it_dir, spec, role, tp, pp, mt.dtype, lora)
    # Config + tokenizer travel with the weights, so mcore2hf and the RL workers find them.
    src = os.path.join(mt.load, mcore_ckpt.HF_FILES)
    dst = os.path.join(mt.save, mcore_ckpt.HF_FILES)
    if os.path.abspath(src) != os.path.abspath(dst):
        carry_files(src if os.path.isdir(src) else mt.tokenizer_name_or_path, dst)
        if spec.is_value_model:
            with open(os.path.join(dst, "config.json"), "w") as f:
                json.dump(spec.hf_config, f, indent=2)
    mcore_ckpt.write_tracker(mt.save, iteration)


def train_loop(cfg: Any, recipe: Recipe, data: SplitData, spec: Any, pool=None, log=print) -> TrainResult:
    """Run `recipe` as `cfg` (an `SFTConfig`: megatron_training, config_name) says, on `pool` (a RankPool of
    world_size ranks; default: a new one): per step a batch from a seeded reshuffling sampler, validation every
    eval_interval steps and at the end, checkpoints every save_interval steps and at the end."""
    from mindrl.data.prompt_dataset import ResumableShuffleSampler
    from mindrl.launch import RankPool, threads_from_env
    from mindrl.trainer.metrics import MetricsLogger, format_eta

    mt = cfg.megatron_training
    t_start = time.perf_counter()
    run_dir = mt.run_dir or os.path.join("outputs", cfg.config_name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"{recipe.name}_config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
    sampler = ResumableShuffleSampler(data.num("train"), mt.global_batch_size, seed=mt.seed, shuffle=not mt.no_shuffle)
    valid = valid_batches(data, mt) if mt.eval_interval else []
    pad_id = pad_token_id(mt.tokenizer_name_or_path)
    tp, pp = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size

    own_pool = pool is None
    if own_pool:
        pool = RankPool(mt.world_size, threads=threads_from_env() or max(1, (os.cpu_count() or 1) // mt.world_size))
    elif pool.world_size != mt.world_size:
        raise ValueError(f"the rank pool has {pool.world_size} ranks but megatron_training.world_size={mt.world_size}")
    result = TrainResult(run_dir=run_dir, save_dir=mt.save, iterations=mt.train_iters, seconds=0.0)
    metrics_log = MetricsLogger(run_dir, mt.train_iters, use_tensorboard=mt.use_tensorboard, console=False)
    try:
        info = pool.run(recipe.rank_setup, mt.to_dict(), pad_id)[0]
        trained = info["num_trained"]
        lora = f", {trained / 1e6:.2f}M of them trained: LoRA" if trained < info["num_params"] else ""
        log(
            f"[mindrl-{recipe.name}] {spec.architecture} ({info['num_params'] / 1e6:.2f}M params on rank 0{lora}), "
            f"TP{tp} x PP{pp} x DP{mt.dp}; {data.num('train')} train / {data.num('valid')} valid samples; "
            f"{mt.train_iters} steps of {mt.global_batch_size} samples"
        )
        batches = iter(sampler)
        seconds: list[float] = []
        for iteration in range(1, mt.train_iters + 1):
            docs = [data.doc("train", i) for i in next(batches)]
            t0 = time.perf_counter()
            metrics = pool.run(recipe.rank_train_step, docs)[0]
            elapsed = time.perf_counter() - t0
            seconds.append(elapsed)
            metrics[f"{recipe.name}/tokens_per_s"] = data.tokens(docs, mt.seq_length) / elapsed
            metrics["timing/iteration"] = elapsed
            last = iteration == mt.train_iters
            if valid and (iteration % mt.eval_interval == 0 or last):
                t1 = time.perf_counter()
                metrics.update(pool.run(recipe.rank_evaluate, valid)[0])
                metrics["timing/evaluate"] = time.perf_counter() - t1
            if last or (mt.save_interval and iteration % mt.save_interval == 0):
                t1 = time.perf_counter()
                save_checkpoint(pool, mt, spec, recipe.role, iteration)
                metrics["timing/save"] = time.perf_counter() - t1
                result.saved_iterations.append(iteration)
            metrics_log.log(iteration, metrics)
            result.history.append(metrics)
            if iteration % mt.log_interval == 0 or last or recipe.val_key in metrics:
                eta = format_eta(float(np.median(seconds)) * (mt.train_iters - iteration))
                log(recipe.console_line(iteration, mt.train_iters, metrics, eta))
        pool.run(teardown_rank)
    finally:
        metrics_log.close()
        if own_pool:
            pool.close()
    result.seconds = time.perf_counter() - t_start
    return result
