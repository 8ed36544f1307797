"""The `mindrl-train-rm` config (`stage: orm`): the SFT config's megatron training arguments (mindrl.config.sft) for a
reward model trained on preference pairs; loaded with `load_sft_config(..., schema=RMTrainingConfig)`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from mindrl.config.sft import SFTTrainingConfig


@dataclass
class RMTrainingConfig(SFTTrainingConfig):
    """`megatron_training:` of a reward-model config: every SFT key means the same, with these differences. A
    global batch counts preference pairs (each pair is two sequences); seq_length cuts each sequence."""

    STAGE: ClassVar[str] = "orm"
    TRAINS: ClassVar[str] = "mindrl-train-rm trains an outcome reward model (ORM) on preference pairs"
    IGNORED: ClassVar[Mapping[str, str]] = {
        **SFTTrainingConfig.IGNORED,
        "is_pairwise_dataset": "the data's keys say it (AlpacaStylePairwiseHandler writes chosen_* / rejected_*)",
        "load_checkpoint_loosely": "a causal-LM checkpoint always gets a fresh value head",
    }

    stage: str = "orm"
    """Training stage; only "orm" (MindSpeed's outcome reward model)."""
    data_path: str = ""
    """Prefix written by mindrl-preprocess with handler_name=AlpacaStylePairwiseHandler (its output_prefix):
    chosen_/rejected_ input_ids and labels (-100 over the prompt) and the per-pair margin."""
    load: str = ""
    """Megatron checkpoint to start from: a causal LM (an SFT save, mindrl-convert hf2mcore; it gets a fresh value
    head) or a value-head model (mindrl-convert hf2mcore --orm, an earlier mindrl-train-rm save)."""
    save: str = ""
    """Checkpoint directory to write: a value-head model (what critic_config.load and the reward model read, and
    `mindrl-convert mcore2hf --orm` exports as *ForSequenceClassification)."""
    run_dir: str = ""
    """Where metrics.jsonl, tensorboard/ and rm_config.json go (default: outputs/<config name>)."""
    eval_interval: int = 0
    """Validation loss and pairwise accuracy every this many steps and at the end (0: never; needs a validation
    split)."""
