"""Raw JSON/JSONL/parquet -> Megatron indexed datasets ({prefix}_packed_{key}_document.{bin,idx}): streams rows,
tokenises chunks in order (optionally in worker processes), skips and reports bad rows."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import numpy as np

from mindrl.data.handlers import EncodedChunk, Handler, get_handler_class
from mindrl.data.preprocess_config import ConfigError, PreprocessConfig
from mindrl.data.readers import InputError, InputFile, RawRow, discover_inputs, iter_rows
from mindrl.data.templates import get_template

MAX_REPORTED_ROWS = 20  # the report lists this many skipped rows; the counts cover all of them


class BadRowError(ValueError):
    """strict=true and a row could not be used."""


@dataclass
class SkippedRow:
    row: int  # 0-based index over all input rows, in reading order
    file: str
    line: int  # 1-based line (JSON) or row (parquet) inside `file`
    reason: str


@dataclass
class PreprocessReport:
    """What a run read, wrote and skipped; saved as {output_prefix}_report.json."""

    input: str
    output_prefix: str
    handler_name: str
    prompt_type: str
    workers: int
    rows_read: int = 0
    rows_written: int = 0
    rows_skipped: int = 0
    rows_too_long: int = 0  # good rows dropped by seq_length (not counted in rows_skipped)
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    first_skipped: list[SkippedRow] = field(default_factory=list)
    output_files: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the whole run
    setup_seconds: float = 0.0  # tokenizer load, imports, worker start
    rows_per_s: float = 0.0  # rows read per second of row processing (reading, tokenising, writing)


def output_keys(cfg: PreprocessConfig) -> list[str]:
    handler_cls = get_handler_class(cfg.handler_name)
    return list(handler_cls.produces) + [k for k in cfg.dataset_additional_keys if k not in handler_cls.produces]


def dataset_prefix(output_prefix: str, key: str) -> str:
    """The IndexedDataset prefix of one key, e.g. data_packed_input_ids_document."""
    return f"{output_prefix}_packed_{key}_document"


# --- preflight: every config/input problem we can see stops here, before a byte is written ----------------
def load_tokenizer(path: str) -> Any:
    if not os.path.isdir(path):
        raise ConfigError(
            f"tokenizer_name_or_path: tokenizer directory not found: {path} "
            "(give the local HF model directory holding tokenizer.json / tokenizer_config.json)"
        )
    from mindrl.data.tokenizer import load_tokenizer as load_named  # AutoTokenizer's class, without its model imports

    try:
        tokenizer = load_named(path)
    except Exception as e:  # transformers raises OSError/ValueError/... depending on what is missing
        raise ConfigError(f"tokenizer_name_or_path: cannot load a tokenizer from {path}: {e}") from None
    # Without its vocabulary files, transformers still builds a tokenizer from config.json alone: one that
    # knows only the special tokens and turns every text into nothing.
    if len(tokenizer.get_vocab()) <= len(set(tokenizer.all_special_tokens)):
        raise ConfigError(
            f"tokenizer_name_or_path: {path} has no tokenizer vocabulary (only {len(tokenizer.get_vocab())} special "
            f"token(s); files there: {sorted(os.listdir(path))[:8]}); give the directory holding tokenizer.json"
        )
    return tokenizer


def build_handler(cfg: PreprocessConfig, tokenizer: Any) -> Handler:
    try:
        handler_cls = get_handler_class(cfg.handler_name)
        template = get_template(cfg.prompt_type, cfg.templates_path or None)
        return handler_cls(tokenizer, template, cfg.map_keys, cfg.dataset_additional_keys)
    except (ValueError, FileNotFoundError) as e:  # UnknownTemplateError is a ValueError
        raise ConfigError(str(e)) from None


def check_output_dir(output_prefix: str) -> str:
    """The output directory, if it exists and is writable or can be created; raises ConfigError otherwise."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    probe = out_dir
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if os.path.isdir(probe) else "is not a directory"
        raise ConfigError(f"output_prefix '{output_prefix}': cannot write into {out_dir} ({probe} {what})")
    return out_dir


# --- workers ------------------------------------------------------------------------------------------
_WORKER_HANDLER: Handler | None = None


def _worker_init(cfg: PreprocessConfig) -> None:
    global _WORKER_HANDLER
    # Processes, not Rust threads, give the parallelism here; nested thread pools would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_HANDLER = build_handler(cfg, load_tokenizer(cfg.tokenizer_name_or_path))


def _worker_encode(rows: list[Any]) -> EncodedChunk:
    assert _WORKER_HANDLER is not None
    return _WORKER_HANDLER.encode_chunk(rows)


def _chunks(rows: Iterator[RawRow], size: int) -> Iterator[list[RawRow]]:
    while True:
        chunk = list(itertools.islice(rows, size))
        if not chunk:
            return
        yield chunk


def _start_pool(cfg: PreprocessConfig) -> Any:
    if cfg.workers == 1:
        return None
    # fork: workers start in milliseconds; the pool starts before megatron-core is imported, so they do not
    # inherit it. spawn where fork does not exist.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    return ctx.Pool(cfg.workers, initializer=_worker_init, initargs=(cfg,))


def _encoded_in_order(
    cfg: PreprocessConfig, handler: Handler, pool: Any, chunks: Iterator[list[RawRow]]
) -> Iterator[tuple[list[RawRow], EncodedChunk]]:
    """(chunk, its encoding) in input order. With a pool, at most 2*workers chunks are in flight:
    Pool.imap would read the whole input ahead into its task queue, so memory would follow the file size."""
    if pool is None:
        for chunk in chunks:
            yield chunk, handler.encode_chunk([r.row for r in chunk])
        return
    pending: deque[tuple[list[RawRow], Any]] = deque()
    for chunk in chunks:
        pending.append((chunk, pool.apply_async(_worker_encode, ([r.row for r in chunk],))))
        if len(pending) >= 2 * cfg.workers:
            done, res = pending.popleft()
            yield done, res.get()
    while pending:
        done, res = pending.popleft()
        yield done, res.get()


