"""mindrl-train-rm on the shared 4-rank gloo pool: the Bradley-Terry loss and metrics equal an independent reference
(a loop, and transformers scoring the same pairs), TP2 / PP2 match TP1, the saved value-head checkpoint loads as a
critic and exports to an HF *ForSequenceClassification that scores identically, the tiny task is learnt, and bad
configs name the key."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mindrl.config import ConfigError
from mindrl.preflight import load_rm_config
from mindrl.trainer import reward_model as rm
from tests.conftest import shared_pool

WORLD = 4  # the shared pool's ranks (tests/conftest.py)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def assets(tiny_models, tmp_path_factory):
    """The synthetic preference task (tools/make_preference_data.py), preprocessed with the pairwise handler, and
    the base causal LM and the tiny reward model (value head) as megatron checkpoints."""
    from mindrl.checkpoint import convert
    from mindrl.data.preprocess import preprocess
    from mindrl.data.preprocess_config import PreprocessConfig
    from tools.make_preference_data import make_pairs

    d = tmp_path_factory.mktemp("rm_assets")
    (d / "pref.json").write_text(json.dumps(make_pairs(rows=480, valid_fraction=0.2, seed=0)))
    cfg = PreprocessConfig(
        input=str(d / "pref.json"),
        tokenizer_name_or_path=tiny_models["untied"],
        output_prefix=str(d / "data" / "pref"),
        handler_name="AlpacaStylePairwiseHandler",
        prompt_type="qwen",
    )
    preprocess(cfg, log=io.StringIO())
    convert.hf2mcore(tiny_models["untied"], str(d / "base"), 1, 1, pool=shared_pool())
    convert.hf2mcore(tiny_models["orm"], str(d / "orm"), 1, 1, orm=True, pool=shared_pool())
    return d, tiny_models["untied"]


def write_config(dir_path, assets, name: str = "rm_test", **values) -> str:
    """test_sft's config writer with the reward model's stage and data."""
    from tests.trainer.test_sft import write_config as sft_config

    d, _ = assets
    rm_values = {"stage": "orm", "data_path": str(d / "data" / "pref"), "lr": 1.0e-3, "split": "80,20,0"}
    return sft_config(dir_path, assets, name, **(rm_values | values))


def run(pool, dir_path, assets, *overrides: str, **values):
    cfg = load_rm_config("rm_test", write_config(dir_path, assets, **values), list(overrides))
    return rm.train_reward_model(cfg, pool=pool, log=lambda line: None)


# ------------------------------------------------------------------------------------------------ the loss
def test_bradley_terry_matches_a_loop_reference():
    """Vectorised loss / accuracy / mean scores against a per-pair loop with math.log1p (fp64, 1e-12)."""
    gen = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(64, generator=gen, dtype=torch.float64) * 5, torch.randn(64, generator=gen, dtype=torch.float64) * 5  # fmt: skip
    margin = torch.rand(64, generator=gen, dtype=torch.float64)
    chosen[0] = rejected[0]  # a tie counts as wrong
    got = rm.bradley_terry(chosen, rejected, margin)
    loss = correct = 0.0
    for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist()):
        z = c - r - m
        loss += math.log1p(math.exp(-z)) if z > 0 else -z + math.log1p(math.exp(z))
        correct += 1.0 if c > r else 0.0
    assert got["loss_sum"].item() == pytest.approx(loss, rel=1e-12)
    assert got["correct"].item() == correct and got["pairs"].item() == 64
    assert got["chosen_sum"].item() == pytest.approx(sum(chosen.tolist()), rel=1e-12)


def test_last_token_scores_pick_each_rows_last_real_token():
    values = torch.arange(12.0).view(3, 4, 1)
    assert rm.last_token_scores(values, torch.tensor([3, 0, 2])).tolist() == [3.0, 4.0, 10.0]
    mb = rm.collate_pairs([(np.array([5, 6, 7]), np.array([5, 8]), 0.5)], width=4, pad_token_id=0)
    assert mb["input_ids"].tolist() == [[5, 6, 7, 0], [5, 8, 0, 0]] and mb["last"].tolist() == [2, 1]
    cut = rm.collate_pairs([(np.arange(1, 7), np.array([5, 8]), 0.0)], width=4, pad_token_id=0)
    assert cut["last"].tolist() == [3, 1]


def _hf_scores(hf_dir: str, head: torch.Tensor, seqs: list[np.ndarray], dtype: torch.dtype) -> np.ndarray:
    """transformers' Qwen2ForSequenceClassification (the base trunk, score.weight = head) on each sequence alone."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(hf_dir)
    config.architectures, config.num_labels = ["Qwen2ForSequenceClassification"], 1
    model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    lm = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    model.model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        model.score.weight.copy_(head.to(dtype))
        return np.array([model(torch.tensor(s).view(1, -1)).logits.item() for s in seqs])


