"""Supervised fine-tuning on megatron-core (MindSpeed-LLM's `--stage sft`), the warm start PPO/GRPO load: the data, the
loss and the step; the loop and the ranks are `megatron_loop`'s. The loss is defined in docs/sft.md."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from mindrl.config.megatron import dataset_output_prefix
from mindrl.config.sft import SFTConfig, SFTTrainingConfig
from mindrl.data.handlers import IGNORE_INDEX
from mindrl.trainer import megatron_loop as loop

# ------------------------------------------------------------------------------------------------ data


class SFTDataset(loop.SplitData):
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
        super().__init__(len(self.lengths), split)

    def sample(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        return self.input_ids[doc].astype(np.int64), self.labels[doc].astype(np.int64)

    def tokens(self, docs: list[int], seq_length: int) -> float:
        return float(np.minimum(self.lengths[docs], seq_length).sum())


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
def _rank_setup(mt_dict: dict, pad_token_id: int) -> dict:
    """Build the model (from mt.load), optimizer and LR schedule on this rank; keep them for the steps."""
    mt = SFTTrainingConfig(**mt_dict)
    return loop.setup_rank(mt, SFTDataset(mt.data_path, mt.split), pad_token_id)


def _local_micro_batches(st: loop.RankState, docs: list[int]) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's contiguous slice of the global batch `docs`, as padded micro-batches."""
    mine = loop.local_docs(docs)
    width = batch_width(st.data.lengths[docs], st.mt)
    mbs = min(st.mt.micro_batch_size, len(mine))
    return [
        collate([st.data.sample(d) for d in mine[i : i + mbs]], width, st.pad_token_id)
        for i in range(0, len(mine), mbs)
    ]


def _loss_func(mb: dict, scale: float, output: torch.Tensor):
    """output: (b, s) per-token cross entropy from the last stage. Returns the loss that megatron's schedule
    divides by the number of micro-batches (and DDP averages over DP): `scale` = num_micro * dp / global_tokens
    undoes both, so the gradient is that of sum(loss over the global batch's response tokens) / their count."""
    loss_sum = (output.float() * mb["loss_mask"]).sum()
    return loss_sum * scale, {"loss_sum": loss_sum.detach().clone(), "tokens": mb["loss_mask"].sum()}


def _forward_step(data_iterator, model, scale: float):
    from mindrl.models.forward import attention_inputs, model_device, moe_padding

    device = model_device(model)
    mb = {k: v.to(device) for k, v in next(data_iterator).items()}
    position_ids, mask = attention_inputs(mb["input_ids"], mb["attention_mask"])
    moe = moe_padding(model, ~mb["attention_mask"].bool())
    output = model(mb["input_ids"], position_ids, mask, labels=mb["labels"], **moe)
    return output, partial(_loss_func, mb, scale)


def _run_schedule(st: loop.RankState, micro: list[dict], forward_only: bool, scale: float) -> tuple[float, float]:
    """(loss sum, response tokens) over the micro-batches, summed over the pipeline's last stage and DP."""
    loss_sum, tokens = loop.run_schedule(
        st, micro, partial(_forward_step, scale=scale), forward_only, ("loss_sum", "tokens")
    )
    return loss_sum, tokens


def _rank_train_step(docs: list[int]) -> dict[str, float]:
    """One optimizer step on the global batch `docs` (document ids); metrics are the same on every rank."""
    st = loop.state()
    micro = _local_micro_batches(st, docs)
    local_tokens = float(sum(mb["loss_mask"].sum().item() for mb in micro))
    (global_tokens,) = loop.global_sum([local_tokens])
    scale = len(micro) * st.mt.dp / max(global_tokens, 1.0)
    lr = loop.current_lr(st)
    out: dict[str, float] = {}

    def run() -> float:
        out["loss_sum"], out["tokens"] = _run_schedule(st, micro, forward_only=False, scale=scale)
        return out["loss_sum"] / out["tokens"] if out["tokens"] > 0 else float("nan")  # no step without tokens

    grad_norm, skipped = loop.train_step(st, run)
    return {
        "sft/loss": out["loss_sum"] / max(out["tokens"], 1.0),
        "sft/lr": lr,
        "sft/grad_norm": grad_norm,
        "sft/loss_tokens": out["tokens"],
        "sft/skipped": skipped,
    }


@torch.no_grad()
def _rank_evaluate(batches: list[list[int]]) -> dict[str, float]:
    """Token-mean loss over the response tokens of all `batches` (document ids), forward only."""
    st = loop.state()
    total, tokens = 0.0, 0.0
    st.ddp.eval()
    try:
        for docs in batches:
            s, n = _run_schedule(st, _local_micro_batches(st, docs), forward_only=True, scale=1.0)
            total, tokens = total + s, tokens + n
    finally:
        st.ddp.train()
    return {"sft/val_loss": total / max(tokens, 1.0), "sft/val_tokens": tokens}


# ------------------------------------------------------------------------------------------------ driver
SFTResult = loop.TrainResult


def console_line(iteration: int, total: int, m: dict[str, float], eta: str) -> str:
    """`iter 10/200 | loss 1.234 | val 1.301 | lr 1.0e-04 | grad_norm 0.87 | 5120 tok/s | 0.21 s | ETA 40s`."""
    parts = [f"iter {iteration}/{total}", f"loss {m['sft/loss']:.4f}"]
    if "sft/val_loss" in m:
        parts.append(f"val_loss {m['sft/val_loss']:.4f}")
    parts += [f"lr {m['sft/lr']:.2e}", f"grad_norm {m['sft/grad_norm']:.3g}", f"{m['sft/tokens_per_s']:.0f} tok/s"]
    parts += [f"{m['timing/iteration']:.2f} s", f"ETA {eta}"]
    return " | ".join(parts)


RECIPE = loop.Recipe("sft", "actor", _rank_setup, _rank_train_step, _rank_evaluate, console_line, "sft/val_loss")


def train_sft(cfg: SFTConfig, pool=None, log=print) -> SFTResult:
    """Run SFT as configured (validated: see mindrl.config.sft); `pool`: a RankPool of world_size ranks to run
    on (default: a new one). Writes metrics to the run dir and checkpoints to megatron_training.save."""
    from mindrl.checkpoint.mcore_ckpt import read_model_meta

    mt = cfg.megatron_training
    spec, _ = read_model_meta(mt.load)
    return loop.train_loop(cfg, RECIPE, SFTDataset(mt.data_path, mt.split), spec, pool, log)
