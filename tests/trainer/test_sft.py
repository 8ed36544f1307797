"""mindrl-sft on the shared 4-rank gloo pool: the loss falls, only response tokens carry loss (checked against a
transformers reference and by perturbing labels), TP2 / PP2 match TP1, the checkpoint loads and converts, and a
bad config names the key and the file."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
import yaml

from mindrl.config import ConfigError
from mindrl.preflight import load_sft_config
from mindrl.trainer import sft

WORLD = 4  # the shared pool's ranks (tests/conftest.py)


def shared_pool():
    """The session's 4-rank pool (the `pool` fixture's), for module-scoped fixtures."""
    import tests.conftest as conftest
    from mindrl.launch import RankPool

    if conftest._POOL is None or conftest._POOL.closed:
        conftest._POOL = RankPool(WORLD, timeout_s=600)
    return conftest._POOL


@pytest.fixture(scope="module")
def assets(tiny_models, tmp_path_factory):
    """The quickstart task's SFT split (tiny), preprocessed with the Alpaca handler, and the base checkpoint."""
    from mindrl.checkpoint import convert
    from mindrl.data.preprocess import preprocess
    from mindrl.data.preprocess_config import PreprocessConfig
    from tools.make_quickstart_data import make_splits

    d = tmp_path_factory.mktemp("sft_assets")
    rows, _ = make_splits(seed=0, sft_rows=160)
    (d / "sft.json").write_text(json.dumps(rows))
    cfg = PreprocessConfig(
        input=str(d / "sft.json"),
        tokenizer_name_or_path=tiny_models["untied"],
        output_prefix=str(d / "data" / "sft"),
        handler_name="AlpacaStyleInstructionHandler",
        prompt_type="qwen",
        map_keys={"prompt": "problem", "response": "solution"},
    )
    preprocess(cfg, log=io.StringIO())
    convert.hf2mcore(tiny_models["untied"], str(d / "base"), 1, 1, pool=shared_pool())
    return d, tiny_models["untied"]


def write_config(dir_path, assets, name: str = "sft_test", **values) -> str:
    """A YAML in dir_path with the test assets and small settings; values override or add keys."""
    d, hf = assets
    mt = {
        "stage": "sft",
        "data_path": str(d / "data" / "sft"),
        "tokenizer_name_or_path": hf,
        "load": str(d / "base"),
        "save": str(dir_path / "ckpt"),
        "run_dir": str(dir_path / "run"),
        "world_size": WORLD,
        "micro_batch_size": 1,
        "global_batch_size": 8,
        "seq_length": 96,
        "train_iters": 2,
        "lr": 3.0e-3,
        "lr_decay_style": "constant",
        "use_tensorboard": False,
        "seed": 7,
    }
    mt.update(values)
    os.makedirs(dir_path, exist_ok=True)
    (dir_path / f"{name}.yaml").write_text(yaml.safe_dump({"megatron_training": mt}))
    return str(dir_path)


def run(pool, dir_path, assets, *overrides: str, **values) -> sft.SFTResult:
    path = write_config(dir_path, assets, **values)
    cfg = load_sft_config("sft_test", path, list(overrides))
    return sft.train_sft(cfg, pool=pool, log=lambda line: None)


# ------------------------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """One 12-step run at TP1 x DP4 with a validation split, evaluated every 4 steps."""
    out = tmp_path_factory.mktemp("sft_run")
    result = run(
        shared_pool(), out, assets, train_iters=12, split="80,20,0", eval_interval=4, eval_iters=1, micro_batch_size=2
    )
    return out, result


def test_loss_decreases_and_metrics_are_logged(trained):
    out, result = trained
    losses = [m["sft/loss"] for m in result.history]
    assert np.mean(losses[-3:]) < 0.5 * losses[0], losses
    vals = [m["sft/val_loss"] for m in result.history if "sft/val_loss" in m]
    assert len(vals) == 3 and vals[-1] < 0.5 * vals[0], vals
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == list(range(1, 13))
    for key in ("sft/loss", "sft/lr", "sft/grad_norm", "sft/tokens_per_s", "timing/iteration"):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert rows[0]["sft/lr"] == pytest.approx(3e-3)


def test_first_loss_is_the_response_token_mean_of_a_transformers_reference(trained, assets):
    """The first step's loss (before any update) equals the token mean of the cross entropy over the response
    tokens only, computed with transformers on the same samples: prompt tokens carry no loss."""
    from transformers import AutoModelForCausalLM

    from mindrl.data.prompt_dataset import ResumableShuffleSampler

    _, result = trained
    d, hf = assets
    data = sft.SFTDataset(str(d / "data" / "sft"), "80,20,0")
    docs = next(iter(ResumableShuffleSampler(data.num("train"), 8, seed=7)))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    total, count, with_prompt = 0.0, 0, 0.0
    for doc in docs:
        ids, labels = data.sample(data.doc("train", doc))
        logits = model(torch.as_tensor(ids)[None]).logits[0, :-1]
        ce = torch.nn.functional.cross_entropy(logits, torch.as_tensor(ids[1:]), reduction="none")
        response = torch.as_tensor(labels[1:] != -100)
        total += ce[response].sum().item()
        count += int(response.sum())
        with_prompt += ce.sum().item()
    reference = total / count
    assert result.history[0]["sft/loss"] == pytest.approx(reference, abs=1e-5)
    assert result.history[0]["sft/loss_tokens"] == count
    assert abs(with_prompt / sum(len(data.sample(data.doc("train", i))[0]) - 1 for i in docs) - reference) > 0.01


def test_prompt_labels_do_not_change_the_loss(assets):
    """collate + the loss function: relabelling prompt (and padding) positions leaves the loss bit-identical;
    relabelling one response position changes it."""
    from transformers import AutoModelForCausalLM

    d, hf = assets
    data = sft.SFTDataset(str(d / "data" / "sft"))
    samples = [data.sample(i) for i in range(3)]
    mb = sft.collate(samples, width=96, pad_token_id=0)
    prompt_len = int((samples[0][1] == -100).sum())
    # Position t predicts token t+1: the mask starts one before the first response token, ends before the last.
    assert mb["loss_mask"][0].nonzero().flatten().tolist() == list(range(prompt_len - 1, len(samples[0][0]) - 1))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    logits = model(mb["input_ids"], attention_mask=mb["attention_mask"]).logits

    def loss(labels: torch.Tensor) -> float:
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        value, _ = sft._loss_func({**mb, "labels": labels}, 1.0, per_token)
        return value.item()

    base = loss(mb["labels"])
    changed = mb["labels"].clone()
    off = mb["loss_mask"] == 0
    changed[off] = torch.randint(0, 500, (int(off.sum()),), generator=torch.Generator().manual_seed(0))
    assert loss(changed) == base
    changed[0, prompt_len] = (changed[0, prompt_len] + 1) % 500
    assert loss(changed) != base


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tp2_and_pp2_match_tp1(pool, assets, tmp_path, tp, pp):
    """First step's loss and grad norm at TP2 x DP2 and PP2 x DP2 equal TP1 x DP4 within 1e-5 (micro-batches of
    1 and 2: the normalisation by the global token count makes the split irrelevant)."""
    ref = run(pool, tmp_path / "tp1", assets, micro_batch_size=1).history
    got = run(pool, tmp_path / f"tp{tp}pp{pp}", assets, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, micro_batch_size=2).history  # fmt: skip
    for key in ("sft/loss", "sft/grad_norm", "sft/loss_tokens"):
        assert got[0][key] == pytest.approx(ref[0][key], abs=1e-5), key
    assert got[1]["sft/loss"] == pytest.approx(ref[1]["sft/loss"], abs=1e-4)


def test_recomputation_leaves_the_steps_unchanged(pool, assets, tmp_path):
    """mindrl-sft with full recomputation (every layer its own chunk) and with the activation function recomputed:
    the two steps' loss and grad norm equal the run without recomputation (fp32 on CPU, 1e-6 relative)."""
    ref = run(pool, tmp_path / "plain", assets).history
    got = run(pool, tmp_path / "recompute", assets, recompute_granularity="full", recompute_method="uniform",
              recompute_num_layers=1, recompute_activation_function=True).history  # fmt: skip
    for step in (0, 1):
        for key in ("sft/loss", "sft/grad_norm"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-6), (step, key)


def test_checkpoint_loads_and_converts(pool, trained, assets, tmp_path):
    """The saved checkpoint (tracker = the last step, hf_files carried over) loads with build_and_load at TP2
    and converts with mcore2hf to an HF model whose logits match megatron's; the weights did change."""
    from transformers import AutoModelForCausalLM

    from mindrl.checkpoint import convert, mcore_ckpt

    out, result = trained
    save = result.save_dir
    assert mcore_ckpt.read_tracker(save) == 12 and result.saved_iterations == [12]
    assert os.path.isfile(os.path.join(save, "hf_files", "tokenizer.json"))
    ids = torch.randint(0, 900, (2, 24), generator=torch.Generator().manual_seed(3))
    ours = convert.megatron_outputs(pool, save, 2, 1, ids)  # build_and_load at TP2
    convert.mcore2hf(save, str(tmp_path / "hf"), pool=pool)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert os.path.isfile(tmp_path / "hf" / f), f
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    _, base_hf = assets
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(base_hf, dtype=torch.float32)(ids).logits
    assert (theirs - before).abs().max().item() > 0.1


