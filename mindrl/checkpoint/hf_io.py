"""Read and write HF safetensors checkpoints one tensor at a time: `HFCheckpoint` validates a directory up front
(config, index, every shard's header and size), `HFShardWriter` streams tensors into size-capped shards."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Small files carried between HF and megatron checkpoints (config, tokenizer, generation settings).
_CARRY_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".tiktoken", ".py")
_NOT_CARRIED = {INDEX_FILE}


class CheckpointError(ValueError):
    """Missing, truncated, corrupted or mismatched checkpoint files."""


class HFCheckpoint:
    """Lazy, validated access to the tensors of an HF safetensors checkpoint directory."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isdir(path):
            raise CheckpointError(f"HF checkpoint directory {path!r} does not exist")
        index = os.path.join(path, INDEX_FILE)
        single = os.path.join(path, SINGLE_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from e
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(
                    f"{index}: 'weight_map' must map tensor names to shard files, got {weight_map!r:.80}"
                )
            bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str) or os.path.basename(v) != v]
            if bad:
                raise CheckpointError(f"{index}: 'weight_map' entries must name a shard file in {path!r}: {bad[:3]}")
        elif os.path.isfile(single):
            weight_map = None
        else:
            bins = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt")))
            hint = f" (found {bins[:3]}: re-save it with safe_serialization=True)" if bins else ""
            raise CheckpointError(f"{path!r} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")

        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
        self._file_of: dict[str, str] = {}
        for fname in files:
            fpath = os.path.join(path, fname)
            if not os.path.isfile(fpath):
                raise CheckpointError(f"shard {fname!r} listed in {INDEX_FILE} is missing from {path!r}")
            try:
                with safe_open(fpath, "pt") as f:  # parses the header and checks the file covers it
                    keys = list(f.keys())
            except SafetensorError as e:
                raise CheckpointError(f"shard {fpath!r} is truncated or corrupted: {e}") from e
            for k in keys:
                if weight_map is not None and weight_map.get(k) != fname:
                    raise CheckpointError(f"{fpath!r} holds {k!r} but {INDEX_FILE} maps it to {weight_map.get(k)!r}")
                self._file_of[k] = fpath
        if weight_map is not None:
            missing = [k for k in weight_map if k not in self._file_of]
            if missing:
                raise CheckpointError(f"{INDEX_FILE} lists tensors absent from their shard: {missing[:5]}")
        self._handles: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self._file_of)

    def _handle(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.path!r}")
        fpath = self._file_of[name]
        if fpath not in self._handles:
            self._handles[fpath] = safe_open(fpath, "pt")
        return self._handles[fpath]

    def shape(self, name: str) -> tuple[int, ...]:
        """From the shard header: no tensor data is read."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, check_finite: bool = True) -> torch.Tensor:
        fpath = self._file_of.get(name)
        t = self._handle(name).get_tensor(name)
        if check_finite and t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"tensor {name!r} in {fpath!r} holds NaN/Inf: the shard is corrupted")
        return t

    def close(self) -> None:
        self._handles.clear()


def carry_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy config / tokenizer / generation files (not weights) from src_dir to dst_dir."""
    os.makedirs(dst_dir, exist_ok=True)
    copied = []
    for name in sorted(os.listdir(src_dir)):
        src = os.path.join(src_dir, name)
        if os.path.isfile(src) and name.endswith(_CARRY_SUFFIXES) and name not in _NOT_CARRIED:
            shutil.copy2(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


class HFShardWriter:
    """Stream (name, tensor) pairs into `model-XXXXX-of-YYYYY.safetensors` shards plus an index.

    At most one shard (max_shard_bytes) is buffered. Tensors are written contiguous and unshared.
    """

    def __init__(self, out_dir: str, max_shard_bytes: int = 5 * 1024**3):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        os.makedirs(out_dir, exist_ok=True)
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buffer or any(name in s for s in self._shards):
            raise CheckpointError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = (
            tensor.detach().contiguous().clone() if tensor._base is not None else tensor.detach().contiguous()
        )
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        idx = len(self._shards) + 1
        save_file(self._buffer, os.path.join(self.out_dir, f"shard-{idx:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer, self._buffer_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard and the index; returns the shard file names."""
        if self._buffer or not self._shards:
            self._flush()
        n = len(self._shards)
        names = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map = {}
        for i, (fname, keys) in enumerate(zip(names, self._shards), start=1):
            os.replace(os.path.join(self.out_dir, f"shard-{i:05d}.tmp"), os.path.join(self.out_dir, fname))
            weight_map.update({k: fname for k in keys})
        if n > 1:
            with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return names
