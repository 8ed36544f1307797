"""The one batch type that flows between the driver and the workers (its tensor layout: `Batch`). Every stage names the
keys it reads and writes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "routed_experts")
"""The tensors of P + R columns (prompt then response); see `Batch.reframe` (routed_experts: routing replay's
experts per token, `mindrl.workers.rl_model.ROUTED_EXPERTS`)."""


@dataclass
class Batch:
    """A dict of tensors sharing the first (row) dimension, plus per-row and global metadata.

    Layout of an RL batch (rows = responses; P = longest prompt, R = longest response in the batch):
        input_ids        (rows, P + R)  prompt left-padded to P, response right-padded to R
        attention_mask   (rows, P + R)  1 = real token
        responses        (rows, R)      response token ids, right-padded
        response_mask    (rows, R)      1 = a token the policy generated
        rollout_log_prob (rows, R)      the rollout engine's logprob of each response token
        old_log_prob, ref_log_prob, values, token_level_scores, token_level_rewards, advantages, returns: (rows, R)
    meta["prompt_length"] = P (an int); per-row lists live in `rows_meta` (e.g. "uid": the prompt's group id).
    `group_size` = n: the rows come in runs of n consecutive rows with the same prompt (a GRPO group: n samples of
    one prompt); 1 when nothing is known.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rows_meta: dict[str, list[Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    group_size: int = 1
    """Rows of one prompt are consecutive, `group_size` of them (the n samples per prompt): rows [k * n, (k + 1) * n)
    share a prompt. Kept by `select`, `index` (as far as the chosen rows keep runs of one group: `_runs`), `split`
    and `reframe`; 1 says nothing about the rows."""

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.rows_meta.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch: every tensor and row list must have the same number of rows, got {sizes}")
        if self.group_size < 1 or len(self) % self.group_size:
            raise ValueError(f"Batch: {len(self)} rows do not come in groups of {self.group_size}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.rows_meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"the batch has no tensor {key!r}; it has {sorted(self.tensors)}") from None

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if self.tensors and value.shape[0] != len(self):
            raise ValueError(f"Batch[{key!r}]: {value.shape[0]} rows, the batch has {len(self)}")
        self.tensors[key] = value

    def select(self, keys: Iterable[str], rows_meta: Iterable[str] = ()) -> Batch:
        """A batch with only the named tensors and per-row lists (and the global metadata and group size): what a
        stage needs to receive."""
        return Batch(
            {k: self[k] for k in keys}, {k: self.rows_meta[k] for k in rows_meta}, dict(self.meta), self.group_size
        )

    def index(self, rows: Sequence[int] | torch.Tensor) -> Batch:
        idx = torch.as_tensor(rows, dtype=torch.long)
        tensors = {k: v.index_select(0, idx) for k, v in self.tensors.items()}
        rows_meta = {k: [v[i] for i in idx.tolist()] for k, v in self.rows_meta.items()}
        return Batch(tensors, rows_meta, dict(self.meta), self._runs(idx))

    def _runs(self, idx: torch.Tensor) -> int:
        """The group size of the rows `idx`: the gcd of the lengths of its runs of consecutive rows of one group."""
        g = self.group_size
        if g == 1 or not len(idx):
            return 1
        step = (idx[1:] == idx[:-1] + 1) & (idx[1:] // g == idx[:-1] // g)
        bounds = [0, *(torch.nonzero(~step).flatten() + 1).tolist(), len(idx)]
        n = g
        for start, end in zip(bounds, bounds[1:]):
            n = math.gcd(n, end - start)
        return n

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with its tensors on `device` (themselves where they are there already)."""
        tensors = {k: v.to(device) for k, v in self.tensors.items()}
        return Batch(tensors, dict(self.rows_meta), dict(self.meta), self.group_size)

    def split(self, parts: int) -> list[Batch]:
        """`parts` consecutive equal slices (the row count must divide)."""
        n = len(self)
        if parts < 1 or n % parts:
            raise ValueError(f"cannot split {n} rows into {parts} equal parts")
        size = n // parts
        return [self.index(range(i * size, (i + 1) * size)) for i in range(parts)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        if not batches:
            return Batch()
        first = batches[0]
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        rows_meta = {k: [x for b in batches for x in b.rows_meta[k]] for k in first.rows_meta}
        return Batch(tensors, rows_meta, dict(first.meta), math.gcd(*(b.group_size for b in batches)))

    def update(self, tensors: dict[str, torch.Tensor]) -> None:
        for k, v in tensors.items():
            self[k] = v

    def reframe(self, prompt_width: int, response_width: int) -> Batch:
        """The same rows in an RL layout of prompt width `prompt_width` and response width `response_width`:
        the sequence tensors (SEQUENCE_KEYS) keep their last prompt_width prompt columns (left-extended with
        padding, mask 0, if wider than P) and their first response_width response columns; every other tensor
        of R columns keeps its first response_width. Only padding may be cut: a real token there is an error."""
        p, r = self.meta["prompt_length"], self["responses"].shape[1]
        if not 1 <= response_width <= r or prompt_width < 1:
            raise ValueError(f"reframe: widths ({prompt_width}, {response_width}) for a batch of ({p}, {r})")
        mask = self["attention_mask"]
        if mask[:, : max(p - prompt_width, 0)].any() or mask[:, p + response_width :].any():
            raise ValueError(f"reframe to ({prompt_width}, {response_width}) would cut real tokens of ({p}, {r})")
        tensors = {}
        for k, v in self.tensors.items():
            if k in SEQUENCE_KEYS:
                v = v[:, max(p - prompt_width, 0) : p + response_width]
                if prompt_width > p:
                    v = torch.cat([v.new_zeros((v.shape[0], prompt_width - p, *v.shape[2:])), v], 1)
            elif v.dim() >= 2 and v.shape[1] == r:
                v = v[:, :response_width]
            tensors[k] = v
        return Batch(tensors, dict(self.rows_meta), {**self.meta, "prompt_length": prompt_width}, self.group_size)

    def real_widths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt, response) widths of each row without its padding: the columns from its first real prompt
        token to P, and from P to its last real response token (attention_mask or response_mask)."""
        p = self.meta["prompt_length"]
        mask = self["attention_mask"].bool()
        zero = torch.zeros((len(self), 1), dtype=torch.long)  # a column of 0 so that an empty part has width 0
        prompt = torch.cat([zero, mask[:, :p] * torch.arange(p, 0, -1)], 1)
        response = torch.cat(
            [zero, (mask[:, p:] | self["response_mask"].bool()) * torch.arange(1, mask.shape[1] - p + 1)], 1
        )
        return prompt.amax(1), response.amax(1)


def shard_rows(num_rows: int, dp: int, num_mini_batches: int = 1) -> list[list[int]]:
    """Row indices per data-parallel rank such that mini-batch k of every rank's shard is its slice of the
    global mini-batch k: the update is then the same whatever the DP size (DP invariance).

    The rows are cut into num_mini_batches * dp equal chunks, mini-batch-major; rank d gets chunks
    (0, d), (1, d), ... in that order."""
    chunks = num_mini_batches * dp
    if num_rows % chunks:
        raise ValueError(f"{num_rows} rows do not split into {num_mini_batches} mini-batches x {dp} DP ranks")
    size = num_rows // chunks
    return [
        [r for k in range(num_mini_batches) for r in range((k * dp + d) * size, (k * dp + d + 1) * size)]
        for d in range(dp)
    ]


def pad_rows(seqs: Sequence[Sequence[int]], pad: int, left: bool, width: int | None = None):
    """(ids, mask), both (len(seqs), width): each sequence left- or right-aligned, padded with `pad`."""
    width = max((len(s) for s in seqs), default=0) if width is None else width
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not len(s):
            continue
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, sl] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask
