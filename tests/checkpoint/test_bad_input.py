"""Bad checkpoints and bad conversion requests: each fails with CheckpointError (or the CLI's exit 2) naming
the file or key at fault, before any output is written, and a failed conversion leaves no partial output.

Cases already in test_convert.py (missing directories, truncated single-file HF shards, missing / unexpected /
misshapen tensors, NaN weights, layouts that do not divide, hf2mcore into a non-empty directory) are not
repeated here.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from mindrl.checkpoint import convert, loading, mcore_ckpt
from mindrl.checkpoint.hf_io import INDEX_FILE, CheckpointError, HFCheckpoint
from mindrl.cli.convert import main as convert_cli
from mindrl.models.hf_config import ModelSpec


@pytest.fixture(scope="module")
def rank_pool():
    """One local rank for the few conversions that must really run (its own, closed with the module)."""
    from mindrl.launch import RankPool

    with RankPool(1, timeout_s=300) as pool:
        yield pool


@pytest.fixture(scope="module")
def mcore_untied(tiny_models, rank_pool, tmp_path_factory) -> str:
    """The untied tiny model converted once at TP1 PP1; tests break copies of it."""
    out = str(tmp_path_factory.mktemp("bad_input") / "mcore")
    convert.hf2mcore(tiny_models["untied"], out, pool=rank_pool)
    return out


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _nothing_written(path) -> None:
    path = str(path)
    assert not os.path.exists(path), f"{path} was written"
    assert not os.path.exists(path + ".partial"), f"{path}.partial was left behind"


def _cli_fails(capsys, argv: list[str], *expected: str) -> str:
    assert convert_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mindrl-convert {argv[0]}: error: ") and "Traceback" not in err, err
    for text in expected:
        assert text in err, (text, err)
    return err


# ------------------------------------------------------------------------------ megatron checkpoints
def _set_tracker(root: str, text: bytes) -> None:
    with open(os.path.join(root, mcore_ckpt.TRACKER), "wb") as f:
        f.write(text)


def _release(root: str, name: str = "") -> str:
    return os.path.join(root, mcore_ckpt.RELEASE, name)


def _rewrite_meta(root: str, text: str) -> None:
    with open(_release(root, mcore_ckpt.MODEL_META), "w") as f:
        f.write(text)


# (how to break the checkpoint, the file the message must name, what it must say)
MCORE_CASES = {
    "tracker_not_a_number": (
        lambda d: _set_tracker(d, b"latest\n"),
        mcore_ckpt.TRACKER,
        "expected 'release' or an iteration number, found 'latest'",
    ),
    "tracker_empty": (lambda d: _set_tracker(d, b""), mcore_ckpt.TRACKER, "is empty (interrupted save?)"),
    "tracker_negative": (lambda d: _set_tracker(d, b"-3"), mcore_ckpt.TRACKER, "found '-3'"),
    "tracker_binary": (lambda d: _set_tracker(d, b"\xff\xfe\x00\x01"), mcore_ckpt.TRACKER, "expected 'release'"),
    "tracker_missing_iteration": (
        lambda d: _set_tracker(d, b"20"),
        "iter_0000020",
        "iteration 20 (named by",
    ),
    "model_meta_missing": (
        lambda d: os.remove(_release(d, mcore_ckpt.MODEL_META)),
        mcore_ckpt.MODEL_META,
        "is missing: the checkpoint was not written by mindrl or is incomplete",
    ),
    "model_meta_invalid_json": (
        lambda d: _rewrite_meta(d, '{"format_version": 1, "spec": {'),
        mcore_ckpt.MODEL_META,
        "invalid JSON at line 1",
    ),
    "model_meta_without_spec": (
        lambda d: _rewrite_meta(d, '{"format_version": 1, "role": "actor"}'),
        mcore_ckpt.MODEL_META,
        "not a mindrl model description (KeyError: 'spec')",
    ),
    "model_meta_unknown_spec_key": (
        lambda d: _rewrite_meta(d, json.dumps({"spec": {"architecture": "Qwen2ForCausalLM", "colour": 1}})),
        mcore_ckpt.MODEL_META,
        "not a mindrl model description (TypeError",
    ),
    "shard_missing": (lambda d: os.remove(_release(d, "__0_1.distcp")), "__0_1.distcp", "is missing (listed in"),
    "shard_truncated": (
        lambda d: os.truncate(_release(d, "__0_0.distcp"), 1000),
        "__0_0.distcp",
        "is truncated: 1000 bytes, but",
    ),
    "dcp_metadata_missing": (lambda d: os.remove(_release(d, ".metadata")), ".metadata", "is missing"),
    "dcp_metadata_truncated": (
        lambda d: os.truncate(_release(d, ".metadata"), 100),
        ".metadata",
        "is truncated or corrupted",
    ),
    "common_pt_missing": (lambda d: os.remove(_release(d, "common.pt")), "common.pt", "is missing"),
    "metadata_json_missing": (lambda d: os.remove(_release(d, "metadata.json")), "metadata.json", "is missing"),
    "metadata_json_corrupted": (
        lambda d: open(_release(d, "metadata.json"), "w").write("{"),
        "metadata.json",
        "is corrupted",
    ),
}


@pytest.mark.parametrize("case", list(MCORE_CASES))
def test_broken_megatron_checkpoint_fails_before_any_rank_starts(mcore_untied, tmp_path, case):
    """mcore2hf (no pool: a rank would only start after the checks) names the broken file, writes nothing."""
    breaks, names, says = MCORE_CASES[case]
    d = _copy(mcore_untied, tmp_path / "m")
    breaks(d)
    with pytest.raises(CheckpointError) as e:
        convert.mcore2hf(d, str(tmp_path / "hf"))
    assert names in str(e.value) and says in str(e.value), str(e.value)
    _nothing_written(tmp_path / "hf")


def test_broken_megatron_checkpoint_through_the_cli(mcore_untied, tiny_models, tmp_path, capsys):
    d = _copy(mcore_untied, tmp_path / "m")
    os.truncate(_release(d, "__0_1.distcp"), 10)
    shard = _release(d, "__0_1.distcp")
    _cli_fails(capsys, ["mcore2hf", "--load-dir", d, "--save-dir", str(tmp_path / "hf")], shard, "is truncated")
    _cli_fails(capsys, ["check", "--hf-dir", tiny_models["untied"], "--load-dir", d], shard, "is truncated")
    _nothing_written(tmp_path / "hf")


def load_error(load_dir: str) -> str | None:
    """On a rank: the error build_and_load (the trainer's load path) raises, caught so the pool survives."""
    try:
        loading.build_and_load(load_dir, 1, 1)
    except CheckpointError as e:
        return str(e)
    return None


def test_trainer_load_path_names_the_truncated_shard(mcore_untied, rank_pool, tmp_path):
    d = _copy(mcore_untied, tmp_path / "m")
    os.truncate(_release(d, "__0_0.distcp"), 4096)
    msg = rank_pool.run(load_error, d)[0]
    assert msg is not None and "__0_0.distcp is truncated: 4096 bytes" in msg, msg


# ------------------------------------------------------------------------------------ HF checkpoints
@pytest.fixture(scope="module")
def hf_sharded(tiny_models, tmp_path_factory) -> str:
    """The untied tiny model re-saved as two shards + model.safetensors.index.json."""
    out = _copy(tiny_models["untied"], tmp_path_factory.mktemp("sharded") / "hf")
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    os.remove(os.path.join(out, "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    with open(os.path.join(out, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    HFCheckpoint(out)  # valid as written
    return out


def _index(d: str) -> dict:
    return json.load(open(os.path.join(d, INDEX_FILE)))


def _write_index(d: str, index) -> None:
    with open(os.path.join(d, INDEX_FILE), "w") as f:
        f.write(index if isinstance(index, str) else json.dumps(index))


def _map_to_other_shard(d: str) -> None:
    index = _index(d)
    name = next(k for k, v in index["weight_map"].items() if v.startswith("model-00002"))
    index["weight_map"][name] = "model-00001-of-00002.safetensors"
    _write_index(d, index)


def _add_phantom_entry(d: str) -> None:
    index = _index(d)
    index["weight_map"]["model.layers.0.mlp.phantom.weight"] = "model-00001-of-00002.safetensors"
    _write_index(d, index)


HF_CASES = {
    "index_not_json": (lambda d: _write_index(d, '{"weight_map": {'), f"{INDEX_FILE}: not a valid safetensors index"),
    "index_not_an_object": (lambda d: _write_index(d, [1, 2]), f"{INDEX_FILE}: not a valid safetensors index"),
    "index_without_weight_map": (lambda d: _write_index(d, {"metadata": {}}), "not a valid safetensors index"),
    "weight_map_empty": (lambda d: _write_index(d, {"weight_map": {}}), "'weight_map' must map tensor names"),
    "weight_map_a_list": (lambda d: _write_index(d, {"weight_map": ["a"]}), "'weight_map' must map tensor names"),
    "weight_map_not_a_file_name": (
        lambda d: _write_index(d, {"weight_map": {"model.norm.weight": "../model.safetensors"}}),
        "'weight_map' entries must name a shard file",
    ),
    "shard_listed_but_missing": (
        lambda d: os.remove(os.path.join(d, "model-00002-of-00002.safetensors")),
        f"shard 'model-00002-of-00002.safetensors' listed in {INDEX_FILE} is missing",
    ),
    "tensor_in_the_wrong_shard": (
        _map_to_other_shard,
        "model-00002-of-00002.safetensors' holds 'model.",
    ),
    "index_entry_absent_from_its_shard": (
        _add_phantom_entry,
        f"{INDEX_FILE} lists tensors absent from their shard: ['model.layers.0.mlp.phantom.weight']",
    ),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_broken_hf_checkpoint_fails_before_any_rank_starts(hf_sharded, tmp_path, case):
    breaks, says = HF_CASES[case]
    d = _copy(hf_sharded, tmp_path / "hf")
    breaks(d)
    with pytest.raises(CheckpointError) as e:
        convert.hf2mcore(d, str(tmp_path / "m"))
    assert says in str(e.value), str(e.value)
    _nothing_written(tmp_path / "m")
    with pytest.raises(CheckpointError):  # the reader on its own says the same
        HFCheckpoint(d)


def test_wrong_shard_message_names_the_index_entry(hf_sharded, tmp_path):
    d = _copy(hf_sharded, tmp_path / "hf")
    _map_to_other_shard(d)
    with pytest.raises(CheckpointError, match=f"but {INDEX_FILE} maps it to 'model-00001-of-00002.safetensors'"):
        HFCheckpoint(d)


def test_bin_only_folder_gets_the_safetensors_hint(tiny_models, tmp_path, capsys):
    d = _copy(tiny_models["untied"], tmp_path / "hf")
    os.remove(os.path.join(d, "model.safetensors"))
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"not read")
    _cli_fails(
        capsys,
        ["hf2mcore", "--hf-dir", d, "--save-dir", str(tmp_path / "m")],
        "has no model.safetensors or model.safetensors.index.json",
        "found ['pytorch_model.bin']: re-save it with safe_serialization=True",
    )
    _nothing_written(tmp_path / "m")


def test_hf_directory_that_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match=f"HF checkpoint directory '{tmp_path}/nope' does not exist"):
        HFCheckpoint(str(tmp_path / "nope"))


# ---------------------------------------------------------------------------------------- conversion
def test_existing_output_without_overwrite_is_left_alone(mcore_untied, tiny_models, tmp_path, capsys):
    for argv in (
        ["mcore2hf", "--load-dir", mcore_untied, "--save-dir", str(tmp_path / "out")],
        ["hf2mcore", "--hf-dir", tiny_models["untied"], "--save-dir", str(tmp_path / "out")],
    ):
        (tmp_path / "out").mkdir(exist_ok=True)
        (tmp_path / "out" / "precious.txt").write_text("keep")
        _cli_fails(capsys, argv, f"output directory '{tmp_path}/out' is not empty; pass --overwrite")
        assert os.listdir(tmp_path / "out") == ["precious.txt"] and not os.path.exists(f"{tmp_path}/out.partial")


def test_overwrite_replaces_the_output_only_on_success(mcore_untied, tiny_models, rank_pool, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    convert.mcore2hf(mcore_untied, str(out), overwrite=True, pool=rank_pool)
    assert not (out / "stale.txt").exists() and not os.path.exists(f"{out}.partial")
    assert sorted(HFCheckpoint(str(out)).keys()) == sorted(HFCheckpoint(tiny_models["untied"]).keys())


def test_overwrite_with_a_failing_conversion_keeps_the_old_output(tiny_models, tmp_path):
    """A conversion that fails inside its ranks (NaN weights) neither replaces nor half-writes the output."""
    bad = _copy(tiny_models["untied"], tmp_path / "nan")
    f = os.path.join(bad, "model.safetensors")
    with safe_open(f, "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors["model.layers.0.self_attn.o_proj.weight"][0, 0] = float("inf")
    save_file(tensors, f, metadata={"format": "pt"})
    out = tmp_path / "m"
    out.mkdir()
    (out / "previous.txt").write_text("previous conversion")
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.o_proj.weight' .* holds NaN/Inf"):
        convert.hf2mcore(bad, str(out), overwrite=True)  # its own rank pool: the failure tears it down
    assert os.listdir(out) == ["previous.txt"] and not os.path.exists(f"{out}.partial")


def test_output_path_is_a_file(mcore_untied, tiny_models, tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("a file")
    for argv in (
        ["hf2mcore", "--hf-dir", tiny_models["untied"], "--save-dir", str(target), "--overwrite"],
        ["mcore2hf", "--load-dir", mcore_untied, "--save-dir", str(target), "--overwrite"],
    ):
        _cli_fails(capsys, argv, f"output path '{target}' exists and is not a directory")
        assert target.read_text() == "a file" and not os.path.exists(f"{target}.partial")


def test_output_overlapping_the_input_is_refused(mcore_untied, tiny_models, tmp_path, capsys):
    """--overwrite onto (or around) the input would delete the input: refused, input untouched."""
    hf = _copy(tiny_models["untied"], tmp_path / "hf")
    before = sorted(os.listdir(hf))
    _cli_fails(capsys, ["hf2mcore", "--hf-dir", hf, "--save-dir", hf, "--overwrite"], "overlaps the input")
    _cli_fails(capsys, ["hf2mcore", "--hf-dir", hf, "--save-dir", str(tmp_path), "--overwrite"], "overlaps the input")
    assert sorted(os.listdir(hf)) == before
    inside = os.path.join(mcore_untied, "export")
    _cli_fails(capsys, ["mcore2hf", "--load-dir", mcore_untied, "--save-dir", inside], "overlaps the input")
    _nothing_written(inside)


def test_check_against_a_different_architecture(mcore_untied, tiny_models, capsys):
    _cli_fails(
        capsys,
        ["check", "--hf-dir", tiny_models["orm"], "--load-dir", mcore_untied],
        f"{tiny_models['orm']} is Qwen2ForSequenceClassification but {mcore_untied} holds Qwen2ForCausalLM",
    )


def test_check_against_a_differently_shaped_model(mcore_untied, tiny_models, tmp_path, capsys):
    hf = _copy(tiny_models["untied"], tmp_path / "hf")
    cfg = json.load(open(os.path.join(hf, "config.json")))
    cfg.update(hidden_size=256, num_hidden_layers=4)
    json.dump(cfg, open(os.path.join(hf, "config.json"), "w"))
    err = _cli_fails(capsys, ["check", "--hf-dir", hf, "--load-dir", mcore_untied], "differently shaped models")
    assert "hidden_size 256 vs 128" in err and "num_layers 4 vs 2" in err and "head_dim 64 vs 32" in err, err


class _NeverRuns:
    """A caller's pool of `world_size` ranks that must not be used."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def run(self, *args, **kwargs):
        raise AssertionError("a conversion started on a pool that cannot host it")


def test_pool_smaller_than_tp_times_pp(mcore_untied, tiny_models, tmp_path):
    with pytest.raises(ValueError, match=r"pool of 2 ranks cannot host TP\*PP = 4"):
        convert.hf2mcore(tiny_models["untied"], str(tmp_path / "m"), 2, 2, pool=_NeverRuns(2))
    _nothing_written(tmp_path / "m")
    with pytest.raises(ValueError, match=r"pool of 3 ranks cannot host TP\*PP = 2"):
        convert.check(tiny_models["untied"], mcore_untied, 2, 1, pool=_NeverRuns(3))


@pytest.fixture
def mcore_critic(mcore_untied, tiny_models, tmp_path) -> str:
    """A checkpoint whose model description is the reward model's: all mcore2hf --orm reads before starting."""
    d = _copy(mcore_untied, tmp_path / "critic")
    spec = ModelSpec.from_hf_dir(tiny_models["orm"])
    mcore_ckpt.write_model_meta(_release(d), spec, "critic", 1, 1, "float32")
    return d


def test_orm_flag_mismatch_in_mcore2hf(mcore_untied, mcore_critic, tmp_path, capsys):
    _cli_fails(
        capsys,
        ["mcore2hf", "--load-dir", mcore_critic, "--save-dir", str(tmp_path / "hf")],
        f"{mcore_critic} holds a reward/critic model (Qwen2ForSequenceClassification, value head); pass --orm",
    )
    _cli_fails(
        capsys,
        ["mcore2hf", "--load-dir", mcore_untied, "--save-dir", str(tmp_path / "hf"), "--orm"],
        "--orm expects a reward/critic model",
        f"but {mcore_untied} holds Qwen2ForCausalLM; drop --orm for a causal LM",
    )
    _nothing_written(tmp_path / "hf")


def test_bad_numbers_on_the_command_line(mcore_untied, tiny_models, tmp_path, capsys):
    _cli_fails(
        capsys,
        ["mcore2hf", "--load-dir", mcore_untied, "--save-dir", str(tmp_path / "hf"), "--max-shard-size-mb", "0"],
        "--max-shard-size-mb must be > 0, got 0",
    )
    _cli_fails(
        capsys,
        ["hf2mcore", "--hf-dir", tiny_models["untied"], "--save-dir", str(tmp_path / "m"), "--tp", "0"],
        "TP, PP and EP must be >= 1, got TP=0 PP=1 EP=1",
    )
    _nothing_written(tmp_path / "hf")
    _nothing_written(tmp_path / "m")
