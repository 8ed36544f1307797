"""HF <-> megatron conversion: bit-exact round trips, logits parity at every layout, clear errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mindrl.checkpoint import convert, mcore_ckpt
from mindrl.checkpoint.hf_io import CheckpointError, HFCheckpoint
from mindrl.cli.convert import main as convert_cli
from mindrl.models.hf_config import ModelConfigError

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    ckpt = HFCheckpoint(path)
    return {k: ckpt.get(k) for k in ckpt.keys()}


def assert_bit_exact(a_dir: str, b_dir: str) -> None:
    a, b = hf_tensors(a_dir), hf_tensors(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), f"{k} differs"
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(a_dir, f)):
            assert open(os.path.join(a_dir, f), "rb").read() == open(os.path.join(b_dir, f), "rb").read(), f


@pytest.mark.parametrize("variant", ["untied", "tied", "orm"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_round_trip_is_bit_exact(tiny_models, pool, tmp_path, variant, tp, pp):
    orm = variant == "orm"
    stats = convert.hf2mcore(tiny_models[variant], str(tmp_path / "mcore"), tp, pp, orm=orm, pool=pool)
    assert stats.num_params > 0 and mcore_ckpt.read_tracker(str(tmp_path / "mcore")) == "release"
    _, meta = mcore_ckpt.read_model_meta(str(tmp_path / "mcore"))
    assert (meta["tp"], meta["pp"], meta["role"]) == (tp, pp, "critic" if orm else "actor")
    convert.mcore2hf(str(tmp_path / "mcore"), str(tmp_path / "hf"), orm=orm, pool=pool)
    assert_bit_exact(tiny_models[variant], str(tmp_path / "hf"))


@pytest.fixture(scope="module")
def saved_tp2(tiny_models, tmp_path_factory, get_pool):
    """Each variant converted once at TP2 (PP1); the parity tests load it at other layouts."""
    root = tmp_path_factory.mktemp("tp2")
    out = {}
    for variant in ("untied", "tied", "orm"):
        out[variant] = str(root / variant)
        convert.hf2mcore(tiny_models[variant], out[variant], 2, 1, orm=variant == "orm", pool=get_pool())
    return out


@pytest.fixture(scope="module")
def hf_reference(tiny_models):
    ids = torch.randint(0, 1021, (2, 48), generator=torch.Generator().manual_seed(7))
    return ids, {v: convert.hf_outputs(tiny_models[v], ids) for v in ("untied", "tied", "orm")}


@pytest.mark.parametrize("variant", ["untied", "tied", "orm"])
@pytest.mark.parametrize("tp,pp,sp", [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (2, 1, True)])
def test_megatron_matches_hf_at_every_layout(pool, saved_tp2, hf_reference, variant, tp, pp, sp):
    """Saved at TP2, loaded at TP1 / TP2 / PP2 / TP2xPP2 / TP2+SP: logits (values) equal HF's within 1e-5."""
    ids, ref = hf_reference
    ours = convert.megatron_outputs(pool, saved_tp2[variant], tp, pp, ids, sequence_parallel=sp)
    assert ours.shape == ref[variant].shape
    assert ref[variant].abs().max() > 0.1  # non-trivial outputs: a mapping error cannot hide
    diff = (ours - ref[variant]).abs().max().item()
    assert diff < 1e-5, f"max abs diff {diff}"


def test_padded_batch_matches_hf(pool, saved_tp2, tiny_models):
    """Left padding through megatron's attention mask + position ids equals HF on the same padded batch."""
    import transformers

    from tests.checkpoint import rank_fns

    ids = torch.randint(0, 1021, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ours = next(r for r in pool.run(rank_fns.padded_logits, saved_tp2["untied"], ids, mask) if r is not None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["untied"], dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    valid = mask.bool()
    assert (ours[valid] - ref[valid]).abs().max() < 1e-5


def test_sharded_hf_output_and_reconversion(tiny_models, pool, tmp_path):
    """Small shards give an index + several files; converting that back is still bit-exact."""
    convert.hf2mcore(tiny_models["untied"], str(tmp_path / "m"), 2, 2, pool=pool)
    convert.mcore2hf(str(tmp_path / "m"), str(tmp_path / "h"), max_shard_size_mb=1, pool=pool)
    files = sorted(f for f in os.listdir(tmp_path / "h") if f.endswith(".safetensors"))
    assert len(files) >= 2 and os.path.exists(tmp_path / "h" / "model.safetensors.index.json")
    convert.hf2mcore(str(tmp_path / "h"), str(tmp_path / "m2"), 1, 1, pool=pool)
    convert.mcore2hf(str(tmp_path / "m2"), str(tmp_path / "h2"), pool=pool)
    assert_bit_exact(tiny_models["untied"], str(tmp_path / "h2"))


# ------------------------------------------------------------------------------------ bad input
def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path: str, **changes) -> None:
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.update(changes)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))


def _rewrite_weights(path: str, fn) -> None:
    f = os.path.join(path, "model.safetensors")
    with safe_open(f, "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    save_file(fn(tensors), f, metadata={"format": "pt"})


def test_missing_directories(tmp_path):
    with pytest.raises(ModelConfigError, match="does not exist"):
        convert.hf2mcore(str(tmp_path / "nope"), str(tmp_path / "m"))
    with pytest.raises(CheckpointError, match="does not exist"):
        convert.mcore2hf(str(tmp_path / "nope"), str(tmp_path / "h"))
    os.makedirs(tmp_path / "half")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt is missing"):
        convert.mcore2hf(str(tmp_path / "half"), str(tmp_path / "h"))


def test_unsupported_architecture(tiny_models, tmp_path):
    d = _copy(tiny_models["untied"], tmp_path / "x")
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match="architecture 'GPT2LMHeadModel' is not supported"):
        convert.hf2mcore(d, str(tmp_path / "m"))