def test_lora_trains_only_the_adapters(pool, assets, tmp_path):
    """mindrl-sft with LoRA keys at TP2 x DP2: the checkpoint holds the base backbone bit for bit and every adapter's B
    moved off its zero start; the meta records the adapters (what mindrl-train and mindrl-convert rebuild them from);
    only the adapters are trained parameters (megatron's optimizer holds what requires a gradient)."""
    from mindrl.checkpoint import mcore_ckpt
    from tests.trainer.rl_helpers import checkpoint_tensors

    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    lines: list[str] = []
    path = write_config(tmp_path, assets, tensor_model_parallel_size=2, lora_target_modules=targets, lora_r=4,
                        lora_alpha=8, micro_batch_size=2)  # fmt: skip
    result = sft.train_sft(load_sft_config("sft_test", path, []), pool=pool, log=lines.append)
    assert "of them trained: LoRA" in lines[0], lines[0]
    _, meta = mcore_ckpt.read_model_meta(result.save_dir)
    assert meta["lora"] == {"lora_r": 4, "lora_alpha": 8.0, "lora_target_modules": targets}
    (tmp_path / "scratch").mkdir()
    base = checkpoint_tensors(assets[0] / "base", tmp_path / "scratch")
    saved = checkpoint_tensors(tmp_path / "ckpt", tmp_path / "scratch")
    assert set(base) < set(saved)
    assert all(torch.equal(base[k], saved[k]) for k in base), [k for k in base if not torch.equal(base[k], saved[k])]
    b = [k for k in saved if ".lora.lora_B." in k]
    assert len(b) == 4, b  # one per target, its layers stacked on axis 0: every layer's B moved
    assert all(bool((saved[k].flatten(1).abs().amax(1) > 0).all()) for k in b), b
    assert all(np.isfinite(m["sft/loss"]) for m in result.history)


# ------------------------------------------------------------------------------------------------ config


def test_bad_config_names_the_key_and_the_file(assets, tmp_path):
    path = write_config(tmp_path, assets, lrr=1e-3)
    with pytest.raises(
        ConfigError, match=r"megatron_training\.lrr: unknown key; did you mean 'lr' or 'lora_r'\? \[.*sft_test\.yaml\]"
    ):
        load_sft_config("sft_test", path)
    path = write_config(tmp_path, assets)
    with pytest.raises(
        ConfigError, match=r"lr_decay: unknown key; did you mean .*\[override 'megatron_training.lr_decay=x'\]"
    ):
        load_sft_config("sft_test", path, ["megatron_training.lr_decay=x"])
    with pytest.raises(ConfigError, match=r"did you mean 'megatron_training.lr'"):
        load_sft_config("sft_test", path, ["lr=1e-4"])
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size: 6 is not divisible by DP x micro_batch_size = 4 x 1.*gbs/sft_test\.yaml\]",
    ):
        load_sft_config("sft_test", write_config(tmp_path / "gbs", assets, global_batch_size=6))
    tp3 = ["megatron_training.tensor_model_parallel_size=3", "megatron_training.world_size=3"]
    with pytest.raises(
        ConfigError,
        match=r"tensor_model_parallel_size: .*TP=3 does not divide.*\[override 'megatron_training.tensor_model_parallel_size=3'\]",
    ):
        load_sft_config("sft_test", path, tp3)
    with pytest.raises(
        ConfigError, match=r"megatron_training\.load: megatron checkpoint directory '/nonexistent' does not exist"
    ):
        load_sft_config("sft_test", path, ["megatron_training.load=/nonexistent"])
    with pytest.raises(ConfigError, match=r"megatron_training\.lr: expected a number, got 'fast'"):
        load_sft_config("sft_test", path, ["megatron_training.lr=fast"])
    with pytest.raises(ConfigError, match=r"split: a comma-separated value needs quotes"):
        load_sft_config("sft_test", path, ["megatron_training.split=95,5,0"])
    with pytest.raises(ConfigError, match=r"no config 'sft_tset' .*did you mean 'sft_test'"):
        load_sft_config("sft_tset", path)
    # Activation recomputation: megatron's rules, at load and (layers per stage) against the checkpoint's model.
    assert load_sft_config("sft_test", path, ["megatron_training.recompute_granularity=selective"]).megatron_training
    with pytest.raises(ConfigError, match=r"recompute_method: is required with recompute_granularity: full"):
        load_sft_config("sft_test", path, ["megatron_training.recompute_granularity=full",
                                           "megatron_training.recompute_num_layers=1"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"recompute_num_layers: .*layers per .*\(the model in"):
        load_sft_config("sft_test", path, ["megatron_training.recompute_granularity=full",
                                           "megatron_training.recompute_method=block",
                                           "megatron_training.recompute_num_layers=99"])  # fmt: skip
    # Both problems at once, each with its source.
    with pytest.raises(ConfigError, match=r"(?s)2 problems.*stage: must be 'sft'.*seq_length: must be >= 1"):
        load_sft_config("sft_test", path, ["megatron_training.stage=pt", "megatron_training.seq_length=0"])


def test_cli_help_and_config_error(assets, tmp_path, capsys):
    from mindrl.cli.sft import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "megatron_training" in capsys.readouterr().out
    path = write_config(tmp_path, assets)
    assert main(["--config-name", "sft_test", "--config-path", path, "megatron_training.eval_interval=5"]) == 2
    assert "eval_interval: 5 needs a validation split" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["sft_tiny_cpu", "sft_smollm2_cpu"])
