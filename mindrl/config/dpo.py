"""The `mindrl-train-dpo` config (`stage: dpo`): the SFT config's megatron training arguments plus MindSpeed-LLM's DPO
keys; loaded with `load_sft_config(..., schema=DPOTrainingConfig)`."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mindrl.algorithms.dpo import DPO_LOSS_TYPES
from mindrl.config.errors import Collector
from mindrl.config.megatron import MEGATRON_IGNORED, MEGATRON_UNSUPPORTED, megatron_key_kind
from mindrl.config.section import check_neutral
from mindrl.config.sft import SFTTrainingConfig

_NO_DROPOUT = ((0, 0.0), "dropout (mindrl's decoders have none)")


@dataclass
class DPOTrainingConfig(SFTTrainingConfig):
    """`megatron_training:` of a DPO config: every SFT key means the same, with these differences. A global batch
    counts preference pairs (each pair is two sequences); seq_length cuts each sequence."""

    STAGE: ClassVar[str] = "dpo"
    TRAINS: ClassVar[str] = "mindrl-train-dpo trains a causal LM with direct preference optimisation"
    READS_MODEL: ClassVar[bool] = True
    # Besides these, the megatron keys mindrl-train ignores or accepts only neutral (MEGATRON_IGNORED /
    # MEGATRON_UNSUPPORTED: kernel, overlap and MoE dispatch switches) mean the same here (`classify`).
    IGNORED: ClassVar[Mapping[str, str]] = {
        **SFTTrainingConfig.IGNORED,
        "is_pairwise_dataset": "the data's keys say it (AlpacaStylePairwiseHandler writes chosen_* / rejected_*)",
        "no_pad_to_seq_lengths": "variable_seq_lengths says it",
        "init_method_std": "weights always come from a checkpoint (load)",
    }
    UNSUPPORTED: ClassVar[Mapping[str, tuple[tuple[Any, ...], str]]] = {
        **SFTTrainingConfig.UNSUPPORTED,
        "refer_model_iter": ((1,), "refreshing the reference from the policy"),
        "attention_dropout": _NO_DROPOUT,
        "hidden_dropout": _NO_DROPOUT,
    }

    stage: str = "dpo"
    """Training stage; only "dpo" (offline DPO against a frozen reference)."""
    model: str = ""
    """The model file (<config dir>/model/NAME.yaml, MindSpeed's defaults list) describing the checkpoint's
    architecture, with the architecture keys written here over it: what mindrl-plan sizes. The run builds what `load`
    holds; empty: no architecture (the run needs none, mindrl-plan does)."""
    initial_loss_scale: float | None = None
    """fp16's initial dynamic loss scale; not applied: with bf16 / fp32 it has no effect (ignored), with fp16 it is
    refused (megatron's own start, 2**32, is used)."""
    data_path: str = ""
    """Prefix written by mindrl-preprocess with handler_name=AlpacaStylePairwiseHandler (its output_prefix):
    chosen_/rejected_ input_ids and labels (-100 over the prompt)."""
    load: str = ""
    """Megatron causal-LM checkpoint to start the policy from (an SFT save, mindrl-convert hf2mcore)."""
    ref_model: str = ""
    """The frozen reference, a megatron causal-LM checkpoint (MindSpeed-LLM's key); empty: `load`, the policy's start.
    Its log-probabilities are computed once, before the first step."""
    save: str = ""
    """Checkpoint directory to write: a causal LM (actor_config.load; mindrl-convert mcore2hf exports it)."""
    run_dir: str = ""
    """Where metrics.jsonl, tensorboard/ and dpo_config.json go (default: outputs/<config name>)."""
    eval_interval: int = 0
    """Validation loss, reward accuracy and margins every this many steps and at the end (0: never)."""
    dpo_beta: float = 0.1
    """beta: the strength of the implicit KL to the reference (the rewards are beta x log-ratio sums)."""
    dpo_label_smoothing: float = 0.0
    """cDPO: the probability that a pair's label is flipped, in [0, 0.5) (sigmoid loss only)."""
    dpo_loss_type: str = "sigmoid"
    """sigmoid (DPO), hinge (SLiC) or ipo (IPO, on the summed log-ratios)."""
    pref_ftx: float = 0.0
    """MindSpeed-LLM's SFT coefficient: pref_ftx x the chosen response's per-token mean NLL is added to each pair's
    loss (0: pure DPO)."""

    @classmethod
    def classify(cls, key: str, value: Any, col: Collector, path: str) -> str:
        kind = super().classify(key, value, col, path)
        if kind == "unknown" and megatron_key_kind(key) == "ignored":
            col.ignore(path, MEGATRON_IGNORED[key])
            return "ignored"
        if kind == "unknown" and megatron_key_kind(key) == "unsupported":
            return "unsupported" if check_neutral(value, MEGATRON_UNSUPPORTED[key], col, path) else "bad"
        return kind

    @classmethod
    def known_keys(cls) -> set[str]:
        from mindrl.config.model import ModelArchConfig

        arch = set(ModelArchConfig.field_names()) - {"name"}
        return super().known_keys() | set(MEGATRON_IGNORED) | set(MEGATRON_UNSUPPORTED) | arch

    def validate(self, col: Collector) -> None:
        super().validate(col)
        if self.initial_loss_scale is not None:
            if self.fp16:
                col.add("initial_loss_scale", "is not applied by mindrl-train-dpo (fp16 starts at megatron's "
                        "2**32); remove it")  # fmt: skip
            else:
                col.ignore("initial_loss_scale", f"a loss scale is fp16's; this run trains in {self.dtype}")
        if not self.dpo_beta > 0:
            col.add("dpo_beta", f"must be > 0, got {self.dpo_beta}")
        if not 0 <= self.dpo_label_smoothing < 0.5:
            col.add("dpo_label_smoothing", f"must be within [0, 0.5), got {self.dpo_label_smoothing}")
        if self.dpo_loss_type not in DPO_LOSS_TYPES:
            col.add("dpo_loss_type", f"{self.dpo_loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")
        elif self.dpo_label_smoothing and self.dpo_loss_type != "sigmoid":
            col.add("dpo_label_smoothing", f"applies to dpo_loss_type sigmoid only, not {self.dpo_loss_type!r}")
        if not (isinstance(self.pref_ftx, (int, float)) and math.isfinite(self.pref_ftx) and self.pref_ftx >= 0):
            col.add("pref_ftx", f"must be a finite number >= 0, got {self.pref_ftx!r}")

    @property
    def separate_reference(self) -> bool:
        """Whether the reference is another checkpoint than the policy's start (`ref_model` set, not `load`)."""
        return bool(self.ref_model) and os.path.abspath(self.ref_model) != os.path.abspath(self.load)
