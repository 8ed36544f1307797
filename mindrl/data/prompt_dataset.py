"""Training-time prompts: the packed indexed datasets written by mindrl-preprocess, filtered by length,
served in seeded shuffled batches that resume exactly from `consumed_samples`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mindrl.data.indexed import IndexedDataset
from mindrl.data.preprocess import dataset_prefix

_SUFFIX = "_packed_input_ids_document"


@dataclass
class PromptBatch:
    """A batch of variable-length prompts (no padding yet: the rollout engine takes id lists).

    prompts[i]: (prompt_len_i,) int64 token ids; extras["labels"][i]: (label_len_i,) int64 reference-answer ids.
    indices: (batch,) positions in the packed dataset, so any sample can be traced back to its row.
    """

    prompts: list[torch.Tensor]
    indices: torch.Tensor
    extras: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return torch.tensor([len(p) for p in self.prompts], dtype=torch.long)

    def padded(self, pad_token_id: int, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), both (batch, max_prompt_len). Left padding by default, so every prompt
        ends at the same column and generation appends on the right."""
        width = max(len(p) for p in self.prompts)
        ids = torch.full((len(self.prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(self.prompts), width), dtype=torch.long)
        for i, p in enumerate(self.prompts):
            sl = slice(width - len(p), width) if left else slice(0, len(p))
            ids[i, sl] = p
            mask[i, sl] = 1
        return ids, mask


class PromptDataset:
    """Prompts (+ labels and other extra keys) from `{data_prefix}_packed_{key}_document`.

    Prompts longer than `max_prompt_length` are dropped up front (lengths come from the .idx, nothing else
    is read), and counted in `num_dropped`.
    """

    def __init__(
        self,
        data_prefix: str,
        max_prompt_length: int | None = None,
        extra_keys: list[str] | tuple[str, ...] = ("labels",),
    ) -> None:
        # Accept the trainer's data_path either as the output_prefix or as the input_ids dataset prefix.
        if data_prefix.endswith(_SUFFIX):
            data_prefix = data_prefix[: -len(_SUFFIX)]
        self.data_prefix = data_prefix
        self.extra_keys = list(extra_keys)
        paths = {k: dataset_prefix(data_prefix, k) for k in ["input_ids", *self.extra_keys]}
        for key, path in paths.items():
            if not (os.path.isfile(path + ".idx") and os.path.isfile(path + ".bin")):
                raise FileNotFoundError(
                    f"packed dataset for '{key}' not found: {path}.{{bin,idx}} (data_path '{data_prefix}'; "
                    "run mindrl-preprocess first, and check dataset_additional_keys)"
                )
        self.datasets = {k: IndexedDataset(p) for k, p in paths.items()}
        lengths = self.datasets["input_ids"].sequence_lengths
        for key in self.extra_keys:
            if len(self.datasets[key]) != len(lengths):
                raise ValueError(
                    f"{paths[key]} has {len(self.datasets[key])} documents but input_ids has {len(lengths)}: "
                    "the files come from different preprocessing runs"
                )
        if max_prompt_length is None:
            self.indices = np.arange(len(lengths), dtype=np.int64)
        else:
            self.indices = np.nonzero(lengths <= max_prompt_length)[0].astype(np.int64)
        self.max_prompt_length = max_prompt_length
        self.num_total = len(lengths)
        self.num_dropped = self.num_total - len(self.indices)
        if len(self.indices) == 0:
            raise ValueError(
                f"{data_prefix}: all {self.num_total} prompts are longer than max_prompt_length={max_prompt_length}"
            )

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        doc = int(self.indices[i])
        return {k: torch.from_numpy(ds[doc].astype(np.int64)) for k, ds in self.datasets.items()}

    def batch(self, positions: list[int]) -> PromptBatch:
        items = [self[i] for i in positions]
        return PromptBatch(
            prompts=[it["input_ids"] for it in items],
            indices=torch.as_tensor(self.indices[positions], dtype=torch.long),
            extras={k: [it[k] for it in items] for k in self.extra_keys},
        )


class ResumableShuffleSampler:
    """Batches of dataset positions: a fresh seeded permutation per epoch, epochs back to back.

    The whole order is a function of (seed, num_samples, batch_size), so the position after `consumed_samples`
    is computed directly (epoch = consumed // samples_per_epoch), never replayed batch by batch.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int = 1234,
        shuffle: bool = True,
        drop_last: bool = True,
        consumed_samples: int = 0,
    ) -> None:
        if batch_size < 1 or num_samples < 1:
            raise ValueError(f"need batch_size >= 1 and num_samples >= 1, got {batch_size} and {num_samples}")
        if drop_last and num_samples < batch_size:
            raise ValueError(f"batch_size {batch_size} > {num_samples} samples with drop_last: no batch would fit")
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        # drop_last drops the same tail size every epoch, so each epoch consumes the same number of samples.
        self.samples_per_epoch = (num_samples // batch_size) * batch_size if drop_last else num_samples
        self.consumed_samples = consumed_samples

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.samples_per_epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """(num_samples,) the sample order of `epoch`; reseeded per epoch, so epochs differ but replay exactly."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        """Endless batches from `consumed_samples` on; consumed_samples advances as each batch is handed out."""
        while True:
            epoch, offset = divmod(self.consumed_samples, self.samples_per_epoch)
            order = self.epoch_order(epoch)
            while offset < self.samples_per_epoch:
                batch = order[offset : min(offset + self.batch_size, self.samples_per_epoch)].tolist()
                offset += len(batch)
                self.consumed_samples += len(batch)
                yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A different dataset, seed or batch size would give another order: resuming would not be exact.
        for key in ("seed", "num_samples", "batch_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the prompt sampler: checkpoint has {key}={state[key]!r}, this run has "
                    f"{getattr(self, key)!r}; the data order would differ from the original run"
                )
        self.consumed_samples = int(state["consumed_samples"])


class PromptDataLoader:
    """PromptBatches from a PromptDataset in ResumableShuffleSampler order; its state goes in the checkpoint."""

    def __init__(self, dataset: PromptDataset, batch_size: int, **sampler_args: Any) -> None:
        """sampler_args: ResumableShuffleSampler's seed, shuffle, drop_last, consumed_samples (same defaults)."""
        self.dataset = dataset
        self.sampler = ResumableShuffleSampler(len(dataset), batch_size, **sampler_args)

    def __iter__(self) -> Iterator[PromptBatch]:
        for positions in self.sampler:
            yield self.dataset.batch(positions)

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "num_dropped": self.dataset.num_dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