@pytest.mark.parametrize(
    "tp,pp,message",
    [
        (3, 1, "TP=3 does not divide num_attention_heads=4"),
        (4, 1, "TP=4 does not divide num_key_value_heads=2"),
        (2, 3, "PP=3 does not divide num_hidden_layers=2"),
    ],
)
def test_layout_that_does_not_divide(tiny_models, tmp_path, tp, pp, message):
    with pytest.raises(ModelConfigError, match=message):
        convert.hf2mcore(tiny_models["untied"], str(tmp_path / "m"), tp, pp)


def test_tp_not_dividing_ffn(tiny_models, tmp_path):
    d = _copy(tiny_models["untied"], tmp_path / "x")
    _edit_config(d, intermediate_size=255)
    with pytest.raises(ModelConfigError, match=r"TP=2 does not divide intermediate_size \(ffn\)=255"):
        convert.hf2mcore(d, str(tmp_path / "m"), 2, 1)


def test_truncated_and_corrupted_shards(tiny_models, tmp_path):
    d = _copy(tiny_models["untied"], tmp_path / "trunc")
    f = os.path.join(d, "model.safetensors")
    os.truncate(f, os.path.getsize(f) - 4096)
    with pytest.raises(CheckpointError, match="model.safetensors' is truncated or corrupted"):
        convert.hf2mcore(d, str(tmp_path / "m"))
    d = _copy(tiny_models["untied"], tmp_path / "header")
    with open(os.path.join(d, "model.safetensors"), "r+b") as fh:
        fh.seek(8)
        fh.write(b"\x00garbage{")
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        convert.hf2mcore(d, str(tmp_path / "m"))
    assert not os.path.exists(tmp_path / "m")  # nothing written


def test_nan_weights_are_reported_by_name(tiny_models, tmp_path):
    d = _copy(tiny_models["untied"], tmp_path / "nan")

    def poison(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 3] = float("nan")
        return t

    _rewrite_weights(d, poison)
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' .* holds NaN/Inf"):
        convert.hf2mcore(d, str(tmp_path / "m"))  # raised inside a rank, re-raised here with its type


def test_missing_unexpected_and_misshapen_tensors(tiny_models, tmp_path):
    d = _copy(tiny_models["untied"], tmp_path / "missing")
    _rewrite_weights(d, lambda t: {k: v for k, v in t.items() if k != "model.layers.0.self_attn.k_proj.bias"})
    with pytest.raises(CheckpointError, match="missing tensors .*model.layers.0.self_attn.k_proj.bias"):
        convert.hf2mcore(d, str(tmp_path / "m"))
    d = _copy(tiny_models["untied"], tmp_path / "extra")
    _rewrite_weights(d, lambda t: {**t, "model.layers.5.mlp.up_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(CheckpointError, match="not part of a Qwen2ForCausalLM.*layers.5"):
        convert.hf2mcore(d, str(tmp_path / "m"))
    d = _copy(tiny_models["untied"], tmp_path / "shape")
    _rewrite_weights(d, lambda t: {**t, "model.norm.weight": torch.ones(64)})
    with pytest.raises(
        CheckpointError, match=r"'model.norm.weight' has shape \(64,\), but config.json implies \(128,\)"
    ):
        convert.hf2mcore(d, str(tmp_path / "m"))


def test_mismatched_orm_flag(tiny_models, tmp_path):
    with pytest.raises(CheckpointError, match="--orm expects a reward/critic model"):
        convert.hf2mcore(tiny_models["untied"], str(tmp_path / "m"), orm=True)
    with pytest.raises(CheckpointError, match="holds a reward/critic model .* pass --orm"):
        convert.hf2mcore(tiny_models["orm"], str(tmp_path / "m"), orm=False)


def test_existing_output_is_not_overwritten(tiny_models, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "precious.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not empty; pass --overwrite"):
        convert.hf2mcore(tiny_models["untied"], str(tmp_path / "m"))
    assert (tmp_path / "m" / "precious.txt").read_text() == "keep"


def test_cli_errors_exit_2_with_the_reason(tiny_models, tmp_path, capsys):
    assert convert_cli(["hf2mcore", "--hf-dir", str(tmp_path / "nope"), "--save-dir", str(tmp_path / "m")]) == 2
    assert "mindrl-convert hf2mcore: error: HF model directory" in capsys.readouterr().err
    assert (
        convert_cli(["hf2mcore", "--hf-dir", tiny_models["untied"], "--save-dir", str(tmp_path / "m"), "--tp", "3"])
        == 2
    )
    assert "TP=3 does not divide" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        convert_cli(["--help"])
    assert e.value.code == 0 and "hf2mcore" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_end_to_end(tiny_models, tmp_path, capsys):
    """The commands users run, each launching its own ranks: hf2mcore TP2xPP2, check at TP1, mcore2hf."""
    m, h = str(tmp_path / "m"), str(tmp_path / "h")
    assert convert_cli(["hf2mcore", "--hf-dir", tiny_models["tied"], "--save-dir", m, "--tp", "2", "--pp", "2"]) == 0
    assert convert_cli(["check", "--hf-dir", tiny_models["tied"], "--load-dir", m, "--tp", "1", "--pp", "1"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["max_abs_logit_diff"] < 1e-5
    assert convert_cli(["check", "--hf-dir", tiny_models["untied"], "--load-dir", m, "--tol", "1e-5"]) == 1
    assert convert_cli(["mcore2hf", "--load-dir", m, "--save-dir", h]) == 0
    assert_bit_exact(tiny_models["tied"], h)
