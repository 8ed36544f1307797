"""Reward-model training on megatron-core (`stage: orm`): a value-head model scores the last real token of each chosen
and rejected response, trained with the Bradley-Terry loss; the loop and the ranks are `megatron_loop`'s."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from mindrl.config.megatron import dataset_output_prefix
from mindrl.config.reward_model import RMTrainingConfig
from mindrl.config.sft import SFTConfig
from mindrl.trainer import megatron_loop as loop
from mindrl.trainer.sft import batch_width

PAIR_KEYS = ("chosen_input_ids", "rejected_input_ids", "margin")
STAT_KEYS = ("loss_sum", "correct", "chosen_sum", "rejected_sum", "pairs")


# ------------------------------------------------------------------------------------------------ data
class PairwiseDataset(loop.SplitData):
    """Preference pairs written by mindrl-preprocess (AlpacaStylePairwiseHandler): per document the chosen and the
    rejected sequence (prompt + response ids) and the pair's margin; split into contiguous train / valid / test
    document ranges by `split` (megatron's --split)."""

    def __init__(self, data_path: str, split: str = "100,0,0") -> None:
        from mindrl.data.indexed import IndexedDataset
        from mindrl.data.preprocess import dataset_prefix

        prefix = dataset_output_prefix(data_path)
        self.chosen, self.rejected, self.margin = (IndexedDataset(dataset_prefix(prefix, k)) for k in PAIR_KEYS)
        self.chosen_lengths = np.asarray(self.chosen.sequence_lengths, dtype=np.int64)
        self.rejected_lengths = np.asarray(self.rejected.sequence_lengths, dtype=np.int64)
        super().__init__(len(self.chosen_lengths), split)

    def sample(self, doc: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(chosen ids, rejected ids, margin) of pair `doc`."""
        return self.chosen[doc].astype(np.int64), self.rejected[doc].astype(np.int64), float(self.margin[doc][0])

    def lengths(self, docs: list[int]) -> np.ndarray:
        """The lengths of both sequences of the pairs `docs`."""
        return np.concatenate([self.chosen_lengths[docs], self.rejected_lengths[docs]])

    def tokens(self, docs: list[int], seq_length: int) -> float:
        return float(np.minimum(self.lengths(docs), seq_length).sum())


def collate_pairs(
    samples: list[tuple[np.ndarray, np.ndarray, float]], width: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """The b pairs as 2b right-padded rows, chosen rows first: input_ids and attention_mask (2b, width) (1 = real
    token), last (2b,) the index of each row's last real token (the one scored; sequences longer than width are
    cut), margin (b,)."""
    from mindrl.batch import pad_rows

    rows = [s[0][:width] for s in samples] + [s[1][:width] for s in samples]
    input_ids, attention_mask = pad_rows(rows, pad_token_id, left=False, width=width)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "last": torch.tensor([len(r) - 1 for r in rows], dtype=torch.long),
        "margin": torch.tensor([s[2] for s in samples], dtype=torch.float32),
    }


# ------------------------------------------------------------------------------------------------ loss
def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-pair Bradley-Terry terms of scores chosen, rejected and margin (all (b,)): loss = -log sigmoid(chosen -
    rejected - margin), correct = 1 where chosen > rejected (a tie is wrong). Sums over the pairs."""
    loss = -torch.nn.functional.logsigmoid(chosen - rejected - margin)
    return {
        "loss_sum": loss.sum(),
        "correct": (chosen > rejected).sum().to(loss.dtype),
        "chosen_sum": chosen.sum(),
        "rejected_sum": rejected.sum(),
        "pairs": torch.tensor(float(chosen.numel()), dtype=loss.dtype, device=loss.device),
    }


def last_token_scores(values: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """values (rows, s) or (rows, s, 1): a value per token; last (rows,): the index scored. (rows,) float32."""
    values = values.reshape(values.shape[0], -1).float()
    return values.gather(1, last.view(-1, 1)).squeeze(1)


def _loss_func(mb: dict, scale: float, output: torch.Tensor):
    """output: (2b, s, 1) values from the last stage. `scale` = num_micro * dp / global_pairs undoes megatron's
    division by the micro-batches and DDP's average over DP: the gradient is that of the global pair mean."""
    scores = last_token_scores(output, mb["last"])
    b = mb["margin"].shape[0]
    stats = bradley_terry(scores[:b], scores[b:], mb["margin"])
    return stats["loss_sum"] * scale, {k: v.detach().clone() for k, v in stats.items()}


def _forward_step(data_iterator, model, scale: float):
    from mindrl.models.forward import attention_inputs, model_device

    device = model_device(model)
    mb = {k: v.to(device) for k, v in next(data_iterator).items()}
    position_ids, mask = attention_inputs(mb["input_ids"], mb["attention_mask"])
    return model(mb["input_ids"], position_ids, mask), partial(_loss_func, mb, scale)


# ------------------------------------------------------------------------------------------------ ranks
def _rank_setup(mt_dict: dict, pad_token_id: int) -> dict:
    mt = RMTrainingConfig(**mt_dict)
    return loop.setup_rank(mt, PairwiseDataset(mt.data_path, mt.split), pad_token_id, value_head=True)


def _local_micro_batches(st: loop.RankState, docs: list[int]) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's slice of the global batch `docs` (pair ids), as micro-batches of
    micro_batch_size pairs padded to the step's width."""
    mine = loop.local_docs(docs)
    width = batch_width(st.data.lengths(docs), st.mt)
    mbs = min(st.mt.micro_batch_size, len(mine))
    return [
        collate_pairs([st.data.sample(d) for d in mine[i : i + mbs]], width, st.pad_token_id)
        for i in range(0, len(mine), mbs)
    ]


SUMMARY_NAMES = ("loss", "accuracy", "chosen_score", "rejected_score")
"""Names of STAT_KEYS' per-pair means (the last key is the pair count)."""


def _rank_train_step(docs: list[int]) -> dict[str, float]:
    """One optimizer step on the global batch `docs` (pair ids); metrics are the same on every rank."""
    st = loop.state()
    micro = _local_micro_batches(st, docs)
    scale = len(micro) * st.mt.dp / len(docs)
    lr = loop.current_lr(st)
    out: dict[str, float] = {}

    def run() -> float:
        stats = loop.run_schedule(st, micro, partial(_forward_step, scale=scale), False, STAT_KEYS)
        out.update(loop.per_pair(stats, SUMMARY_NAMES, "rm/"))
        return out["rm/loss"]

    grad_norm, skipped = loop.train_step(st, run)
    return {**out, "rm/lr": lr, "rm/grad_norm": grad_norm, "rm/skipped": skipped}


def _rank_evaluate(batches: list[list[int]]) -> dict[str, float]:
    """Loss, pairwise accuracy and mean scores over all `batches` (pair ids), forward only."""
    st = loop.state()
    step = partial(_forward_step, scale=1.0)
    sums = loop.evaluate_sums(st, batches, lambda docs: _local_micro_batches(st, docs), step, STAT_KEYS)
    return loop.per_pair(sums, SUMMARY_NAMES, "rm/val_")


# ------------------------------------------------------------------------------------------------ driver
def console_line(iteration: int, total: int, m: dict[str, float], eta: str) -> str:
    """`iter 10/200 | loss 0.512 | acc 0.75 | val_acc 0.81 | lr 1.0e-04 | grad_norm 0.87 | 0.21 s | ETA 40s`."""
    parts = [f"iter {iteration}/{total}", f"loss {m['rm/loss']:.4f}", f"acc {m['rm/accuracy']:.3f}"]
    if "rm/val_accuracy" in m:
        parts += [f"val_loss {m['rm/val_loss']:.4f}", f"val_acc {m['rm/val_accuracy']:.3f}"]
    parts += [f"chosen {m['rm/chosen_score']:.3f}", f"rejected {m['rm/rejected_score']:.3f}"]
    parts += [f"lr {m['rm/lr']:.2e}", f"grad_norm {m['rm/grad_norm']:.3g}", f"{m['timing/iteration']:.2f} s"]
    return " | ".join([*parts, f"ETA {eta}"])


RECIPE = loop.Recipe("rm", "critic", _rank_setup, _rank_train_step, _rank_evaluate, console_line, "rm/val_accuracy")


def train_reward_model(cfg: SFTConfig, pool=None, log=print) -> loop.TrainResult:
    """Train the reward model as configured (`load_sft_config(..., schema=RMTrainingConfig)`); `pool`: a RankPool of
    world_size ranks (default: a new one). Writes metrics to the run dir and a value-head checkpoint to
    megatron_training.save."""
    from mindrl.checkpoint.loading import value_model_spec
    from mindrl.checkpoint.mcore_ckpt import read_model_meta

    mt = cfg.megatron_training
    spec, _ = read_model_meta(mt.load)
    return loop.train_loop(cfg, RECIPE, PairwiseDataset(mt.data_path, mt.split), value_model_spec(spec), pool, log)
