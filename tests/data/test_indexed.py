"""mindrl's indexed-dataset reader against megatron-core's own builder and reader: the same sequences and document
starts bit for bit, in every token dtype, one or several sequences per document; broken files named. mindrl's writer
against megatron's builder: the same .bin and .idx bytes for the same documents."""

from __future__ import annotations

import os
import re
import shutil
import struct

import numpy as np
import pytest
import torch

from mindrl.data.indexed import DTYPES, IndexedDataset, IndexedWriter

# megatron's IndexedDataset.__del__ fails on an object whose __init__ raised: its noise, not ours.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _build(prefix: str, dtype, docs: list[list[list[int]]], multimodal: bool = False) -> None:
    """docs[d][s]: the tokens of sequence s of document d, through megatron's builder (add_item + end_document for
    one document in two, add_document for the others)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for d, seqs in enumerate(docs):
        if d % 2:
            for s in seqs:
                b.add_item(torch.tensor(s, dtype=torch.float64), mode=len(s) % 3)
            b.end_document()
        else:
            flat = np.array([t for s in seqs for t in s], dtype=dtype)
            b.add_document(flat, [len(s) for s in seqs], modes=[1] * len(seqs) if multimodal else None)
    b.finalize(prefix + ".idx")


def _docs(rng: np.random.Generator, dtype, n_docs: int, max_seqs: int) -> list[list[list[int]]]:
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    lo, hi = (int(info.min), int(info.max)) if info else (-1000, 1000)
    hi = min(hi, 2**31 - 1)  # add_item goes through a float64 tensor: keep the values exact
    lo = max(lo, -(2**31))
    return [
        [
            rng.integers(lo, hi, size=int(rng.integers(0, 9)), endpoint=True).tolist()
            for _ in range(rng.integers(1, max_seqs + 1))
        ]
        for _ in range(n_docs)
    ]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=lambda t: t.__name__)
@pytest.mark.parametrize("max_seqs", [1, 4], ids=["one_sequence_per_document", "several_per_document"])
def test_same_sequences_and_document_starts_as_megatron(tmp_path, dtype, max_seqs):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "data")
    docs = _docs(rng, dtype, 7, max_seqs)
    docs[0][0] = docs[0][0] or [1]  # some sequence holds a token, so the .bin is not empty
    _build(prefix, dtype, docs)
    ours, theirs = IndexedDataset(prefix), MegatronDataset(prefix)
    assert len(ours) == len(theirs) == sum(len(d) for d in docs)
    assert ours.dtype == theirs.index.dtype
    for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
        a, b = getattr(ours, name), getattr(theirs.index, name)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), i
    flat = [s for d in docs for s in d]
    assert [ours[i].tolist() for i in range(len(ours))] == flat


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=lambda t: t.__name__)
def test_the_writer_writes_megatrons_bytes(tmp_path, dtype):
    """mindrl-preprocess writes with IndexedWriter: for the same add_document calls (several sequences per document,
    empty ones included), the files megatron's IndexedDatasetBuilder writes, byte for byte."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = _docs(np.random.default_rng(1), dtype, 9, 4)
    docs[0][0] = docs[0][0] or [1]
    ours, theirs = (
        IndexedWriter(str(tmp_path / "a.bin"), dtype=dtype),
        IndexedDatasetBuilder(str(tmp_path / "b.bin"), dtype=dtype),
    )
    for seqs in docs:
        flat = np.array([t for q in seqs for t in q], dtype=dtype)
        for writer in (ours, theirs):
            writer.add_document(flat, [len(q) for q in seqs])
    ours.finalize(str(tmp_path / "a.idx"))
    theirs.finalize(str(tmp_path / "b.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a{ext}").read_bytes() == (tmp_path / f"b{ext}").read_bytes(), ext
    assert [IndexedDataset(str(tmp_path / "a"))[i].tolist() for i in range(sum(map(len, docs)))] == [
        q for d in docs for q in d
    ]
    with pytest.raises(ValueError, match="no code for token dtype"):
        IndexedWriter(str(tmp_path / "c.bin"), dtype=np.uint32)


def test_multimodal_files_read_their_tokens(tmp_path):
    """megatron's multimodal index appends a mode per sequence: the tokens read as megatron's reader reads them."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    prefix = str(tmp_path / "mm")
    _build(prefix, np.int32, [[[1, 2], [3]], [[4, 5, 6]], [[7]]], multimodal=True)
    ours, theirs = IndexedDataset(prefix), MegatronDataset(prefix, multimodal=True)
    assert ours.document_indices.tolist() == theirs.document_indices.tolist() == [0, 2, 3, 4]
    assert all(ours[i].tobytes() == theirs[i][0].tobytes() for i in range(len(ours)))


@pytest.fixture
def good(tmp_path) -> str:
    prefix = str(tmp_path / "good" / "d")
    os.makedirs(os.path.dirname(prefix))
    _build(prefix, np.int32, [[[1, 2, 3]], [[4, 5]], [[6, 7, 8, 9]]])
    return prefix


def _copy(good: str, tmp_path, name: str) -> tuple[str, str, str]:
    prefix = str(tmp_path / name)
    for ext in (".idx", ".bin"):
        shutil.copy(good + ext, prefix + ext)
    return prefix, prefix + ".idx", prefix + ".bin"


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_broken_files_are_named(good, tmp_path):
    n = 3
    lengths_at, pointers_at = 34, 34 + 4 * n
    docs_at = pointers_at + 8 * n
    cases = {
        "truncated_idx": (
            lambda idx, b: os.truncate(idx, os.path.getsize(idx) - 20),
            ".idx is truncated or corrupted \\(\\d+ bytes, but its header counts 3",
        ),
        "short_header": (
            lambda idx, b: os.truncate(idx, 20),
            ".idx is truncated or corrupted \\(20 bytes, shorter than",
        ),
        "garbage_idx": (
            lambda idx, b: open(idx, "wb").write(b"not an index at all, not at all!!!!"),
            ".idx is truncated or corrupted \\(not a megatron index",
        ),
        "version": (
            lambda idx, b: _patch(idx, 9, struct.pack("<Q", 2)),
            ".idx is truncated or corrupted \\(index version 2",
        ),
        "dtype_code": (
            lambda idx, b: _patch(idx, 17, b"\x09"),
            ".idx is truncated or corrupted \\(unknown token dtype code 9",
        ),
        "dtype_size": (
            lambda idx, b: _patch(idx, 17, b"\x05"),
            ".idx is truncated or corrupted \\(its sequence offsets are not contiguous",
        ),
        "counts": (
            lambda idx, b: _patch(idx, 18, struct.pack("<Q", 1000)),
            ".idx is truncated or corrupted \\(\\d+ bytes, but its header counts 1000",
        ),
        "document_end": (
            lambda idx, b: _patch(idx, docs_at + 8 * n, struct.pack("<q", 2)),
            ".idx is truncated or corrupted \\(its document starts",
        ),
        "document_start": (
            lambda idx, b: _patch(idx, docs_at, struct.pack("<q", 1)),
            ".idx is truncated or corrupted \\(its document starts",
        ),
        "pointer": (
            lambda idx, b: _patch(idx, pointers_at + 8, struct.pack("<q", 4)),
            ".idx is truncated or corrupted \\(its sequence offsets",
        ),
        "negative_length": (
            lambda idx, b: _patch(idx, lengths_at, struct.pack("<i", -3)),
            ".idx is truncated or corrupted \\(its sequence offsets",
        ),
        "truncated_bin": (
            lambda idx, b: os.truncate(b, os.path.getsize(b) - 1),
            ".bin is truncated: 35 bytes, its .idx needs 36",
        ),
        "empty_bin": (lambda idx, b: os.truncate(b, 0), ".bin is empty"),
    }
    for name, (damage, message) in cases.items():
        prefix, idx, binf = _copy(good, tmp_path, name)
        damage(idx, binf)
        with pytest.raises(ValueError, match=f"^{re.escape(prefix)}{message}") as e:
            IndexedDataset(prefix)
        assert "run mindrl-preprocess again" in str(e.value), (name, e.value)
    prefix, idx, binf = _copy(good, tmp_path, "no_sequences")
    _build(prefix, np.int32, [])
    with pytest.raises(ValueError, match=f"^{re.escape(prefix)}.idx holds no documents"):
        IndexedDataset(prefix)
    # trailing bytes after the last sequence are not read: megatron's reader accepts them too
    prefix, idx, binf = _copy(good, tmp_path, "longer_bin")
    with open(binf, "ab") as f:
        f.write(b"\0" * 8)
    assert IndexedDataset(prefix)[2].tolist() == [6, 7, 8, 9]