def test_first_step_metrics_equal_a_transformers_reference(pool, assets, tmp_path):
    """Step 1's loss, accuracy and mean chosen / rejected scores (before any update) equal transformers scoring
    the same pairs with the same fresh head, the BT loss in fp64: within 1e-6 (the fp32 gap to fp64 is measured
    alongside and is far below)."""
    from mindrl.checkpoint.loading import init_value_head, value_model_spec
    from mindrl.checkpoint.mcore_ckpt import read_model_meta
    from mindrl.data.prompt_dataset import ResumableShuffleSampler

    d, hf = assets
    result = run(pool, tmp_path, assets, "megatron_training.train_iters=1")
    m = result.history[0]
    data = rm.PairwiseDataset(str(d / "data" / "pref"), "80,20,0")
    docs = [data.doc("train", i) for i in next(iter(ResumableShuffleSampler(data.num("train"), 8, seed=7)))]
    pairs = [data.sample(i) for i in docs]

    spec = value_model_spec(read_model_meta(str(d / "base"))[0])

    class _LastStage(torch.nn.Module):  # what init_value_head reads of a model: the last stage's output layer
        post_process = True

        def __init__(self):
            super().__init__()
            self.output_layer = torch.nn.Linear(spec.hidden_size, 1, bias=False)

    head = _LastStage()
    init_value_head(head, spec)
    seqs = [p[0] for p in pairs] + [p[1] for p in pairs]
    ref64 = _hf_scores(hf, head.output_layer.weight.detach().double(), seqs, torch.float64)
    ref32 = _hf_scores(hf, head.output_layer.weight.detach(), seqs, torch.float32)
    chosen, rejected = torch.tensor(ref64[:8]), torch.tensor(ref64[8:])
    ref = rm.bradley_terry(chosen, rejected, torch.tensor([p[2] for p in pairs], dtype=torch.float64))
    fp32_gap = float(np.abs(ref32 - ref64).max())
    print(
        f"loss {m['rm/loss']:.9f} vs transformers fp64 {ref['loss_sum'].item() / 8:.9f}; fp32 score gap {fp32_gap:.2e}"
    )
    assert fp32_gap < 1e-6
    assert m["rm/loss"] == pytest.approx(ref["loss_sum"].item() / 8, abs=1e-6)
    assert m["rm/accuracy"] == ref["correct"].item() / 8
    assert m["rm/chosen_score"] == pytest.approx(chosen.mean().item(), abs=1e-6)
    assert m["rm/rejected_score"] == pytest.approx(rejected.mean().item(), abs=1e-6)
    assert abs(m["rm/chosen_score"]) > 1e-4  # the fresh head is not zero: the comparison means something


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tp2_and_pp2_match_tp1(pool, assets, tmp_path, tp, pp):
    """The first two steps' loss (and step 1's grad norm) at TP2 x DP2 and PP2 x DP2 equal TP1 x DP4's; the bound
    is the gap between two TP1 runs that cut the batch differently (micro-batches of 1 and 2 pairs), measured
    here, with fp32's rounding of the loss (1e-6) as its floor."""
    ref = run(pool, tmp_path / "tp1", assets, micro_batch_size=1).history
    ref2 = run(pool, tmp_path / "tp1mb2", assets, micro_batch_size=2).history
    gap = max(abs(ref2[i]["rm/loss"] - ref[i]["rm/loss"]) for i in (0, 1))
    bound = 10 * max(gap, 1e-6)
    got = run(pool, tmp_path / f"tp{tp}pp{pp}", assets, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, micro_batch_size=2).history  # fmt: skip
    print(
        f"TP{tp} PP{pp}: loss gaps {[abs(got[i]['rm/loss'] - ref[i]['rm/loss']) for i in (0, 1)]}, TP1 cut gap {gap:.2e}"
    )
    for i in (0, 1):
        assert got[i]["rm/loss"] == pytest.approx(ref[i]["rm/loss"], abs=bound), (i, gap)
        assert got[i]["rm/accuracy"] == ref[i]["rm/accuracy"]
    assert got[0]["rm/grad_norm"] == pytest.approx(ref[0]["rm/grad_norm"], rel=1e-4)


def test_value_head_checkpoint_trains_from_its_own_head(pool, assets, tmp_path):
    """Starting from a value-head checkpoint keeps its head: step 1's scores are that model's (nonzero, finite)."""
    result = run(pool, tmp_path, assets, "megatron_training.train_iters=1", load=str(assets[0] / "orm"))
    m = result.history[0]
    assert np.isfinite(m["rm/loss"]) and m["rm/chosen_score"] != 0.0


