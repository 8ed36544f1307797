"""Preprocessing end to end: readers, indexed-dataset output, workers identity, the report, every stop-early error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from mindrl.data.preprocess import BadRowError, dataset_prefix, preprocess
from mindrl.data.preprocess_config import ConfigError, PreprocessConfig, load_preprocess_config
from mindrl.data.readers import InputError, _iter_json_list, discover_inputs, iter_rows
from tests.data.conftest import deepscaler_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {"prompt": "problem", "query": "", "response": "answer", "system": ""}
SUFFIXES = [f"_packed_{k}_document.{e}" for k in ("input_ids", "attention_mask", "labels") for e in ("bin", "idx")]


def _cfg(inp, tok_dir, prefix, **kw) -> PreprocessConfig:
    base = dict(
        input=str(inp),
        tokenizer_name_or_path=tok_dir,
        output_prefix=str(prefix),
        handler_name="R1AlpacaStyleInstructionHandler",
        prompt_type="qwen_r1",
        map_keys=dict(KEYS),
        dataset_additional_keys=["labels"],
        log_interval=100,
    )
    base.update(kw)
    return PreprocessConfig(**base)


def _run(cfg) -> object:
    import io

    log = io.StringIO()
    return preprocess(cfg, log=log), log.getvalue()


# --- readers -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_json_list_streams_like_json_load(tmp_path, chunk):
    rows = deepscaler_rows(40) + [{"nested": {"a": [1, "]"]}, "s": "a, b ] [ {"}, 3, "x"]
    p = tmp_path / "l.json"
    p.write_text(json.dumps(rows, indent=2))
    got = list(_iter_json_list(str(p), chunk_chars=chunk))
    assert [r for _, r in got] == rows
    lines = p.read_text().split("\n")
    assert all(lines[ln - 1].strip() in ("{", "3,", '"x"') for ln, _ in got)  # line numbers point at the row


def test_jsonl_parquet_and_directory_read_in_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = deepscaler_rows(30)
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:10]) + "\n\n")
    (d / "b.json").write_text(json.dumps(rows[10:20]))
    keys = sorted({k for r in rows for k in r})
    table = pa.table({k: [r.get(k) for r in rows[20:]] for k in keys})
    pq.write_table(table, d / "c.parquet", row_group_size=3)
    (d / "notes.txt").write_text("ignored")
    got = list(iter_rows(discover_inputs(str(d))))
    assert [{k: v for k, v in r.row.items() if v is not None} for r in got] == rows
    assert [(r.file_index, r.position) for r in got[9:12]] == [(0, 10), (1, 1), (1, 1)]
    assert got[-1].position == 10  # parquet: 1-based row within the file


def test_bad_json_names_file_and_line(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('[\n {"problem": "a", "answer": "1"},\n {"problem": "b", "answer": }\n]')
    with pytest.raises(InputError, match=r"bad\.json, line 3, column \d+: invalid JSON"):
        list(iter_rows(discover_inputs(str(p))))
    q = tmp_path / "bad.jsonl"
    q.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": "2"}\n{"problem": oops}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl, line 3, column 13: invalid JSON"):
        list(iter_rows(discover_inputs(str(q))))
    r = tmp_path / "trunc.json"
    r.write_text('[{"problem": "a", "answer": "1"},\n{"problem": "b"')
    with pytest.raises(InputError, match=r"trunc\.json, line 2"):
        list(iter_rows(discover_inputs(str(r))))


# --- output ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def packed(deepscaler_json, tok_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed")
    report, log = _run(_cfg(deepscaler_json, tok_dir, out / "w1", workers=1, chunk_rows=64))
    return out, report, log


def test_output_reads_back_with_megatron_indexed_dataset(packed, deepscaler_json, tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from mindrl.data.templates import get_template

    out, report, _ = packed
    ids = IndexedDataset(str(out / "w1_packed_input_ids_document"))
    labels = IndexedDataset(dataset_prefix(str(out / "w1"), "labels"))
    mask = IndexedDataset(dataset_prefix(str(out / "w1"), "attention_mask"))
    rows = json.load(open(deepscaler_json))
    good = [r for i, r in enumerate(rows) if i not in (5, 7, 9, 11)]
    assert len(ids) == len(labels) == len(mask) == len(good) == report.rows_written == 596
    for j in (0, 7, 595):
        assert tokenizer.decode(ids[j].tolist()) == get_template("qwen_r1").render_prompt(good[j]["problem"])
        assert tokenizer.decode(labels[j].tolist()) == good[j]["answer"]
        assert (mask[j] == 1).all() and len(mask[j]) == len(ids[j])


def test_report_counts_and_locates_skipped_rows(packed):
    out, report, log = packed
    assert (report.rows_read, report.rows_written, report.rows_skipped) == (600, 596, 4)
    saved = json.load(open(out / "w1_report.json"))
    assert saved["rows_skipped"] == 4
    assert [(s["row"], s["reason"]) for s in saved["first_skipped"]] == [
        (5, "null value for key 'answer' (response)"),
        (7, "missing key 'problem' (prompt)"),
        (9, "empty prompt (key 'problem')"),
        (11, "non-string value for key 'answer' (response): int"),
    ]
    assert saved["first_skipped"][0]["file"].endswith("deepscaler.json") and saved["first_skipped"][0]["line"] > 1
    assert "4 skipped" in log and "rows/s" in log and "row 7" in log
    assert re.search(r"\] 128 rows read, 124 written, 4 skipped, \d+ rows/s", log)  # progress every log_interval


def test_two_workers_are_byte_identical_to_one(packed, deepscaler_json, tok_dir):
    out, _, _ = packed
    _run(_cfg(deepscaler_json, tok_dir, out / "w2", workers=2, chunk_rows=16))
    for s in SUFFIXES:
        assert (out / f"w1{s}").read_bytes() == (out / f"w2{s}").read_bytes(), s


def test_strict_fails_on_first_bad_row_and_writes_nothing(deepscaler_json, tok_dir, tmp_path):
    with pytest.raises(BadRowError, match=r"bad row 5 \(.*deepscaler\.json, line \d+\): null value for key 'answer'"):
        _run(_cfg(deepscaler_json, tok_dir, tmp_path / "s", strict=True))
    assert os.listdir(tmp_path) == []


# --- errors that stop before anything is written ------------------------------------------------------------
def _stops(cfg, exc, pattern, tmp_path):
    with pytest.raises(exc, match=pattern):
        _run(cfg)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o")], "nothing may be written"


def test_empty_input(tok_dir, tmp_path):
    for name, text in [("e.json", ""), ("l.json", " [ ] "), ("e.jsonl", "\n\n")]:
        (tmp_path / name).write_text(text)
        _stops(_cfg(tmp_path / name, tok_dir, tmp_path / "o"), InputError, "input has no rows", tmp_path)
    (tmp_path / "dir").mkdir()
    _stops(_cfg(tmp_path / "dir", tok_dir, tmp_path / "o"), InputError, "has no .json/.jsonl/.parquet files", tmp_path)


def test_all_rows_bad_writes_nothing(tok_dir, tmp_path):
    (tmp_path / "b.jsonl").write_text('{"problem": null, "answer": "1"}\n')
    _stops(_cfg(tmp_path / "b.jsonl", tok_dir, tmp_path / "o"), InputError, "no usable rows", tmp_path)


def test_unreadable_json_midway_leaves_no_files(tok_dir, tmp_path):
    lines = [json.dumps(r) for r in deepscaler_rows(300)]
    lines[250] = '{"problem": "x", "answer": '
    (tmp_path / "m.jsonl").write_text("\n".join(lines))
    _stops(_cfg(tmp_path / "m.jsonl", tok_dir, tmp_path / "o", chunk_rows=8), InputError, "line 251", tmp_path)


def test_unknown_prompt_type_handler_and_tokenizer(deepscaler_json, tok_dir, tmp_path):
    _stops(
        _cfg(deepscaler_json, tok_dir, tmp_path / "o", prompt_type="qwen-r1"),
        ConfigError,
        r"unknown prompt_type 'qwen-r1'.*Did you mean 'qwen_r1'.*Known: .*llama3",
        tmp_path,
    )
    _stops(
        _cfg(deepscaler_json, tok_dir, tmp_path / "o", handler_name="R1AlpacaStyle"),
        ConfigError,
        r"unknown handler_name 'R1AlpacaStyle'.*Known: AlpacaStyleInstructionHandler",
        tmp_path,
    )
    _stops(
        _cfg(deepscaler_json, str(tmp_path / "no_model"), tmp_path / "o"),
        ConfigError,
        r"tokenizer_name_or_path: tokenizer directory not found: .*no_model",
        tmp_path,
    )


def test_unwritable_output_directory(deepscaler_json, tok_dir, tmp_path):
    (tmp_path / "afile").write_text("")
    _stops(
        _cfg(deepscaler_json, tok_dir, tmp_path / "afile" / "sub" / "o"),
        ConfigError,
        r"output_prefix .*cannot write into .*afile.* is not a directory",
        tmp_path,
    )
    if os.geteuid() != 0:  # root may write anywhere, so the permission case only means something for users
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        _stops(_cfg(deepscaler_json, tok_dir, ro / "o"), ConfigError, "is not writable", tmp_path)


# --- config and command line ---------------------------------------------------------------------------------
def test_shipped_deepscaler_yaml_has_the_mindspeed_keys():
    cfg, ignored = load_preprocess_config(os.path.join(REPO, "configs/datasets/deepscaler.yaml"))
    assert ignored == []
    assert (cfg.input, cfg.tokenizer_name_or_path, cfg.output_prefix) == (
        "./dataset/deepscaler.json",
        "./model_from_hf/qwen25-7b",
        "./dataset/data",
    )
    assert (cfg.handler_name, cfg.tokenizer_type, cfg.workers, cfg.log_interval, cfg.prompt_type) == (
        "R1AlpacaStyleInstructionHandler",
        "HuggingFaceTokenizer",
        8,
        1000,
        "qwen_r1",
    )
    assert cfg.map_keys == KEYS and cfg.dataset_additional_keys == ["labels"]


def test_overrides_are_typed_and_unknown_keys_named(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("input: a.json\ntokenizer_name_or_path: t\noutput_prefix: o\nseq_length: 1024\nn_subs: 4\n")
    cfg, ignored = load_preprocess_config(str(y), ["workers=2", "strict=true", "map_keys={prompt: q}"])
    assert (cfg.workers, cfg.strict, cfg.map_keys, cfg.seq_length) == (2, True, {"prompt": "q"}, 1024)
    assert ignored == [f"n_subs ({y})"]
    with pytest.raises(ConfigError, match=r"override 'worker=2': unknown key 'worker' \(did you mean 'workers'"):
        load_preprocess_config(str(y), ["worker=2"])
    y.write_text("input: a.json\ntokenizer_name_or_path: t\noutput_prefix: o\nhandler: X\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'handler' \(did you mean 'handler_name'"):
        load_preprocess_config(str(y))
    with pytest.raises(ConfigError, match=r"map_keys has unknown role 'promt' \(did you mean 'prompt'"):
        load_preprocess_config(None, ["input=a", "tokenizer_name_or_path=t", "output_prefix=o", "map_keys={promt: q}"])
    with pytest.raises(ConfigError, match="'workers' must be an integer >= 1"):
        load_preprocess_config(None, ["input=a", "tokenizer_name_or_path=t", "output_prefix=o", "workers=0"])


def test_cli_help():
    from mindrl.cli.preprocess import build_parser

    text = build_parser().format_help()
    assert "--config" in text and "dataset_additional_keys" in text and "strict" in text


def test_shell_script_done_when_command(deepscaler_json, tok_dir, tmp_path):
    """The issue's acceptance command, as a user runs it: config name + overrides, then IndexedDataset reads it."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    cmd = [
        "bash",
        os.path.join(REPO, "examples/data/preprocess_data.sh"),
        "deepscaler",
        f"input={deepscaler_json}",
        f"tokenizer_name_or_path={tok_dir}",
        f"output_prefix={tmp_path}/data",
        "workers=2",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "596 written, 4 skipped" in proc.stderr
    assert len(IndexedDataset(f"{tmp_path}/data_packed_input_ids_document")) == 596
    bad = subprocess.run(
        cmd[:3] + [f"input={tmp_path}/missing.json"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr


def test_gsm8k_parquet_directory_with_shipped_config(tok_dir, tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    d = tmp_path / "gsm8k"
    d.mkdir()
    qs = [f"Tom has {i} apples and buys {i * 3}. How many?" for i in range(1, 41)]
    answers = [f"He has {i} + {i * 3} = <<{i}+{i * 3}={4 * i}>>{4 * i}.\n#### {4 * i * 100:,}" for i in range(1, 41)]
    answers[3] = "no final answer"
    pq.write_table(pa.table({"question": qs[:20], "answer": answers[:20]}), d / "train-0.parquet", row_group_size=7)
    pq.write_table(pa.table({"question": qs[20:], "answer": answers[20:]}), d / "train-1.parquet")
    cfg, _ = load_preprocess_config(
        os.path.join(REPO, "configs/datasets/gsm8k.yaml"),
        [f"input={d}", f"tokenizer_name_or_path={tok_dir}", f"output_prefix={tmp_path}/g", "workers=1"],
    )
    report, _ = _run(cfg)
    assert (report.rows_written, report.first_skipped[0].row, report.first_skipped[0].line) == (39, 3, 4)
    labels = IndexedDataset(f"{tmp_path}/g_packed_labels_document")
    assert [tokenizer.decode(labels[j].tolist()) for j in (0, 3, 38)] == ["400", "2000", "16000"]


def test_pretty_printed_single_object_gets_a_hint(tmp_path):
    p = tmp_path / "obj.json"
    p.write_text('{\n  "problem": "a"\n}\n')
    with pytest.raises(InputError, match="expected a JSON list, or one JSON object per line"):
        list(iter_rows(discover_inputs(str(p))))


def test_seq_length_drops_long_rows_as_mindspeed_does(packed, deepscaler_json, tok_dir, tmp_path):
    """A row with a document of seq_length tokens or more is dropped and counted; the others are written unchanged."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out, full, _ = packed
    ids = IndexedDataset(str(out / "w1_packed_input_ids_document"))
    labels = IndexedDataset(dataset_prefix(str(out / "w1"), "labels"))
    cut = int(sorted(len(x) for x in ids)[len(ids) // 2])  # about half the prompts reach it
    keep = [j for j in range(len(ids)) if len(ids[j]) < cut and len(labels[j]) < cut]
    report, log = _run(_cfg(deepscaler_json, tok_dir, tmp_path / "cut", seq_length=cut))
    assert 0 < report.rows_too_long == full.rows_written - len(keep) and report.rows_written == len(keep)
    assert report.rows_skipped == full.rows_skipped and f"dropped {report.rows_too_long}" in log
    short = IndexedDataset(str(tmp_path / "cut_packed_input_ids_document"))
    assert [short[i].tolist() for i in range(len(short))] == [ids[j].tolist() for j in keep]


def test_mindspeed_keys_accepted_with_mindrls_value_only(tmp_path):
    base = ["input=a", "tokenizer_name_or_path=t", "output_prefix=o"]
    _, ignored = load_preprocess_config(None, [*base, "pack=false", "split_sentences=false", "append_eod=true",
                                               "enable_thinking=true"])  # fmt: skip
    # the R1 handler reads neither append_eod nor enable_thinking, in MindSpeed-RL either
    assert [i.split(" ")[0] for i in ignored] == ["pack", "split_sentences", "append_eod", "enable_thinking"]
    refused = {
        "pack=true": "packing rows",
        "split_sentences=true": "one document per sentence",
        "handler_name=AlpacaStyleInstructionHandler append_eod=true": "end-of-document token",
        "handler_name=AlpacaStylePairwiseHandler enable_thinking=true": "empty thought",
    }
    for overrides, what in refused.items():
        key = overrides.split()[-1].split("=")[0]
        with pytest.raises(ConfigError, match=rf"override '{key}=true': {key}: True is not supported .*{what}.*false"):
            load_preprocess_config(None, [*base, *overrides.split()])
