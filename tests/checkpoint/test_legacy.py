"""Legacy megatron checkpoints (MindSpeed-LLM / MindSpeed-RL: iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt):
built here with the documented layout from real megatron ranks, loaded at other TP / PP, converted to HF
bit-exactly, and refused with named errors when incomplete or holding pickled objects."""

from __future__ import annotations

import argparse
import functools
import os
import random
import re
import shutil

import numpy as np
import pytest
import torch

from mindrl.checkpoint import convert, legacy, loading, mcore_ckpt
from mindrl.checkpoint.hf_io import CheckpointError, carry_files
from mindrl.cli.convert import main as convert_cli
from tests.checkpoint.test_convert import assert_bit_exact
from tests.config.conftest import assets  # noqa: F401  (fixture)

ITERATION = 40


# ------------------------------------------------------------------------------------ rank functions
def save_legacy_rank(mindrl_dir: str, root: str, tp: int, pp: int) -> str | None:
    """On a rank: load a mindrl checkpoint at TP x PP and write this rank's file the way megatron's legacy
    save_checkpoint does (DP rank 0 only): args, checkpoint_version, iteration, model, rng_state, optimizer."""
    from megatron.core import parallel_state as ps

    _, _, model = loading.build_and_load(mindrl_dir, tp, pp)
    if ps.get_data_parallel_rank() != 0:
        return None
    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
    path = os.path.join(root, f"iter_{ITERATION:07d}", name, "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        num_layers=2,
        attention_backend=AttnBackend.auto,  # megatron's own args hold enums like this one
    )
    rng = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model.state_dict(),
        "optimizer": {"optimizer": {"state": {}, "param_groups": [{"lr": 1e-6, "params": [0]}]}},
        "opt_param_scheduler": {"num_steps": 320},
        "rng_state": [rng],
        "num_floating_point_operations_so_far": 0,
    }
    torch.save(state, path)
    return path


def legacy_to_mindrl_rank(root: str, hf_dir: str, out: str, tp: int, pp: int) -> None:
    """On a rank: load the legacy checkpoint at TP x PP and save it as a mindrl checkpoint."""
    spec, meta, model = loading.build_and_load(root, tp, pp, hf_config=hf_dir)
    it_dir = mcore_ckpt.iteration_dir(out, mcore_ckpt.RELEASE)
    mcore_ckpt.save_model(model, it_dir)
    if torch.distributed.get_rank() == 0:
        mcore_ckpt.write_model_meta(it_dir, spec, meta["role"], tp, pp, meta["dtype"])
        carry_files(hf_dir, os.path.join(out, mcore_ckpt.HF_FILES))  # as hf2mcore does: config, tokenizer
        mcore_ckpt.write_tracker(out, mcore_ckpt.RELEASE)


def load_error(root: str, hf_dir: str | None) -> str | None:
    """On a rank: the error the trainer's load path raises, caught so the pool survives."""
    try:
        loading.build_and_load(root, 2, 1, hf_config=hf_dir)
    except CheckpointError as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------------ fixtures
def make_legacy(pool, hf_dir: str, work, tp: int, pp: int, orm: bool) -> str:
    mindrl_dir, root = str(work / "mindrl"), str(work / "legacy")
    convert.hf2mcore(hf_dir, mindrl_dir, tp, pp, orm=orm, pool=pool)
    written = [p for p in pool.run(save_legacy_rank, mindrl_dir, root, tp, pp) if p]
    assert len(written) == tp * pp
    with open(os.path.join(root, legacy.mcore_ckpt.TRACKER), "w") as f:
        f.write(str(ITERATION))
    return root