def test_tied_causal_lm_gets_an_untied_head_at_tp2(pool, assets, tmp_path, tiny_models):
    """A causal LM with tied embeddings (no output layer in its checkpoint) starts at TP2 with a fresh head; the save
    is an untied value model."""
    from mindrl.checkpoint import convert, mcore_ckpt

    convert.hf2mcore(tiny_models["tied"], str(tmp_path / "tied"), 1, 1, pool=pool)
    result = run(pool, tmp_path, assets, "megatron_training.train_iters=1", load=str(tmp_path / "tied"),
                 tensor_model_parallel_size=2)  # fmt: skip
    assert np.isfinite(result.history[0]["rm/loss"]) and result.history[0]["rm/chosen_score"] != 0.0
    spec, meta = mcore_ckpt.read_model_meta(result.save_dir)
    assert meta["role"] == "critic" and spec.is_value_model and not spec.tie_word_embeddings


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """The CLI, one rank, on the tiny task: 60 steps, validation every 10 (the held-out problems)."""
    out = tmp_path_factory.mktemp("rm_run")
    path = write_config(out, assets, world_size=1, micro_batch_size=16, global_batch_size=16, train_iters=60,
                        eval_interval=10, eval_iters=2, lr_warmup_iters=5, lr_decay_style="cosine")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-m", "mindrl.cli.train_rm", "--config-name", "rm_test", "--config-path",
                           path], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_tiny_task_is_learnt_and_metrics_are_logged(trained):
    out, stdout = trained
    print(stdout)
    line = next(x for x in stdout.splitlines() if x.startswith("reward model held-out accuracy: "))
    assert float(line.split(": ")[1]) >= 0.8, stdout
    assert stdout.splitlines()[-1] == f"run dir: {out / 'run'}"
    rows = [json.loads(x) for x in open(out / "run" / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == list(range(1, 61))
    for key in ("rm/loss", "rm/accuracy", "rm/chosen_score", "rm/rejected_score", "rm/grad_norm", "rm/lr"):
        assert all(np.isfinite(r[key]) for r in rows), key
    val = [r["rm/val_accuracy"] for r in rows if "rm/val_accuracy" in r]
    assert len(val) == 6 and val[-1] >= 0.8 and val[-1] > val[0] - 1e-9, val
    assert np.mean([r["rm/loss"] for r in rows[-5:]]) < np.mean([r["rm/loss"] for r in rows[:5]])


def test_checkpoint_is_a_critic_and_exports_to_transformers(pool, trained, assets, tmp_path):
    """The save loads as a critic (build_and_load at TP2) and mcore2hf --orm writes a Qwen2ForSequenceClassification
    whose score of right-padded texts (at the last non-pad token, as transformers picks it) equals megatron's value
    at each row's last real token within 1e-5."""
    from transformers import AutoModelForSequenceClassification

    from mindrl.checkpoint import convert, mcore_ckpt

    out, _ = trained
    save = str(out / "ckpt")
    spec, meta = mcore_ckpt.read_model_meta(save)
    assert meta["role"] == "critic" and spec.architecture == "Qwen2ForSequenceClassification"
    data = rm.PairwiseDataset(str(assets[0] / "data" / "pref"), "80,20,0")
    samples = [data.sample(data.doc("valid", i)) for i in range(4)]
    with open(os.path.join(save, "hf_files", "config.json")) as f:
        pad = json.load(f)["pad_token_id"]
    mb = rm.collate_pairs(samples, width=96, pad_token_id=pad)
    values = convert.megatron_outputs(pool, save, 2, 1, mb["input_ids"])  # causal: padding after a row is unseen
    ours = rm.last_token_scores(values, mb["last"])
    convert.mcore2hf(save, str(tmp_path / "hf"), orm=True, pool=pool)
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, 0]
    print(f"export: max |megatron - transformers| score {(ours - theirs).abs().max().item():.2e}")
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (ours[:4] > ours[4:]).float().mean().item() >= 0.75  # the trained model prefers the chosen answers


# ------------------------------------------------------------------------------------------------ config
def test_bad_config_names_the_key(assets, tmp_path):
    path = write_config(tmp_path, assets)
    with pytest.raises(ConfigError, match=r"stage: must be 'orm' \(mindrl-train-rm trains"):
        load_rm_config("rm_test", path, ["megatron_training.stage=sft"])
    sft_like = str(tmp_path / "nodata")
    with pytest.raises(ConfigError, match=r"data_path: .*chosen_input_ids_document.*AlpacaStylePairwiseHandler"):
        load_rm_config("rm_test", path, [f"megatron_training.data_path={sft_like}"])
    with pytest.raises(ConfigError, match=r"megatron_training\.lrr: unknown key; did you mean 'lr'"):
        load_rm_config("rm_test", write_config(tmp_path / "typo", assets, lrr=1.0))
    cfg = load_rm_config("rm_test", write_config(tmp_path / "ms", assets, is_pairwise_dataset=True))
    assert cfg.ignored_keys == ["megatron_training.is_pairwise_dataset"]


def test_cli_help_and_shipped_config(capsys):
    from mindrl.cli.train_rm import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "Bradley-Terry" in capsys.readouterr().out
    cfg = load_rm_config("rm_tiny_cpu", check_paths=False)
    assert cfg.megatron_training.stage == "orm" and cfg.megatron_training.split == "90,10,0"
