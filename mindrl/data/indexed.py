"""megatron's indexed datasets (.idx + .bin, the format in docs/data.md): a reader, checked as it opens so that a
truncated or corrupted file is named, and a writer that writes what megatron's IndexedDatasetBuilder writes, byte for
byte (tests/data/test_indexed.py); numpy only, so neither the driver nor mindrl-preprocess imports megatron-core
(~2.5 CPU s of torch and megatron imports per preprocessing run)."""

from __future__ import annotations

import os

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count

DTYPES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""megatron's dtype codes (its `DType` enum) for the tokens in the .bin."""


def _corrupt(idx: str, why: str) -> ValueError:
    return ValueError(f"{idx} is truncated or corrupted ({why}); run mindrl-preprocess again")


class IndexedDataset:
    """The sequences of `{prefix}.bin` as its `{prefix}.idx` lays them out: `ds[i]` is sequence i, a read-only
    numpy view of the memory-mapped .bin in the file's token dtype.

    sequence_lengths (n,) int32, sequence_pointers (n,) int64 byte offsets, document_indices (d + 1,) int64 (the
    sequence where each document starts, then n): views of the .idx. Opening checks the header, that the .idx is
    exactly as long as its counts say (plus megatron's optional per-sequence modes), that the documents partition the
    sequences, that the sequences lie back to back from offset 0 (how megatron's builder writes them) and that the .bin
    holds the last one; any failure is a ValueError naming the file."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx, bin_path = prefix + ".idx", prefix + ".bin"
        with open(idx, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise _corrupt(idx, f"{len(head)} bytes, shorter than the {HEADER_BYTES}-byte header")
        if head[: len(MAGIC)] != MAGIC:
            raise _corrupt(idx, "not a megatron index: its magic bytes differ")
        at = len(MAGIC)
        version = int.from_bytes(head[at : at + 8], "little")
        if version != VERSION:
            raise _corrupt(idx, f"index version {version}, this reader knows {VERSION}")
        code = head[at + 8]
        if code not in DTYPES:
            raise _corrupt(idx, f"unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        n = int.from_bytes(head[at + 9 : at + 17], "little")
        d = int.from_bytes(head[at + 17 : at + 25], "little")
        size = os.path.getsize(idx)
        expected = HEADER_BYTES + 12 * n + 8 * d
        if size not in (expected, expected + n):  # + n: megatron's multimodal files append an int8 mode per sequence
            raise _corrupt(idx, f"{size} bytes, but its header counts {n} sequences and {d} document starts, "
                           f"which take {expected}")  # fmt: skip
        raw = np.memmap(idx, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self.sequence_lengths = np.frombuffer(raw, np.int32, n, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(raw, np.int64, n, HEADER_BYTES + 4 * n)
        self.document_indices = np.frombuffer(raw, np.int64, d, HEADER_BYTES + 12 * n)
        docs = self.document_indices
        if d == 0 or docs[0] != 0 or docs[-1] != n or (np.diff(docs) < 0).any():
            raise _corrupt(idx, f"its document starts do not partition its {n} sequences")
        if n == 0:
            raise ValueError(f"{idx} holds no documents (corrupted?); run mindrl-preprocess again")
        lengths, pointers, item = self.sequence_lengths.astype(np.int64), self.sequence_pointers, self.dtype.itemsize
        if not (
            pointers[0] == 0 and (lengths >= 0).all() and (pointers[1:] == pointers[:-1] + lengths[:-1] * item).all()
        ):
            raise _corrupt(idx, "its sequence offsets are not contiguous")
        end = int(pointers[-1]) + int(lengths[-1]) * item
        bin_size = os.path.getsize(bin_path)
        if bin_size == 0:
            raise ValueError(f"{bin_path} is empty (truncated?); run mindrl-preprocess again")
        if bin_size < end:
            raise ValueError(
                f"{bin_path} is truncated: {bin_size} bytes, its .idx needs {end}; run mindrl-preprocess again"
            )
        self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        """(length_i,) the tokens of sequence i, in the file's dtype (a read-only view of the .bin)."""
        start = int(self.sequence_pointers[i])
        return np.frombuffer(self._bin, self.dtype, int(self.sequence_lengths[i]), start)


class IndexedWriter:
    """Writes `{prefix}.bin` as documents come (`add_document`), then `{prefix}.idx` (`finalize`): megatron's
    IndexedDatasetBuilder's files for the same calls (no multimodal modes)."""

    def __init__(self, bin_path: str, dtype: type[np.number] = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        codes = {np.dtype(t): code for code, t in DTYPES.items()}
        if self.dtype not in codes:
            raise ValueError(f"megatron's indexed format has no code for token dtype {self.dtype}")
        self._code = codes[self.dtype]
        self.data_file = open(bin_path, "wb")
        self._lengths: list[int] = []
        self._documents = [0]

    def add_document(self, tokens, lengths: list[int]) -> None:
        """One document: `tokens` (its sequences back to back) and the length of each sequence."""
        self.data_file.write(np.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self._lengths.extend(lengths)
        self._documents.append(len(self._lengths))

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(MAGIC + VERSION.to_bytes(8, "little") + bytes([self._code]))
            f.write(len(lengths).to_bytes(8, "little") + len(self._documents).to_bytes(8, "little"))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self._documents, dtype=np.int64).tobytes(order="C"))
