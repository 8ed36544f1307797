"""Offline DPO on megatron-core (`stage: dpo`): the policy (a causal LM) against a frozen reference = the starting
checkpoint, whose log-probabilities are precomputed once before the first step; the loop is `megatron_loop`'s."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import torch

from mindrl.algorithms.dpo import dpo_loss, dpo_stats
from mindrl.config.dpo import DPOTrainingConfig
from mindrl.config.megatron import dataset_output_prefix
from mindrl.config.sft import SFTConfig
from mindrl.trainer import megatron_loop as loop
from mindrl.trainer.reward_model import PairwiseDataset
from mindrl.trainer.sft import batch_width, collate

LABEL_KEYS = ("chosen_labels", "rejected_labels")
STAT_KEYS = ("loss_sum", "correct", "margin_sum", "chosen_reward_sum", "rejected_reward_sum", "chosen_logp_sum",
             "rejected_logp_sum", "sft_loss_sum", "pairs")  # fmt: skip


# ------------------------------------------------------------------------------------------------ data
class DPODataset(PairwiseDataset):
    """The pairwise handler's preference pairs with their labels (-100 over the prompt), which pick the response
    tokens whose log-probabilities are summed."""

    def __init__(self, data_path: str, split: str = "100,0,0") -> None:
        from mindrl.data.indexed import IndexedDataset
        from mindrl.data.preprocess import dataset_prefix

        super().__init__(data_path, split)
        prefix = dataset_output_prefix(data_path)
        self.chosen_labels, self.rejected_labels = (IndexedDataset(dataset_prefix(prefix, k)) for k in LABEL_KEYS)

    def pair(self, doc: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """((chosen ids, chosen labels), (rejected ids, rejected labels)) of pair `doc`."""
        return (
            (self.chosen[doc].astype(np.int64), self.chosen_labels[doc].astype(np.int64)),
            (self.rejected[doc].astype(np.int64), self.rejected_labels[doc].astype(np.int64)),
        )


def collate_dpo(data: DPODataset, docs: list[int], width: int, pad_token_id: int, ref: torch.Tensor | None) -> dict:
    """The b pairs `docs` as 2b right-padded rows, chosen rows first (mindrl.trainer.sft.collate: input_ids,
    attention_mask, next-token labels, loss_mask over the response tokens), docs (b,), and with `ref` (the (N, 2)
    reference table) ref_chosen / ref_rejected (b,) float64."""
    pairs = [data.pair(d) for d in docs]
    mb = collate([p[0] for p in pairs] + [p[1] for p in pairs], width, pad_token_id)
    mb["docs"] = torch.tensor(docs, dtype=torch.long)
    if ref is not None:
        mb["ref_chosen"], mb["ref_rejected"] = ref[docs, 0].clone(), ref[docs, 1].clone()
    return mb


def sequence_logps(token_nll: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(rows,) summed response-token log-probabilities from the model's per-token cross entropy (rows, s)."""
    return -(token_nll.float() * loss_mask).sum(dim=1)


# ------------------------------------------------------------------------------------------------ loss
def _loss_func(scale: float, mt: DPOTrainingConfig, mb: dict, output: torch.Tensor):
    """output: (2b, s) per-token cross entropy from the last stage. `scale` = num_micro * dp / global_pairs undoes
    megatron's division by the micro-batches and DDP's average over DP: the gradient is that of the pair mean."""
    logps = sequence_logps(output, mb["loss_mask"])
    b = mb["docs"].shape[0]
    pc, pr = logps[:b], logps[b:]
    terms = dpo_loss(pc, pr, mb["ref_chosen"].to(pc.dtype), mb["ref_rejected"].to(pc.dtype), mt.dpo_beta,
                     mt.dpo_label_smoothing, mt.dpo_loss_type, mt.pref_ftx, mb["loss_mask"][:b].sum(1))  # fmt: skip
    stats = dpo_stats(terms, pc, pr)
    return stats["loss_sum"] * scale, {k: v.detach().clone() for k, v in stats.items()}


_REF_CACHE: dict[int, torch.Tensor] = {}  # this rank's reference rows: doc -> (chosen, rejected)


