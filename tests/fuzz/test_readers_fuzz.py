"""Property-based fuzzing of the file readers: random bytes, truncated and byte-mutated copies of valid
files either read (a mutation can leave a valid file) or fail with the reader's own error naming the
file, never a traceback from inside json / yaml / pyarrow / safetensors / struct / numpy."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mindrl.checkpoint.hf_io import INDEX_FILE, SINGLE_FILE, CheckpointError, HFCheckpoint
from mindrl.checkpoint.mcore_ckpt import MODEL_META, TRACKER, read_model_meta, read_tracker
from mindrl.data.preprocess import dataset_prefix
from mindrl.data.preprocess_config import ConfigError, load_preprocess_config
from mindrl.data.readers import InputError, discover_inputs, iter_rows

BOUNDED = dict(derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
EXAMPLES = 60


# nesting past Python's recursion limit: json and yaml raise RecursionError
DEEP = st.builds(
    lambda piece, n: piece * n, st.sampled_from([b"[", b'{"a":', b"- ", b"{", b"a: {"]), st.integers(1, 1200)
)


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, a truncated copy, or a copy with a few bytes overwritten / inserted / deleted."""

    def flip(edits: list[tuple[int, int, int]]) -> bytes:
        data = bytearray(valid)
        for kind, at, value in edits:
            at %= max(len(data), 1)
            if kind == 0 and data:
                data[at] = value
            elif kind == 1:
                data.insert(at, value)
            elif data:
                del data[at]
        return bytes(data)

    edit = st.tuples(st.integers(0, 2), st.integers(0, 2**31), st.integers(0, 255))
    return st.one_of(
        st.binary(max_size=512),
        DEEP,
        st.integers(0, max(len(valid) - 1, 0)).map(lambda n: valid[:n]),
        st.lists(edit, min_size=1, max_size=6).map(flip),
    )


def _clear_error_or_success(fn: Callable[[], object], error: type[Exception], names: list[str]) -> None:
    """fn() succeeds, or raises `error` whose message names one of `names` (file or directory)."""
    try:
        fn()
    except error as e:
        assert any(n in str(e) for n in names), f"{type(e).__name__} does not name {names}: {e}"


# ------------------------------------------------------------------------------------------ raw datasets
ROWS = [{"problem": "1+1", "answer": "2", "n": 1}, {"problem": "é \u2028 ünï", "answer": ["x", None], "n": 2.5}]
JSON_LIST = json.dumps(ROWS, ensure_ascii=False, indent=1).encode()
JSONL = b"\n".join(json.dumps(r, ensure_ascii=False).encode() for r in ROWS) + b"\n"


def _parquet_bytes() -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.parquet")
        pq.write_table(pa.table({"problem": ["1+1", "2+2"] * 20, "answer": ["2", "4"] * 20}), path)
        with open(path, "rb") as f:
            return f.read()


PARQUET = _parquet_bytes()


def _read_rows(path: str) -> list:
    return [r.row for r in iter_rows(discover_inputs(path))]


@pytest.mark.parametrize(
    "ext, valid", [(".json", JSON_LIST), (".jsonl", JSONL), (".json", JSONL), (".parquet", PARQUET)]
)
def test_dataset_readers_on_broken_files(ext, valid):
    @settings(max_examples=EXAMPLES, deadline=None, **BOUNDED)
    @given(mutations(valid))
    def check(data):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "data" + ext)
            with open(path, "wb") as f:
                f.write(data)
            _clear_error_or_success(lambda: _read_rows(path), InputError, [path])

    check()


# ------------------------------------------------------------------------------------------- HF checkpoints
def _hf_files() -> dict[str, bytes]:
    """A two-shard safetensors checkpoint: name -> bytes."""
    from safetensors.torch import save

    a = {"model.embed_tokens.weight": torch.arange(12.0).view(3, 4), "model.norm.weight": torch.ones(4)}
    b = {"lm_head.weight": torch.arange(12.0).view(3, 4) / 7}
    files = {"model-00001-of-00002.safetensors": save(a), "model-00002-of-00002.safetensors": save(b)}
    weight_map = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    files[INDEX_FILE] = json.dumps({"metadata": {"total_size": 112}, "weight_map": weight_map}, indent=2).encode()
    return files


HF_FILES = _hf_files()


def _load_hf(path: str) -> None:
    ckpt = HFCheckpoint(path)
    for name in ckpt.keys():
        ckpt.shape(name)
        ckpt.get(name)
    ckpt.close()