def test_shipped_config_parses(name):
    cfg = load_sft_config(name, check_paths=False)
    assert cfg.megatron_training.stage == "sft" and cfg.megatron_training.save.endswith("actor_sft")


def test_smollm2_lora_sft_is_the_full_sft_through_the_grpo_adapters():
    """configs/sft_smollm2_lora_cpu.yaml (`grpo_smollm2_cpu.sh lora`'s warm start) is sft_smollm2_cpu through adapters:
    only the LoRA keys, the step count, the learning rate and the output paths differ, and its adapters are the ones
    grpo_smollm2_lora_cpu trains on (a checkpoint's adapters must match the loading run's keys)."""
    from mindrl.config import load_config

    full = load_sft_config("sft_smollm2_cpu", check_paths=False).megatron_training.to_dict()
    lora = load_sft_config("sft_smollm2_lora_cpu", check_paths=False).megatron_training.to_dict()
    changed = {k for k in full.keys() | lora.keys() if full.get(k) != lora.get(k)}
    lora_only = {"lora_target_modules", "lora_r", "lora_alpha", "train_iters", "lr", "min_lr", "save", "run_dir"}
    assert changed == lora_only, changed
    assert lora["save"].endswith("/actor_lora_sft") and full["save"].endswith("/actor_sft")
    actor = load_config("grpo_smollm2_lora_cpu").actor_config
    assert (actor.lora_r, actor.lora_alpha, actor.lora_target_modules) == (
        lora["lora_r"], lora["lora_alpha"], lora["lora_target_modules"])  # fmt: skip


def test_lora_keys_are_refused_by_the_other_offline_trainers():
    """mindrl-train-rm (a value head the frozen model would not train) and mindrl-train-dpo (its reference) have no
    LoRA path: their configs refuse the keys, naming them; without targets the other LoRA keys are listed as ignored."""
    from mindrl.preflight import load_dpo_config, load_rm_config

    lora = ["megatron_training.lora_target_modules=[linear_qkv]"]
    for load, name in ((load_rm_config, "rm_tiny_cpu"), (load_dpo_config, "dpo_tiny_cpu")):
        with pytest.raises(ConfigError, match="lora_target_modules: LoRA is implemented for mindrl-sft only"):
            load(name, overrides=lora, check_paths=False)
    cfg = load_sft_config("sft_tiny_cpu", overrides=["megatron_training.lora_r=4"], check_paths=False)
    assert "megatron_training.lora_r" in cfg.ignored_keys, cfg.ignored_keys


def test_quickstart_splits_are_disjoint_and_sft_answers_are_random():
    from tools.make_quickstart_data import make_splits

    sft_rows, rl_rows = make_splits(seed=0)
    assert not {r["problem"] for r in sft_rows} & {r["problem"] for r in rl_rows}
    assert all(r["solution"].endswith(f"\\boxed{{{r['answer']}}}.") for r in sft_rows + rl_rows)
    digits = [[int(c) for c in r["problem"] if c.isdigit()] for r in sft_rows]
    larger = np.mean([int(r["answer"]) == max(d) for r, d in zip(sft_rows, digits)])
    assert all(int(r["answer"]) in d for r, d in zip(sft_rows, digits)) and 0.45 < larger < 0.55
    assert all(int(r["answer"]) == max(int(c) for c in r["problem"] if c.isdigit()) for r in rl_rows)