def _ref_loss_func(mb: dict, output: torch.Tensor):
    """Forward-only reference pass: keep each pair's summed log-probabilities (last stage) for `_reference_table`."""
    logps = sequence_logps(output, mb["loss_mask"]).double()
    b = mb["docs"].shape[0]
    for i, d in enumerate(mb["docs"].tolist()):
        _REF_CACHE[d] = torch.stack([logps[i], logps[b + i]]).cpu()
    zero = torch.zeros((), dtype=torch.float64, device=output.device)
    return zero, {"pairs": torch.tensor(float(b), dtype=torch.float64, device=output.device)}


def _forward_step(data_iterator, model, loss_func):
    from mindrl.models.forward import attention_inputs, model_device, moe_padding

    device = model_device(model)
    mb = {k: v.to(device) for k, v in next(data_iterator).items()}
    position_ids, mask = attention_inputs(mb["input_ids"], mb["attention_mask"])
    moe = moe_padding(model, ~mb["attention_mask"].bool())
    output = model(mb["input_ids"], position_ids, mask, labels=mb["labels"], **moe)
    return output, partial(loss_func, mb)


# ------------------------------------------------------------------------------------------------ ranks
def _local_micro_batches(st: loop.RankState, docs: list[int], ref: torch.Tensor | None) -> list[dict]:
    """This data-parallel rank's slice of the global batch `docs` (pair ids), as micro-batches of
    micro_batch_size pairs padded to the step's width."""
    mine = loop.local_docs(docs)
    width = batch_width(st.data.lengths(docs), st.mt)
    mbs = min(st.mt.micro_batch_size, len(mine))
    return [collate_dpo(st.data, mine[i : i + mbs], width, st.pad_token_id, ref) for i in range(0, len(mine), mbs)]


@torch.no_grad()
def _reference_table(st: loop.RankState) -> torch.Tensor:
    """(N, 2) float64: every pair's (chosen, rejected) summed response log-probabilities under `st.ddp`'s weights,
    forward only, in global batches of the training layout; the same on every rank (summed over PP and DP)."""
    from megatron.core import parallel_state as ps

    n, size = len(st.data), st.mt.global_batch_size
    _REF_CACHE.clear()
    st.ddp.eval()
    try:
        for start in range(0, n, size):
            docs = [(start + j) % n for j in range(size)]  # the last batch wraps around: every rank has work
            loop.run_schedule(st, _local_micro_batches(st, docs, None), partial(_forward_step,
                              loss_func=_ref_loss_func), True, ("pairs",))  # fmt: skip
    finally:
        st.ddp.train()
    table = torch.zeros(n, 3, dtype=torch.float64)  # chosen, rejected, count (a wrapped pair may be seen twice)
    for d, v in _REF_CACHE.items():
        table[d, :2], table[d, 2] = v, 1.0
    _REF_CACHE.clear()
    from mindrl.platform.detect import current_platform

    device = current_platform().device()
    table = table.to(device)
    torch.distributed.all_reduce(table, group=ps.get_data_parallel_group())
    torch.distributed.all_reduce(table, group=ps.get_pipeline_model_parallel_group())
    if bool((table[:, 2] < 1).any()):
        raise RuntimeError("the reference pass missed pairs (a bug): every pair needs its reference log-probs")
    return (table[:, :2] / table[:, 2:]).cpu()


def _rank_setup(mt_dict: dict, pad_token_id: int) -> dict:
    """Build the policy from mt.load, then compute the reference table with its (not yet updated) weights, or with
    those of mt.ref_model (built at the same layout, dropped after the pass); the table rides on the rank state."""
    mt = DPOTrainingConfig(**mt_dict)
    info = loop.setup_rank(mt, DPODataset(mt.data_path, mt.split), pad_token_id)
    st = loop.state()
    if mt.separate_reference:
        st.ref_logps = _reference_table(dataclasses.replace(st, ddp=_reference_model(mt)))
        from mindrl.launch import init_model_parallel

        init_model_parallel(mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size, seed=mt.seed)  # reseed
    else:
        st.ref_logps = _reference_table(st)
    return info


