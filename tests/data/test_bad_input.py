"""Bad data, tokenizers, templates and preprocess configs: mindrl-preprocess exits 2 with a message naming the
file / line / key (never a traceback) and writes nothing; PromptDataset names the packed file at fault.

Cases already in test_preprocess.py / test_templates.py (a syntax error inside a row, truncated lists, empty
input, all rows bad, a missing tokenizer directory, unknown keys / roles / templates / handlers, templates
without {content} or with unknown fields) are not repeated here.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest

from mindrl.cli.preprocess import main as preprocess_cli
from mindrl.data.preprocess import preprocess
from mindrl.data.preprocess_config import PreprocessConfig
from mindrl.data.prompt_dataset import PromptDataset

ROWS = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(12)]
BASE_OVERRIDES = ["map_keys={prompt: problem, response: answer}", "dataset_additional_keys=[labels]"]


def _run_cli(capsys, tmp_path, tok_dir, *overrides: str, config: str | None = None, input_path=None) -> str:
    """mindrl-preprocess with input / tokenizer / output in tmp_path; asserts exit 2, no traceback and no
    output file, and returns stderr."""
    out = tmp_path / "out"
    argv = ([] if config is None else ["--config", config]) + [
        f"input={input_path if input_path is not None else tmp_path / 'rows.json'}",
        f"tokenizer_name_or_path={tok_dir}",
        f"output_prefix={out}/data",
        *BASE_OVERRIDES,
        *overrides,
    ]
    assert preprocess_cli(argv) == 2
    err = capsys.readouterr().err
    assert "mindrl-preprocess: error: " in err and "Traceback" not in err, err
    assert not out.exists() or os.listdir(out) == [], f"written: {os.listdir(out)}"
    return err


def _write(path, text: str | bytes) -> str:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------------------- raw input
ROW = '{"problem": "p", "answer": "1"}'
JSON_LIST_ERRORS = {
    "missing_comma": (f"[\n {ROW},\n {ROW}\n {ROW}\n]", "line 4: invalid JSON: expected ',' or ']' between rows"),
    "trailing_comma": (f"[\n {ROW},\n {ROW},\n]\n", "line 4: invalid JSON: trailing ',' before ']'"),
    "data_after_the_list": (f"[\n {ROW}\n]\n{ROW}\n", "line 4: invalid JSON: unexpected data after the closing ']'"),
    "second_list": (f"[{ROW}]\n[{ROW}]", "line 2: invalid JSON: unexpected data after the closing ']'"),
    "not_closed": (
        f"[\n {ROW},\n {ROW}\n",
        "line 4: invalid JSON: the list is not closed (missing ']') at end of file",
    ),
}


@pytest.mark.parametrize("case", list(JSON_LIST_ERRORS))
def test_json_list_syntax_errors_name_file_and_line(capsys, tmp_path, tok_dir, case):
    text, says = JSON_LIST_ERRORS[case]
    path = _write(tmp_path / "rows.json", text)
    err = _run_cli(capsys, tmp_path, tok_dir)
    assert f"{path}, {says}" in err, err


def test_unreadable_parquet(capsys, tmp_path, tok_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    garbage = _write(tmp_path / "garbage.parquet", b"PAR1 this is not parquet")
    err = _run_cli(capsys, tmp_path, tok_dir, input_path=garbage)
    assert f"{garbage}: not a readable parquet file" in err, err
    # A valid footer over a corrupted data page: pyarrow only fails while reading rows.
    good = tmp_path / "good.parquet"
    n = 3000
    table = pa.table({"problem": [f"question {i} " * 5 for i in range(n)], "answer": [str(i) for i in range(n)]})
    pq.write_table(table, good, row_group_size=n, compression="snappy")
    data = bytearray(good.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 2000] = b"\xab" * 2000
    corrupt = _write(tmp_path / "corrupt.parquet", bytes(data))
    err = _run_cli(capsys, tmp_path, tok_dir, input_path=corrupt)
    assert f"{corrupt}: parquet data after row 0 is corrupted" in err, err


def test_unsupported_extension(capsys, tmp_path, tok_dir):
    csv = _write(tmp_path / "rows.csv", "problem,answer\np,1\n")
    err = _run_cli(capsys, tmp_path, tok_dir, input_path=csv)
    assert f"unsupported input format '.csv' for {csv}; supported: .json, .jsonl, .parquet" in err, err


def test_non_utf8_input_names_the_file_and_line(capsys, tmp_path, tok_dir):
    lines = [json.dumps(r) for r in ROWS]
    lines[6] = '{"problem": "caf\xe9", "answer": "1"}'
    jsonl = _write(tmp_path / "rows.jsonl", "\n".join(lines).encode("latin-1"))
    err = _run_cli(capsys, tmp_path, tok_dir, input_path=jsonl)
    assert f"{jsonl}, line 7: not UTF-8 text" in err, err
    as_list = _write(tmp_path / "rows.json", ("[" + ",\n".join(lines) + "]").encode("latin-1"))
    err = _run_cli(capsys, tmp_path, tok_dir, input_path=as_list)
    assert f"{as_list}: not UTF-8 text" in err, err


# ---------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_folder_without_a_tokenizer(capsys, tmp_path, tok_dir):
    """A model directory copied without its tokenizer files: transformers would build a tokenizer that knows
    only the special tokens from config.json alone, and every prompt would become nothing."""
    _write(tmp_path / "rows.json", json.dumps(ROWS))
    for name, files in [("config_only", ["config.json"]), ("tokenizer_config_only", ["tokenizer_config.json"])]:
        folder = tmp_path / name
        folder.mkdir()
        for f in files:
            if f == "config.json":
                _write(folder / f, json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
            else:
                shutil.copy(os.path.join(tok_dir, f), folder / f)
        err = _run_cli(capsys, tmp_path, str(folder))
        assert f"tokenizer_name_or_path: {folder} has no tokenizer vocabulary" in err and files[0] in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _run_cli(capsys, tmp_path, str(empty))
    assert f"tokenizer_name_or_path: cannot load a tokenizer from {empty}" in err, err


# ---------------------------------------------------------------------------------------- templates
TEMPLATE_ERRORS = {
    "syntax": ('{"t": {"user": "{content}",}}', "not valid JSON at line 1, column 28"),
    "not_an_object": ('["t"]', "expected a JSON object mapping template names to templates"),
    "template_not_an_object": ('{"t": "{content}"}', "template 't' must be an object with at least a 'user' slot"),
    "slot_not_a_string": ('{"t": {"user": 5}}', "template 't' field 'user' must be a string, got 5"),
    "stop_words_not_a_list": (
        '{"t": {"user": "{content}", "stop_words": "</s>"}}',
        "template 't' field 'stop_words' must be a list of strings, got '</s>'",
    ),
}


@pytest.mark.parametrize("case", list(TEMPLATE_ERRORS))
def test_broken_templates_file(capsys, tmp_path, tok_dir, case):
    text, says = TEMPLATE_ERRORS[case]
    _write(tmp_path / "rows.json", json.dumps(ROWS))
    templates = _write(tmp_path / f"templates_{case}.json", text)
    err = _run_cli(capsys, tmp_path, tok_dir, f"templates_path={templates}", "prompt_type=t")
    assert f"{templates}: {says}" in err, err


def test_missing_templates_file(capsys, tmp_path, tok_dir):
    _write(tmp_path / "rows.json", json.dumps(ROWS))
    err = _run_cli(capsys, tmp_path, tok_dir, f"templates_path={tmp_path}/nope.json")
    assert f"templates file not found: {tmp_path}/nope.json" in err, err


# ---------------------------------------------------------------------------------------- config
def test_config_file_errors(capsys, tmp_path, tok_dir):
    _write(tmp_path / "rows.json", json.dumps(ROWS))
    cases = [
        (tmp_path / "missing.yaml", None, "config file not found: {path}"),
        (tmp_path / "invalid.yaml", "handler_name: [R1\nworkers: 2\n", "{path}: not valid YAML"),
        (tmp_path / "list.yaml", "- input: a.json\n- workers: 2\n", "{path}: expected a mapping of keys"),
        (tmp_path / "latin1.yaml", "prompt_type: caf\xe9\n".encode("latin-1"), "{path}: not UTF-8 text"),
    ]
    for path, text, says in cases:
        if text is not None:
            _write(path, text)
        err = _run_cli(capsys, tmp_path, tok_dir, config=str(path))
        assert says.format(path=path) in err, err


@pytest.mark.parametrize(
    "override, says",
    [
        ("workers", "override 'workers' is not key=value"),
        ("map_keys={prompt: [", "override 'map_keys={prompt: [': value is not valid YAML"),
        ("tokenizer_type=SentencePiece", "tokenizer_type 'SentencePiece' is not supported; use one of"),
        ("dataset_additional_keys=labels", "'dataset_additional_keys' must be a list of names, got 'labels'"),
        ("dataset_additional_keys=[labels, '']", "'dataset_additional_keys' must be a list of names"),
        ("dataset_additional_keys=[input_ids]", "dataset_additional_keys must not repeat 'input_ids'"),
        ("map_keys=[problem]", "'map_keys' must be a mapping like"),
        ("map_keys={prompt: 3}", "map_keys['prompt'] must be a field name (string), got 3"),
        ("strict=maybe", "'strict' must be true or false, got 'maybe'"),
        ("input=", "'input' is required (a path), got ''"),
    ],
)
def test_bad_overrides(capsys, tmp_path, tok_dir, override, says):
    _write(tmp_path / "rows.json", json.dumps(ROWS))
    err = _run_cli(capsys, tmp_path, tok_dir, override)
    assert says in err, err


# ---------------------------------------------------------------------------------------- packed datasets
@pytest.fixture(scope="module")
def packed_pair(tok_dir, tmp_path_factory) -> tuple[str, str]:
    """Two preprocess outputs of different lengths (12 and 5 rows)."""
    root = tmp_path_factory.mktemp("packed_pair")
    prefixes = []
    for name, rows in (("a", ROWS), ("b", ROWS[:5])):
        (root / f"{name}.json").write_text(json.dumps(rows))
        cfg = PreprocessConfig(
            input=str(root / f"{name}.json"),
            tokenizer_name_or_path=tok_dir,
            output_prefix=str(root / name),
            map_keys={"prompt": "problem", "response": "answer"},
            dataset_additional_keys=["labels"],
        )
        preprocess(cfg, log=io.StringIO())
        prefixes.append(str(root / name))
    return prefixes[0], prefixes[1]


def _copy_prefix(prefix: str, dst) -> str:
    for key in ("input_ids", "attention_mask", "labels"):
        for ext in (".bin", ".idx"):
            shutil.copy(f"{prefix}_packed_{key}_document{ext}", f"{dst}_packed_{key}_document{ext}")
    return str(dst)


def test_input_ids_and_labels_from_different_runs(packed_pair, tmp_path):
    a, b = packed_pair
    mixed = _copy_prefix(a, tmp_path / "mixed")
    for ext in (".bin", ".idx"):
        shutil.copy(f"{b}_packed_labels_document{ext}", f"{mixed}_packed_labels_document{ext}")
    with pytest.raises(ValueError) as e:
        PromptDataset(mixed)
    msg = str(e.value)
    assert f"{mixed}_packed_labels_document has 5 documents but input_ids has 12" in msg, msg
    assert "different preprocessing runs" in msg


# megatron's IndexedDataset.__del__ fails on an object whose __init__ raised: its noise, not our error.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_truncated_or_corrupted_packed_files(packed_pair, tmp_path):
    a, _ = packed_pair
    d = _copy_prefix(a, tmp_path / "trunc")
    idx = f"{d}_packed_input_ids_document.idx"
    os.truncate(idx, os.path.getsize(idx) - 20)
    with pytest.raises(ValueError, match=f"{idx} is truncated or corrupted"):
        PromptDataset(d)
    d = _copy_prefix(a, tmp_path / "garbage")
    _write(tmp_path / "garbage_packed_labels_document.idx", b"not an index at all")
    with pytest.raises(ValueError, match=f"{d}_packed_labels_document.idx is truncated or corrupted"):
        PromptDataset(d)
    d = _copy_prefix(a, tmp_path / "short_bin")
    binf = f"{d}_packed_labels_document.bin"
    os.truncate(binf, os.path.getsize(binf) // 2)
    with pytest.raises(ValueError, match=f"{binf} is truncated: .* bytes, its .idx needs"):
        PromptDataset(d)