@pytest.fixture(scope="module")
def legacy_ckpts(tiny_models, tmp_path_factory):
    """(variant, tp, pp) -> a legacy checkpoint root of that tiny model, saved by real megatron ranks."""
    from mindrl.launch import RankPool
    from tests import conftest

    if conftest._POOL is None or conftest._POOL.closed:  # module fixtures are set up before `pool`: same pool
        conftest._POOL = RankPool(4, timeout_s=600)
    pool = conftest._POOL
    out = {}
    for variant, tp, pp in (("untied", 2, 2), ("orm", 2, 2), ("tied", 2, 2), ("untied", 1, 1)):
        work = tmp_path_factory.mktemp(f"legacy_{variant}_tp{tp}pp{pp}")
        out[(variant, tp, pp)] = make_legacy(pool, tiny_models[variant], work, tp, pp, variant == "orm")
    return out


@pytest.fixture(scope="module")
def hf_reference(tiny_models):
    ids = torch.randint(0, 1021, (2, 40), generator=torch.Generator().manual_seed(11))
    return ids, {v: convert.hf_outputs(tiny_models[v], ids) for v in ("untied", "tied", "orm")}


def _copy(src: str, dst) -> str:
    shutil.copytree(src, str(dst))
    return str(dst)


# ------------------------------------------------------------------------------------ the format
def test_layout_is_megatrons(pool, legacy_ckpts):
    root = legacy_ckpts[("untied", 2, 2)]
    it_dir = os.path.join(root, f"iter_{ITERATION:07d}")
    assert sorted(os.listdir(it_dir)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert sorted(os.listdir(legacy_ckpts[("untied", 1, 1)] + f"/iter_{ITERATION:07d}")) == ["mp_rank_00"]
    state = legacy.load_rank_file(os.path.join(it_dir, "mp_rank_01_001", "model_optim_rng.pt"))
    assert isinstance(state["args"], argparse.Namespace) and state["args"].tensor_model_parallel_size == 2
    # An inert stand-in (megatron's class is not called), unless megatron itself already registered its enums with
    # torch.serialization.add_safe_globals in this process (importing its dist_checkpointing does): then the enum.
    backend = state["args"].attention_backend
    if isinstance(backend, legacy.InertStandIn):
        name = backend.global_name
    else:
        assert type(backend) in torch.serialization.get_safe_globals(), type(backend)
        name = f"{type(backend).__module__}.{type(backend).__qualname__}"
    assert name.endswith("enums.AttnBackend"), name
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == ITERATION
    assert isinstance(state["rng_state"][0]["np_rng_state"][1], np.ndarray)
    model = state["model"]
    # Last stage, TP rank 1: layers numbered from 0 within the stage, TP-sharded weights, the output layer.
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in model and "output_layer.weight" in model
    assert not any(k.startswith("decoder.layers.1.") or k.startswith("embedding.") for k in model)
    assert any(k.endswith("._extra_state") and v is None for k, v in model.items())  # megatron's, skipped on load
    assert tuple(model["decoder.layers.0.mlp.linear_fc1.weight"].shape) == (2 * 256 // 2, 128)  # [gate; up] / TP

    ckpt = legacy.LegacyCheckpoint.open(root)
    assert (ckpt.tp, ckpt.pp, ckpt.iteration, ckpt.num_layers) == (2, 2, ITERATION, 2)
    assert ckpt.index["decoder.layers.1.mlp.linear_fc2.weight"] == [(1, 0, "decoder.layers.0.mlp.linear_fc2.weight")]
    assert legacy.is_legacy(root) and not legacy.is_legacy(os.path.join(root, "nowhere"))


# ------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("variant,tp,pp", [("untied", 2, 2), ("orm", 2, 2), ("tied", 2, 2), ("untied", 1, 1)])
def test_mcore2hf_is_bit_exact(tiny_models, pool, legacy_ckpts, tmp_path, variant, tp, pp):
    """legacy TPxPP -> mindrl-convert mcore2hf --hf-config -> HF: every tensor and config file equal."""
    root = legacy_ckpts[(variant, tp, pp)]
    hf = tiny_models[variant]
    convert.mcore2hf(root, str(tmp_path / "hf"), orm=variant == "orm", pool=pool, hf_config=hf)
    assert_bit_exact(hf, str(tmp_path / "hf"))


@pytest.mark.parametrize("variant", ["untied", "orm"])
@pytest.mark.parametrize("tp", [1, 2])
def test_legacy_to_mindrl_to_hf_is_bit_exact(tiny_models, pool, legacy_ckpts, tmp_path, variant, tp):
    """legacy TP2xPP2 -> loaded at TP1 / TP2 (PP1) and saved as a mindrl checkpoint -> HF equals the HF model."""
    out = str(tmp_path / "mindrl")
    pool.run(legacy_to_mindrl_rank, legacy_ckpts[(variant, 2, 2)], tiny_models[variant], out, tp, 1)
    _, meta = mcore_ckpt.read_model_meta(out)
    assert (meta["tp"], meta["role"]) == (tp, "critic" if variant == "orm" else "actor")
    convert.mcore2hf(out, str(tmp_path / "hf"), orm=variant == "orm", pool=pool)
    assert_bit_exact(tiny_models[variant], str(tmp_path / "hf"))


@pytest.mark.parametrize("variant", ["untied", "tied", "orm"])
@pytest.mark.parametrize("tp,pp,sp", [(1, 1, False), (2, 1, True), (1, 2, False), (2, 2, False)])
def test_build_and_load_matches_hf(tiny_models, pool, legacy_ckpts, hf_reference, variant, tp, pp, sp):
    """legacy TP2xPP2 loaded directly (actor_config.load / critic_config.load) at other layouts: logits (values)
    equal HF's within 1e-5."""
    ids, ref = hf_reference
    root = legacy_ckpts[(variant, 2, 2)]
    ours = convert.megatron_outputs(pool, root, tp, pp, ids, sequence_parallel=sp, hf_config=tiny_models[variant])
    assert ours.shape == ref[variant].shape and ref[variant].abs().max() > 0.1
    diff = (ours - ref[variant]).abs().max().item()
    assert diff < 1e-5, f"max abs diff {diff}"


def test_spec_from_hf_files_and_check(tiny_models, pool, legacy_ckpts, tmp_path):
    """Without --hf-config, ROOT/hf_files/config.json describes the model (what the trainer's load path uses);
    `mindrl-convert check` accepts a legacy dir, reading the architecture from --hf-dir."""
    root = _copy(legacy_ckpts[("untied", 1, 1)], tmp_path / "legacy")
    os.makedirs(os.path.join(root, "hf_files"))
    shutil.copy(os.path.join(tiny_models["untied"], "config.json"), os.path.join(root, "hf_files"))
    spec, source = legacy.resolve_spec(root)
    assert source == os.path.join(root, "hf_files", "config.json") and spec.num_layers == 2
    ids = torch.randint(0, 1021, (1, 16), generator=torch.Generator().manual_seed(3))
    ours = convert.megatron_outputs(pool, root, 2, 1, ids)
    assert torch.allclose(ours, convert.hf_outputs(tiny_models["untied"], ids), atol=1e-5, rtol=0)
    res = convert.check(tiny_models["untied"], legacy_ckpts[("untied", 2, 2)], 1, 1, pool=pool)
    assert res.ok and res.max_abs_diff < 1e-3 * res.reference_gap


def test_other_spellings_are_read(tiny_models, pool, legacy_ckpts, tmp_path):
    """Virtual-pipeline chunks (model0 / model1), Transformer-Engine names for the fused norms, `_extra_state`
    entries, a vocabulary padded by megatron and the `model_rng.pt` file name: the same HF model comes out."""
    src = legacy.load_rank_file(_rank_file(legacy_ckpts[("untied", 1, 1)], "mp_rank_00"))["model"]
    te = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
          "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}  # fmt: skip
    chunks: list[dict] = [{}, {}]
    for key, tensor in src.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", key)
        if m:  # layer i -> chunk i, numbered 0 within its chunk
            layer, suffix = int(m.group(1)), m.group(2)
            chunks[layer][f"decoder.layers.0.{te.get(suffix, suffix)}"] = tensor  # _extra_state entries: None
            chunks[layer]["decoder.layers.0.self_attention.core_attention._extra_state"] = torch.zeros(0)
        elif key.startswith("embedding."):
            chunks[0][key] = torch.cat([tensor, torch.zeros(128, tensor.shape[1])])  # padded to 1152 rows
        else:
            pad = torch.zeros(128, tensor.shape[1]) if key == "output_layer.weight" else None
            chunks[1][key] = tensor if pad is None else torch.cat([tensor, pad])
    root = tmp_path / "vpp"
    path = root / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model0": chunks[0], "model1": chunks[1], "checkpoint_version": 3.0, "iteration": ITERATION}, path)
    (root / mcore_ckpt.TRACKER).write_text(str(ITERATION))
    ckpt = legacy.LegacyCheckpoint.open(str(root))
    assert ckpt.index["decoder.layers.1.input_layernorm.weight"] == [
        (0, 1, "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")
    ]
    convert.mcore2hf(str(root), str(tmp_path / "hf"), pool=pool, hf_config=tiny_models["untied"])
    assert_bit_exact(tiny_models["untied"], str(tmp_path / "hf"))


# ------------------------------------------------------------------------------------ bad input
def _rank_file(root: str, name: str) -> str:
    return os.path.join(root, f"iter_{ITERATION:07d}", name, "model_optim_rng.pt")


def test_missing_rank_dir_is_named(legacy_ckpts, tiny_models, tmp_path, capsys):
    root = _copy(legacy_ckpts[("untied", 2, 2)], tmp_path / "legacy")
    shutil.rmtree(os.path.dirname(_rank_file(root, "mp_rank_01_000")))
    with pytest.raises(CheckpointError, match=r"mp_rank_01_000 is missing: the checkpoint has TP=2 x PP=2"):
        legacy.LegacyCheckpoint.open(root)
    code = convert_cli(
        ["mcore2hf", "--load-dir", root, "--save-dir", str(tmp_path / "hf"), "--hf-config", tiny_models["untied"]]
    )
    assert code == 2 and "mp_rank_01_000 is missing" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "hf")
    os.makedirs(os.path.join(root, f"iter_{ITERATION:07d}", "mp_rank_00_000_001"))
    with pytest.raises(CheckpointError, match=r"mp_rank_00_000_001: an expert-parallel \(MoE\) rank directory"):
        legacy.LegacyCheckpoint.open(root)


def test_missing_rank_file_and_tracker_to_missing_iteration(legacy_ckpts, tmp_path):
    root = _copy(legacy_ckpts[("untied", 2, 2)], tmp_path / "legacy")
    os.remove(_rank_file(root, "mp_rank_00_001"))
    with pytest.raises(CheckpointError, match=r"mp_rank_00_001 has no model_optim_rng.pt or model_rng.pt"):
        legacy.LegacyCheckpoint.open(root)
    with open(os.path.join(root, mcore_ckpt.TRACKER), "w") as f:
        f.write("50")
    with pytest.raises(
        CheckpointError, match=r"latest_checkpointed_iteration.txt names iteration 50, but .*iter_0000050"
    ):
        legacy.LegacyCheckpoint.open(root)


class Payload:
    """Stands in for any pickled object: unpickling it would import and call this module's code."""


@pytest.mark.parametrize("what", ["function", "object"])
def test_pickled_code_is_refused(legacy_ckpts, tiny_models, pool, tmp_path, what):
    root = _copy(legacy_ckpts[("untied", 1, 1)], tmp_path / "legacy")
    path = _rank_file(root, "mp_rank_00")
    state = legacy.load_rank_file(path)
    state["args"] = functools.partial(os.system, "echo pwned") if what == "function" else Payload()
    torch.save(state, path + ".tmp")  # not onto the memory-mapped file being read
    os.replace(path + ".tmp", path)
    bad = "posix.system" if what == "function" else "Payload"
    with pytest.raises(CheckpointError, match=rf"{re.escape(path)}: refused to load: it holds objects of \[.*{bad}"):
        legacy.load_rank_file(path)
    msg = pool.run(load_error, root, tiny_models["untied"])[0]  # the trainer's load path
    assert msg is not None and path in msg and "weights_only=True" in msg, msg


def test_truncated_file_and_missing_architecture(legacy_ckpts, tiny_models, tmp_path, capsys):
    root = _copy(legacy_ckpts[("untied", 1, 1)], tmp_path / "legacy")
    with pytest.raises(CheckpointError, match=r"does not record the model's architecture: give the HF model's"):
        legacy.resolve_spec(root)
    code = convert_cli(["mcore2hf", "--load-dir", root, "--save-dir", str(tmp_path / "hf")])
    assert code == 2 and "--hf-config" in capsys.readouterr().err
    path = _rank_file(root, "mp_rank_00")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=rf"{re.escape(path)}: not a readable torch.save file"):
        legacy.load_rank_file(path)