def _reference_model(mt: DPOTrainingConfig):
    """mt.ref_model built at the policy's TP x PP, forward only. Collective."""
    from mindrl.checkpoint.loading import build_and_load

    tp, pp = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size
    stages = loop.layers_per_stage(mt)
    _, _, model = build_and_load(
        mt.ref_model, tp, pp, mt.dtype, sequence_parallel=mt.sequence_parallel, layers_per_stage=stages
    )
    if getattr(model, "mindrl_role", None) == "critic":
        raise ValueError(f"megatron_training.ref_model {mt.ref_model!r} holds a value-head model, not a causal LM")
    return model


SUMMARY_NAMES = ("loss", "rewards/accuracy", "rewards/margin", "rewards/chosen", "rewards/rejected", "logps/chosen",
                 "logps/rejected", "sft_loss")  # fmt: skip
"""Names of STAT_KEYS' per-pair means (the last key is the pair count)."""


def _rank_train_step(docs: list[int]) -> dict[str, float]:
    """One optimizer step on the global batch `docs` (pair ids); metrics are the same on every rank."""
    st = loop.state()
    micro = _local_micro_batches(st, docs, st.ref_logps)
    scale = len(micro) * st.mt.dp / len(docs)
    lr = loop.current_lr(st)
    out: dict[str, float] = {}

    def run() -> float:
        step = partial(_forward_step, loss_func=partial(_loss_func, scale, st.mt))
        out.update(loop.per_pair(loop.run_schedule(st, micro, step, False, STAT_KEYS), SUMMARY_NAMES, "dpo/"))
        return out["dpo/loss"]

    grad_norm, skipped = loop.train_step(st, run)
    return {**out, "dpo/lr": lr, "dpo/grad_norm": grad_norm, "dpo/skipped": skipped}


def _rank_evaluate(batches: list[list[int]]) -> dict[str, float]:
    """The metrics over all `batches` (pair ids), forward only."""
    st = loop.state()
    step = partial(_forward_step, loss_func=partial(_loss_func, 1.0, st.mt))
    sums = loop.evaluate_sums(st, batches, lambda docs: _local_micro_batches(st, docs, st.ref_logps), step, STAT_KEYS)
    return loop.per_pair(sums, SUMMARY_NAMES, "dpo/val_")


# ------------------------------------------------------------------------------------------------ driver
def console_line(iteration: int, total: int, m: dict[str, float], eta: str) -> str:
    """`iter 10/200 | loss 0.512 | acc 0.75 | margin 0.31 | val_acc 0.81 | ... | lr 1.0e-05 | 0.21 s | ETA 40s`."""
    parts = [f"iter {iteration}/{total}", f"loss {m['dpo/loss']:.4f}", f"acc {m['dpo/rewards/accuracy']:.3f}",
             f"margin {m['dpo/rewards/margin']:.4f}"]  # fmt: skip
    if "dpo/val_rewards/accuracy" in m:
        parts += [f"val_loss {m['dpo/val_loss']:.4f}", f"val_acc {m['dpo/val_rewards/accuracy']:.3f}",
                  f"val_margin {m['dpo/val_rewards/margin']:.4f}"]  # fmt: skip
    parts += [f"logps {m['dpo/logps/chosen']:.2f} / {m['dpo/logps/rejected']:.2f}"]
    parts += [f"lr {m['dpo/lr']:.2e}", f"grad_norm {m['dpo/grad_norm']:.3g}", f"{m['timing/iteration']:.2f} s"]
    return " | ".join([*parts, f"ETA {eta}"])


RECIPE = loop.Recipe("dpo", "actor", _rank_setup, _rank_train_step, _rank_evaluate, console_line,
                     "dpo/val_rewards/accuracy")  # fmt: skip


def train_dpo(cfg: SFTConfig, pool=None, log=print) -> loop.TrainResult:
    """Train the policy with DPO as configured (`load_dpo_config`); `pool`: a RankPool of world_size ranks (default:
    a new one). Writes metrics to the run dir and a causal-LM checkpoint to megatron_training.save."""
    from mindrl.checkpoint.mcore_ckpt import read_model_meta

    mt = cfg.megatron_training
    spec, _ = read_model_meta(mt.load)
    return loop.train_loop(cfg, RECIPE, DPODataset(mt.data_path, mt.split), spec, pool, log)