@pytest.mark.parametrize("target", sorted(HF_FILES) + [SINGLE_FILE])
def test_hf_checkpoint_on_broken_files(target):
    files = dict(HF_FILES)
    if target == SINGLE_FILE:  # a single-file checkpoint: no index
        from safetensors.torch import save

        files = {SINGLE_FILE: save({"model.norm.weight": torch.ones(4), "lm_head.weight": torch.zeros(2, 4)})}

    @settings(max_examples=EXAMPLES, deadline=None, **BOUNDED)
    @given(mutations(files[target]))
    def check(data):
        with tempfile.TemporaryDirectory() as d:
            for name, content in files.items():
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data if name == target else content)
            _clear_error_or_success(lambda: _load_hf(d), CheckpointError, [target])

    check()


# ------------------------------------------------------------------------------------- megatron tracker/meta
SPEC = {
    "architecture": "Qwen2ForCausalLM", "family": "qwen2", "is_value_model": False, "vocab_size": 32,
    "hidden_size": 8, "ffn_hidden_size": 16, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4,
    "max_position_embeddings": 64, "rope_theta": 10000.0, "norm_eps": 1e-6, "tie_word_embeddings": False,
    "qkv_bias": True, "dtype": "float32", "rope_scaling_factor": None, "hf_config": {},
}  # fmt: skip
META = json.dumps({"format_version": 1, "role": "actor", "tp": 1, "pp": 1, "dtype": "float32", "spec": SPEC}).encode()


@settings(max_examples=EXAMPLES, deadline=None, **BOUNDED)
@given(st.one_of(mutations(b"release"), mutations(b"120\n"), st.text(max_size=20).map(str.encode)))
def test_megatron_tracker_on_broken_files(data):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, TRACKER), "wb") as f:
            f.write(data)
        try:
            it = read_tracker(d)
        except CheckpointError as e:
            assert TRACKER in str(e), e
        else:
            assert it == "release" or (isinstance(it, int) and it >= 0), it


@settings(max_examples=EXAMPLES, deadline=None, **BOUNDED)
@given(mutations(META))
def test_megatron_model_meta_on_broken_files(data):
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "release"))
        with open(os.path.join(d, TRACKER), "w") as f:
            f.write("release")
        with open(os.path.join(d, "release", MODEL_META), "wb") as f:
            f.write(data)
        _clear_error_or_success(lambda: read_model_meta(d), CheckpointError, [MODEL_META])


# ------------------------------------------------------------------------------------- preprocess config
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5))
CONFIG_YAML = b"""input: data/train.jsonl
tokenizer_name_or_path: model/
output_prefix: out/data
handler_name: R1AlpacaStyleInstructionHandler
workers: 2
map_keys:
  prompt: problem
  response: answer
dataset_additional_keys: [labels]
seq_length: 1024
"""


@settings(max_examples=EXAMPLES * 2, deadline=None, **BOUNDED)
@given(
    st.one_of(
        mutations(CONFIG_YAML),
        st.text(max_size=200).map(str.encode),
        # well-formed YAML of the wrong shape: keys and values of any scalar type, nested maps and lists
        st.dictionaries(
            st.one_of(st.sampled_from(["input", "workers", "map_keys", "strict"]), st.text(max_size=5), SCALARS),
            st.recursive(
                SCALARS,
                lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SCALARS, inner, max_size=3),
                max_leaves=6,
            ),
            max_size=5,
        ).map(lambda d: yaml.safe_dump(d).encode()),
    )
)
def test_preprocess_config_on_broken_files(data):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.yaml")
        with open(path, "wb") as f:
            f.write(data)
        _clear_error_or_success(lambda: load_preprocess_config(path), ConfigError, [path])


# ------------------------------------------------------------------------------------- packed (indexed) data
def _indexed_files() -> dict[str, bytes]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    with tempfile.TemporaryDirectory() as d:
        prefix = dataset_prefix(os.path.join(d, "data"), "input_ids")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
        for doc in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
            builder.add_document(np.array(doc, dtype=np.int32), [len(doc)])
        builder.finalize(prefix + ".idx")
        out = {}
        for ext in (".bin", ".idx"):
            with open(prefix + ext, "rb") as f:
                out[ext] = f.read()
        return out


INDEXED = _indexed_files()


def _read_prompts(prefix: str) -> None:
    from mindrl.data.prompt_dataset import PromptDataset

    ds = PromptDataset(prefix, extra_keys=())
    for i in range(len(ds)):
        ds[i]


# megatron's IndexedDataset.__del__ fails on an object whose __init__ raised: its noise, not our error.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("target", [".idx", ".bin"])
def test_packed_dataset_on_broken_files(target):
    @settings(max_examples=EXAMPLES, deadline=None, **BOUNDED)
    @given(mutations(INDEXED[target]))
    def check(data):
        with tempfile.TemporaryDirectory() as d:
            prefix = os.path.join(d, "data")
            for ext, content in INDEXED.items():
                with open(dataset_prefix(prefix, "input_ids") + ext, "wb") as f:
                    f.write(data if ext == target else content)
            _clear_error_or_success(lambda: _read_prompts(prefix), ValueError, ["input_ids_document" + target])

    check()