# --- the run -------------------------------------------------------------------------------------------
def preprocess(cfg: PreprocessConfig, log: TextIO = sys.stderr) -> PreprocessReport:
    """Run the whole pipeline. Output files appear only when the run succeeds (written under temporary
    names, renamed at the end), so a failure never leaves a half-written or stale-mixed dataset."""
    cfg.validate()
    start = time.perf_counter()
    handler = build_handler(cfg, load_tokenizer(cfg.tokenizer_name_or_path))
    files = discover_inputs(cfg.input)
    rows = iter_rows(files)
    first = next(rows, None)  # also surfaces a broken first row before anything is written
    if first is None:
        raise InputError(f"input has no rows: {cfg.input}")
    out_dir = check_output_dir(cfg.output_prefix)
    os.makedirs(out_dir, exist_ok=True)

    keys = output_keys(cfg)
    report = PreprocessReport(cfg.input, cfg.output_prefix, cfg.handler_name, cfg.prompt_type, cfg.workers)
    finals = {k: dataset_prefix(cfg.output_prefix, k) for k in keys}
    tmp_tag = f".tmp{os.getpid()}"
    pool = _start_pool(cfg)
    encoded = _encoded_in_order(cfg, handler, pool, _chunks(itertools.chain([first], rows), cfg.chunk_rows))
    reasons: Counter[str] = Counter()
    builders: dict[str, Any] = {}
    try:
        from mindrl.data.indexed import IndexedWriter

        builders = {k: IndexedWriter(finals[k] + ".bin" + tmp_tag, dtype=handler.dtype_of(k)) for k in keys}
        next_log = cfg.log_interval
        # Rates count from here: tokenizer loading and imports are setup, reported apart in the summary.
        rows_start = time.perf_counter()
        report.setup_seconds = rows_start - start
        for chunk, enc in encoded:
            for i, reason in enc.bad:
                raw = chunk[i]
                skipped = SkippedRow(report.rows_read + i, files[raw.file_index].path, raw.position, reason)
                if cfg.strict:
                    raise BadRowError(
                        f"bad row {skipped.row} ({skipped.file}, {'row' if _is_parquet(files, raw) else 'line'} "
                        f"{skipped.line}): {reason} (strict=true; set strict=false to skip and report such rows)"
                    )
                reasons[reason] += 1
                if len(report.first_skipped) < MAX_REPORTED_ROWS:
                    report.first_skipped.append(skipped)
            if cfg.seq_length is not None:
                enc, too_long = _drop_long(enc, keys, cfg.seq_length)
                report.rows_too_long += too_long
            for key in keys:
                flat, lengths = enc.flat[key], enc.lengths[key]
                offsets = itertools.accumulate(lengths, initial=0)
                for off, n in zip(offsets, lengths):
                    builders[key].add_document(flat[off : off + n], [int(n)])
            report.rows_read += len(chunk)
            report.rows_written += len(enc.good)
            report.rows_skipped += len(enc.bad)
            if report.rows_read >= next_log:
                next_log = (report.rows_read // cfg.log_interval + 1) * cfg.log_interval
                rate = report.rows_read / max(time.perf_counter() - rows_start, 1e-9)
                print(
                    f"[mindrl-preprocess] {report.rows_read} rows read, {report.rows_written} written, "
                    f"{report.rows_skipped} skipped, {rate:.0f} rows/s",
                    file=log,
                    flush=True,
                )
        if report.rows_written == 0:
            too_long = (
                f"; {report.rows_too_long} had seq_length={cfg.seq_length} tokens or more" if cfg.seq_length else ""
            )
            raise InputError(
                f"no usable rows in {cfg.input}: all {report.rows_read} were skipped; reasons: {dict(reasons)}"
                + too_long
            )
        for key in keys:
            builders[key].finalize(finals[key] + ".idx" + tmp_tag)
        for key in keys:
            for ext in (".bin", ".idx"):
                os.replace(finals[key] + ext + tmp_tag, finals[key] + ext)
                report.output_files.append(finals[key] + ext)
    finally:
        encoded.close()
        if pool is not None:
            pool.terminate()  # results are all collected (or we are failing): nothing left to wait for
            pool.join()
        for key in builders:
            builders[key].data_file.close()
            for ext in (".bin", ".idx"):
                if os.path.exists(finals[key] + ext + tmp_tag):
                    os.remove(finals[key] + ext + tmp_tag)

    report.skipped_by_reason = dict(reasons.most_common())
    report.seconds = time.perf_counter() - start
    report.rows_per_s = report.rows_read / max(report.seconds - report.setup_seconds, 1e-9)
    with open(f"{cfg.output_prefix}_report.json", "w", encoding="utf-8") as f:
        json.dump(asdict(report), f, indent=2, ensure_ascii=False)
    print(summary(report), file=log, flush=True)
    return report


def _drop_long(enc: EncodedChunk, keys: list[str], seq_length: int) -> tuple[EncodedChunk, int]:
    """`enc` without its rows that have a document of seq_length tokens or more (MindSpeed-RL drops them when it
    preprocesses), and how many rows those were."""
    long = np.zeros(len(enc.good), dtype=bool)
    for key in keys:
        long |= np.asarray(enc.lengths[key]) >= seq_length
    if not long.any():
        return enc, 0
    flat, lengths = {}, {}
    for key in keys:
        n = np.asarray(enc.lengths[key])
        starts = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
        parts = [enc.flat[key][a : a + b] for a, b, drop in zip(starts, n, long) if not drop]
        flat[key] = np.concatenate(parts) if parts else enc.flat[key][:0]
        lengths[key] = n[~long]
    good = [g for g, drop in zip(enc.good, long) if not drop]
    return EncodedChunk(flat, lengths, good, enc.bad), int(long.sum())


def _is_parquet(files: list[InputFile], raw: RawRow) -> bool:
    return files[raw.file_index].kind == "parquet"


def summary(report: PreprocessReport) -> str:
    lines = [
        f"[mindrl-preprocess] done: {report.rows_read} rows read, {report.rows_written} written, "
        f"{report.rows_skipped} skipped in {report.seconds:.1f}s ({report.setup_seconds:.1f}s setup, "
        f"then {report.rows_per_s:.0f} rows/s)"
    ]
    if report.rows_too_long:
        lines.append(f"  dropped {report.rows_too_long}: a document of seq_length tokens or more")
    for reason, n in report.skipped_by_reason.items():
        lines.append(f"  skipped {n}: {reason}")
    for s in report.first_skipped[:5]:
        lines.append(f"  e.g. row {s.row} ({s.file}:{s.line}): {s.reason}")
    if report.rows_skipped:
        lines.append(f"  full list of the first {MAX_REPORTED_ROWS}: {report.output_prefix}_report.json")
    return "\n".join(lines)