def test_wrong_hf_config_is_named(legacy_ckpts, tiny_models, tmp_path, capsys):
    """An actor checkpoint described by the ORM's config (or the reverse), or a missing --orm, fails naming why."""
    root = legacy_ckpts[("untied", 2, 2)]
    spec, source = legacy.resolve_spec(root, tiny_models["orm"])
    with pytest.raises(CheckpointError, match=r"mp_rank_00_001/model_optim_rng.pt: tensor 'output_layer.weight' has "
                       r"shape \(512, 128\), but .*orm/config.json implies \(1, 128\)"):  # fmt: skip
        legacy.LegacyCheckpoint.open(root).check_against(spec, source)
    spec, source = legacy.resolve_spec(root, tiny_models["tied"])  # tied: no output layer of its own
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'output_layer.weight' has shape \(1, 128\), but .*tied/config.json implies \(512, 128\)",
    ):
        legacy.LegacyCheckpoint.open(legacy_ckpts[("orm", 2, 2)]).check_against(spec, source)
    orm_root = legacy_ckpts[("orm", 2, 2)]
    code = convert_cli(
        ["mcore2hf", "--load-dir", orm_root, "--save-dir", str(tmp_path / "hf"), "--hf-config", tiny_models["orm"]]
    )
    assert code == 2 and "pass --orm" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=r"nowhere/config.json' \(given for the legacy checkpoint .*\) does not"):
        legacy.resolve_spec(root, str(tmp_path / "nowhere"))


# ------------------------------------------------------------------------------------ trainer config
def test_config_path_check_accepts_legacy_load(legacy_ckpts, tiny_models, assets, tmp_path):  # noqa: F811
    """actor_config.load may name a legacy checkpoint: its hf_files/config.json describes the model (checked against
    the model file like any checkpoint); without one, the error names the key and what to add."""
    from mindrl.config import ConfigError
    from mindrl.preflight import load_config
    from tests.config.conftest import asset_overrides

    root = _copy(legacy_ckpts[("untied", 2, 2)], tmp_path / "legacy")
    overrides = [*asset_overrides(assets, critic=False), f"actor_config.load={root}"]
    with pytest.raises(ConfigError) as e:
        load_config("grpo_tiny_cpu", overrides=overrides)
    msgs = [i.message for i in e.value.issues if i.key == "actor_config.load"]
    assert msgs and "does not record the model's architecture" in msgs[0] and "hf_files" in msgs[0], e.value
    os.makedirs(os.path.join(root, "hf_files"))
    shutil.copy(os.path.join(tiny_models["untied"], "config.json"), os.path.join(root, "hf_files"))
    cfg = load_config("grpo_tiny_cpu", overrides=overrides)
    assert cfg.actor_config.load == root
