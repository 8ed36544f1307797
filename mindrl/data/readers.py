"""Streaming readers for raw datasets (a JSON list, JSON lines, parquet, or a directory of those): rows come out one at
a time with their file and line (or parquet row), so errors can point at them."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SUPPORTED_EXTENSIONS = (".json", ".jsonl", ".parquet")
_WS = " \t\r\n"


class InputError(ValueError):
    """The input cannot be read as a dataset; the message names the file and the line."""


@dataclass(frozen=True)
class InputFile:
    path: str
    kind: str  # "json_list" | "jsonl" | "parquet"


@dataclass(frozen=True)
class RawRow:
    """One raw row and where it came from (1-based line for JSON, 1-based row for parquet)."""

    row: Any
    file_index: int
    position: int


def discover_inputs(path: str) -> list[InputFile]:
    """The files behind `path` in a stable order (sorted by name for a directory)."""
    if not path:
        raise InputError("`input` is empty: give a .json / .jsonl / .parquet file or a directory of them")
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(SUPPORTED_EXTENSIONS))
        if not names:
            raise InputError(f"input directory {path} has no {'/'.join(SUPPORTED_EXTENSIONS)} files")
        return [_classify(os.path.join(path, n)) for n in names]
    if not os.path.exists(path):
        raise InputError(f"input not found: {path}")
    return [_classify(path)]


def _classify(path: str) -> InputFile:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        return InputFile(path, "parquet")
    if ext == ".jsonl":
        return InputFile(path, "jsonl")
    if ext == ".json":
        # ".json" is used for both a list and JSON lines (one object per line): the first character decides.
        try:
            with open(path, encoding="utf-8-sig") as f:
                while True:
                    c = f.read(1)
                    if c == "" or c not in _WS:
                        break
        except UnicodeDecodeError as e:
            raise _not_utf8(path, e) from None
        return InputFile(path, "json_list" if c == "[" else "jsonl")
    raise InputError(f"unsupported input format '{ext}' for {path}; supported: {', '.join(SUPPORTED_EXTENSIONS)}")


def iter_rows(files: list[InputFile]) -> Iterator[RawRow]:
    """All rows of all files, in order, streamed."""
    readers = {"jsonl": _iter_jsonl, "json_list": _iter_json_list, "parquet": _iter_parquet}
    for i, f in enumerate(files):
        try:
            for pos, row in readers[f.kind](f.path):
                yield RawRow(row, i, pos)
        except UnicodeDecodeError as e:  # a JSON list is decoded in chunks: the line is not known here
            raise _not_utf8(f.path, e) from None


def _not_utf8(path: str, e: UnicodeDecodeError, where: str = "") -> InputError:
    return InputError(f"{path}{where}: not UTF-8 text ({e.reason}: byte 0x{e.object[e.start]:02x}); save it as UTF-8")


def _iter_jsonl(path: str) -> Iterator[tuple[int, Any]]:
    # Bytes, decoded line by line, so that a non-UTF-8 line is reported with its number.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, e, f", line {lineno}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except RecursionError:
                raise InputError(f"{path}, line {lineno}: invalid JSON: nested too deeply") from None
            except json.JSONDecodeError as e:
                # A pretty-printed single object also lands here: say which shapes are accepted.
                hint = " (expected a JSON list, or one JSON object per line)" if lineno == 1 else ""
                raise InputError(f"{path}, line {lineno}, column {e.colno}: invalid JSON: {e.msg}{hint}") from None
            yield lineno, row


def _iter_json_list(path: str, chunk_chars: int = 1 << 20, max_row_chars: int = 64 << 20) -> Iterator[tuple[int, Any]]:
    """Parse a top-level JSON list element by element, holding about one chunk plus one row in memory.

    Our own loop over json.JSONDecoder.raw_decode (C-accelerated) rather than a full json.load, so files
    larger than RAM work, and errors carry exact line numbers.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:
        buf, pos, line, eof = "", 0, 1, False

        def more() -> bool:
            # Drop what is parsed, then read on; the chunk grows with the pending row so that a huge row costs
            # O(size) in total, not O(size^2).
            nonlocal buf, pos, eof
            buf, pos = buf[pos:], 0  # `line` already counts the dropped part
            data = f.read(max(chunk_chars, len(buf)))
            eof = data == ""
            buf += data
            return not eof

        def skip_ws() -> str:
            # The next non-blank character ('' at end of file), with `line` kept in step.
            nonlocal pos, line
            while True:
                while pos < len(buf) and buf[pos] in _WS:
                    line += buf[pos] == "\n"
                    pos += 1
                if pos < len(buf):
                    return buf[pos]
                if not more():
                    return ""

        def fail(what: str, at_line: int, col: int | None = None) -> InputError:
            where = f"line {at_line}" + (f", column {col}" if col is not None else "")
            return InputError(f"{path}, {where}: invalid JSON: {what}")

        if skip_ws() != "[":
            raise fail("expected a list ('[') at the start of the file", line)
        pos += 1
        first = True
        while True:
            c = skip_ws()
            if c == "]":
                pos += 1
                if skip_ws() != "":
                    raise fail("unexpected data after the closing ']'", line)
                return
            if c == "":
                raise fail("the list is not closed (missing ']') at end of file", line)
            if not first:
                if c != ",":
                    raise fail(f"expected ',' or ']' between rows, found {c!r}", line)
                pos += 1
                if skip_ws() in ("", "]"):
                    raise fail("trailing ',' before ']' or end of file", line)
            start_line = line
            while True:
                try:
                    row, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or eof:
                        break
                except RecursionError:
                    raise fail("nested too deeply", start_line) from None
                except json.JSONDecodeError as e:
                    if eof or len(buf) - pos > max_row_chars:
                        err_line = start_line + buf.count("\n", pos, e.pos)
                        col = e.pos - (buf.rfind("\n", 0, e.pos) + 1) + 1
                        raise fail(e.msg, err_line, col) from None
                # The row may run past the buffer: read on and parse it again from its start.
                more()
            line = start_line + buf.count("\n", pos, end)
            pos = end
            first = False
            yield start_line, row


def _iter_parquet(path: str, batch_rows: int = 1024) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is an optional extra
        raise InputError(f"{path}: reading parquet needs pyarrow (pip install 'mindrl[parquet]')") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise InputError(f"{path}: not a readable parquet file: {e}") from None
    n = 0
    # Row batches, not the whole table: memory stays at one batch whatever the file size.
    batches = pf.iter_batches(batch_size=batch_rows)
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # a corrupted page: pyarrow raises OSError / ArrowInvalid / ...
            raise InputError(f"{path}: parquet data after row {n} is corrupted: {e}") from None
        if batch is None:
            return
        for row in batch.to_pylist():
            n += 1
            yield n, row
