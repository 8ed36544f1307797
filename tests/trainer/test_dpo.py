"""mindrl-train-dpo on the shared 4-rank gloo pool: the DPO loss equals a per-pair loop (fp64), step 1's log-probs equal
transformers', TP2 / PP2 match TP1, the tiny preference task is learnt (held-out reward accuracy and margin rise) and
the save exports to transformers, and bad configs name the key."""

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

from mindrl.algorithms.dpo import dpo_loss, dpo_stats
from mindrl.config import ConfigError
from mindrl.preflight import load_dpo_config
from mindrl.trainer import dpo
from tests.conftest import shared_pool

WORLD = 4  # the shared pool's ranks (tests/conftest.py)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def assets(tiny_models, tmp_path_factory):
    """The synthetic preference task (tools/make_preference_data.py) preprocessed with the pairwise handler, and the
    tiny causal LM as a megatron checkpoint (the policy's start and the reference)."""
    from mindrl.checkpoint import convert
    from mindrl.data.preprocess import preprocess
    from mindrl.data.preprocess_config import PreprocessConfig
    from tools.make_preference_data import make_pairs

    d = tmp_path_factory.mktemp("dpo_assets")
    (d / "pref.json").write_text(json.dumps(make_pairs(rows=480, valid_fraction=0.2, seed=0)))
    cfg = PreprocessConfig(input=str(d / "pref.json"), tokenizer_name_or_path=tiny_models["untied"],
                           output_prefix=str(d / "data" / "pref"), handler_name="AlpacaStylePairwiseHandler",
                           prompt_type="qwen")  # fmt: skip
    preprocess(cfg, log=io.StringIO())
    convert.hf2mcore(tiny_models["untied"], str(d / "base"), 1, 1, pool=shared_pool())
    return d, tiny_models["untied"]


def write_config(dir_path, assets, name: str = "dpo_test", **values) -> str:
    """test_sft's config writer with DPO's stage and data."""
    from tests.trainer.test_sft import write_config as sft_config

    d, _ = assets
    dpo_values = {"stage": "dpo", "data_path": str(d / "data" / "pref"), "lr": 1.0e-3, "split": "80,20,0",
                  "dpo_beta": 0.1}  # fmt: skip
    return sft_config(dir_path, assets, name, **(dpo_values | values))


def run(pool, dir_path, assets, *overrides: str, **values):
    cfg = load_dpo_config("dpo_test", write_config(dir_path, assets, **values), list(overrides))
    return dpo.train_dpo(cfg, pool=pool, log=lambda line: None)


def test_tiny_qwen3_moe_trains(pool, tmp_path):
    """DPO on a 3-layer tiny Qwen3-MoE (configs/model/tiny_qwen3_moe.yaml's, from its HF checkpoint) at DP4, TP2 x DP2
    and PP2 x DP2 with uneven stages (num_layer_list 2,1): megatron's MoE layers in the policy and the reference; the
    first step's loss is log 2 (policy = reference) and the second step's moves (the first update trained the experts
    and routers). The uneven stages agree with DP4 within 4x TP2's own gap from DP4. A num_layer_list that does not
    sum to the model's layers and noop_layers are refused, naming the key."""
    from mindrl.checkpoint import convert
    from mindrl.data.preprocess import preprocess
    from mindrl.data.preprocess_config import PreprocessConfig
    from tools.make_preference_data import make_pairs
    from tools.make_tiny_model import make_tiny_model

    hf = make_tiny_model(str(tmp_path / "hf"), arch="qwen3_moe", num_layers=3)
    (tmp_path / "pref.json").write_text(json.dumps(make_pairs(rows=64, valid_fraction=0.0, seed=0)))
    preprocess(PreprocessConfig(input=str(tmp_path / "pref.json"), tokenizer_name_or_path=hf,
                                output_prefix=str(tmp_path / "data" / "pref"), handler_name="AlpacaStylePairwiseHandler",
                                prompt_type="qwen3"), log=io.StringIO())  # fmt: skip
    convert.hf2mcore(hf, str(tmp_path / "base"), 1, 1, pool=pool)
    moe_assets = (tmp_path, hf)
    layouts = {"dp4": {}, "tp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
               "pp2": {"pipeline_model_parallel_size": 2, "num_layer_list": "2,1"}}  # fmt: skip
    keys = ("dpo/loss", "dpo/rewards/margin", "dpo/logps/chosen", "dpo/logps/rejected", "dpo/grad_norm")
    runs = {}
    for name, values in layouts.items():
        result = run(pool, tmp_path / name, moe_assets, "megatron_training.train_iters=2", split="100,0,0", **values)
        runs[name] = [result.history[0]["dpo/grad_norm"]] + [result.history[1][k] for k in keys]
        first, second = result.history
        assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
        assert first["dpo/grad_norm"] > 0 and math.isfinite(second["dpo/loss"])
        assert second["dpo/loss"] != pytest.approx(math.log(2), abs=1e-5)
    print(runs)

    def gap(name: str) -> float:  # relative, over step 1's grad norm and step 2's metrics
        return max(abs(x - y) / abs(y) for x, y in zip(runs[name], runs["dp4"]))

    assert 0 < gap("tp2") and gap("pp2") <= 4 * gap("tp2"), (gap("pp2"), gap("tp2"))
    for values, key, words in (
        ({"pipeline_model_parallel_size": 2, "num_layer_list": "1,1"}, "megatron_training.num_layer_list",
         "gives 2 layers in all"),
        ({"noop_layers": "1"}, "megatron_training.noop_layers", "builds no identity layers"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            load_dpo_config("dpo_test", write_config(tmp_path / "bad", moe_assets, **values))
        assert any(i.key == key and words in i.message for i in err.value.issues), str(err.value)


# ------------------------------------------------------------------------------------------------ the loss
def _loop_loss(pc, pr, rc, rr, beta, ls, loss_type) -> float:
    """One pair's loss written out with math (log sigmoid(z) = -log1p(exp(-z)), stable either side)."""

    def log_sigmoid(z: float) -> float:
        return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))

    h = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":
        return -(1 - ls) * log_sigmoid(beta * h) - ls * log_sigmoid(-beta * h)
    if loss_type == "hinge":
        return max(0.0, 1 - beta * h)
    return (h - 1 / (2 * beta)) ** 2


@pytest.mark.parametrize("loss_type,beta,ls,ftx", [("sigmoid", 0.1, 0.0, 0.0), ("sigmoid", 0.5, 0.2, 0.0),
                                                   ("hinge", 0.3, 0.0, 0.0), ("ipo", 0.25, 0.0, 0.0),
                                                   ("sigmoid", 0.1, 0.0, 0.5), ("ipo", 0.25, 0.0, 2.0)])  # fmt: skip
def test_dpo_loss_matches_a_loop_reference(loss_type, beta, ls, ftx):
    """Vectorised losses, rewards and summed metrics against a per-pair loop (fp64, within 1e-6; measured ~1e-15);
    with pref_ftx the loop adds ftx x the chosen response's per-token NLL (MindSpeed-LLM's sft_loss)."""
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(64, generator=gen, dtype=torch.float64) * 40 for _ in range(4))
    pc[0], pr[0], rc[0], rr[0] = -5.0, -5.0, -7.0, -7.0  # a tie: zero margin counts as wrong
    tokens = torch.randint(1, 30, (64,), generator=gen)
    terms = dpo_loss(pc, pr, rc, rr, beta, ls, loss_type, ftx, tokens)
    stats = dpo_stats(terms, pc, pr)
    ref = [_loop_loss(a, b, c, d, beta, ls, loss_type) + ftx * (-a / n)
           for a, b, c, d, n in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), tokens.tolist())]  # fmt: skip
    err = max(abs(a - b) for a, b in zip(terms["loss"].tolist(), ref))
    print(f"{loss_type}: max |vectorised - loop| {err:.2e}")
    assert err <= 1e-6 and abs(stats["loss_sum"].item() - sum(ref)) <= 1e-6
    rewards = [
        (beta * (a - c), beta * (b - d)) for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist())
    ]
    assert stats["correct"].item() == sum(1.0 for c, r in rewards if c > r) and stats["pairs"].item() == 64
    assert stats["margin_sum"].item() == pytest.approx(sum(c - r for c, r in rewards), abs=1e-9)
    assert stats["chosen_logp_sum"].item() == pytest.approx(sum(pc.tolist()), abs=1e-9)
    nll = sum(-a / n for a, n in zip(pc.tolist(), tokens.tolist()))
    assert stats["sft_loss_sum"].item() == pytest.approx(nll, abs=1e-9)  # logged whatever pref_ftx
    with pytest.raises(ValueError, match="unknown dpo_loss_type 'kto'"):
        dpo_loss(pc, pr, rc, rr, beta, 0.0, "kto")
    with pytest.raises(ValueError, match="pref_ftx needs chosen_tokens"):
        dpo_loss(pc, pr, rc, rr, beta, 0.0, loss_type, 0.5)


def test_sequence_logps_sum_the_response_tokens_only():
    """collate's loss mask covers exactly the response tokens (labels != -100), shifted to the predicting position."""
    ids, labels = np.array([5, 6, 7, 8, 9]), np.array([-100, -100, 7, 8, 9])
    mb = dpo.collate([(ids, labels)], width=6, pad_token_id=0)
    assert mb["loss_mask"].tolist() == [[0, 1, 1, 1, 0, 0]] and mb["labels"][0, 1:4].tolist() == [7, 8, 9]
    nll = torch.arange(6.0).view(1, 6)
    assert dpo.sequence_logps(nll, mb["loss_mask"]).tolist() == [-(1.0 + 2.0 + 3.0)]


def _hf_logps(hf_dir: str, seqs: list[tuple[np.ndarray, np.ndarray]], dtype: torch.dtype) -> np.ndarray:
    """transformers' summed log-probabilities of each sequence's response tokens (labels != -100), one at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    out = []
    with torch.no_grad():
        for ids, labels in seqs:
            logits = model(torch.tensor(ids).view(1, -1)).logits[0, :-1]
            lp = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(1)
            out.append(float(lp[torch.tensor(labels[1:] != -100)].sum()))
    return np.array(out)


def test_first_step_equals_a_transformers_reference(pool, assets, tmp_path):
    """Step 1 (before any update: policy = reference): the mean chosen / rejected log-probs equal transformers' fp64
    sums over the same pairs' response tokens within the fp32 gap measured alongside; the rewards are then ~0 and
    the loss log 2 (sigmoid), accuracy 0 (ties count as wrong)."""
    from mindrl.data.prompt_dataset import ResumableShuffleSampler

    d, hf = assets
    m = run(pool, tmp_path, assets, "megatron_training.train_iters=1").history[0]
    data = dpo.DPODataset(str(d / "data" / "pref"), "80,20,0")
    docs = [data.doc("train", i) for i in next(iter(ResumableShuffleSampler(data.num("train"), 8, seed=7)))]
    seqs = [data.pair(i)[0] for i in docs] + [data.pair(i)[1] for i in docs]
    ref64, ref32 = _hf_logps(hf, seqs, torch.float64), _hf_logps(hf, seqs, torch.float32)
    gap = float(np.abs(ref32 - ref64).max())
    chosen, rejected = ref64[:8].mean(), ref64[8:].mean()
    print(f"logps chosen {m['dpo/logps/chosen']:.7f} vs HF fp64 {chosen:.7f}; rejected {m['dpo/logps/rejected']:.7f}"
          f" vs {rejected:.7f}; HF fp32 gap {gap:.2e}; loss {m['dpo/loss']:.9f}, margin {m['dpo/rewards/margin']:.2e}")  # fmt: skip
    tol = 4 * max(gap, 1e-6)
    assert m["dpo/logps/chosen"] == pytest.approx(chosen, abs=tol)
    assert m["dpo/logps/rejected"] == pytest.approx(rejected, abs=tol)
    assert abs(m["dpo/rewards/chosen"]) <= 0.1 * tol and abs(m["dpo/rewards/margin"]) <= 0.2 * tol
    assert m["dpo/loss"] == pytest.approx(math.log(2), abs=0.1 * tol)
    assert abs(m["dpo/logps/chosen"] - m["dpo/logps/rejected"]) > 1e-3  # the pairs differ: the check means something


def test_separate_reference_and_pref_ftx_equal_a_transformers_reference(pool, assets, tiny_models, tmp_path):
    """ref_model: another checkpoint (the tiny 'tied' variant, other weights) as the frozen reference, with
    pref_ftx 0.5: step 1's loss, rewards and SFT term equal those computed from transformers' fp64 log-probs of the
    policy and of the reference on the same pairs, within 4x the fp32-vs-fp64 gap of transformers measured alongside
    (dloss / dlogp <= beta + pref_ftx per log-prob); then a step at PP2 x DP2 (the reference built per stage) gives
    the same step-1 numbers within the same bound."""
    from mindrl.checkpoint import convert
    from mindrl.data.prompt_dataset import ResumableShuffleSampler

    d, hf = assets
    ref_hf = tiny_models["tied"]
    convert.hf2mcore(ref_hf, str(tmp_path / "ref"), 1, 1, pool=pool)
    beta, ftx = 0.1, 0.5
    over = [f"+megatron_training.ref_model={tmp_path / 'ref'}", f"+megatron_training.pref_ftx={ftx}",
            "megatron_training.train_iters=1"]  # fmt: skip
    m = run(pool, tmp_path / "tp1", assets, *over).history[0]
    data = dpo.DPODataset(str(d / "data" / "pref"), "80,20,0")
    docs = [data.doc("train", i) for i in next(iter(ResumableShuffleSampler(data.num("train"), 8, seed=7)))]
    seqs = [data.pair(i)[0] for i in docs] + [data.pair(i)[1] for i in docs]
    pol64, ref64 = _hf_logps(hf, seqs, torch.float64), _hf_logps(ref_hf, seqs, torch.float64)
    gap = max(float(np.abs(_hf_logps(h, seqs, torch.float32) - x).max()) for h, x in ((hf, pol64), (ref_hf, ref64)))
    tokens = np.array([float((labels[1:] != -100).sum()) for _, labels in seqs[:8]])
    pc, pr, rc, rr = (torch.tensor(x, dtype=torch.float64) for x in (pol64[:8], pol64[8:], ref64[:8], ref64[8:]))
    want = dpo_loss(pc, pr, rc, rr, beta, 0.0, "sigmoid", ftx, torch.tensor(tokens))
    loop = [_loop_loss(a, b, c, e, beta, 0.0, "sigmoid") + ftx * (-a / n)
            for a, b, c, e, n in zip(*(t.tolist() for t in (pc, pr, rc, rr)), tokens.tolist())]  # fmt: skip
    assert want["loss"].mean().item() == pytest.approx(sum(loop) / 8, abs=1e-12)  # the formula, independently
    tol = 4 * max(gap, 1e-6)
    print(f"loss {m['dpo/loss']:.9f} vs HF fp64 {sum(loop) / 8:.9f}; sft {m['dpo/sft_loss']:.7f}; chosen reward "
          f"{m['dpo/rewards/chosen']:.6f}; HF fp32 gap {gap:.2e}")  # fmt: skip
    assert m["dpo/loss"] == pytest.approx(sum(loop) / 8, abs=tol)
    assert m["dpo/sft_loss"] == pytest.approx(want["sft_loss"].mean().item(), abs=tol)
    assert m["dpo/rewards/chosen"] == pytest.approx(want["chosen_rewards"].mean().item(), abs=tol)
    assert m["dpo/rewards/margin"] == pytest.approx((want["chosen_rewards"] - want["rejected_rewards"]).mean().item(),
                                                    abs=tol)  # fmt: skip
    assert abs(m["dpo/rewards/chosen"]) > 100 * tol  # the reference differs from the policy: the check means something
    got = run(pool, tmp_path / "pp2", assets, *over, pipeline_model_parallel_size=2, micro_batch_size=2).history[0]
    for k in ("dpo/loss", "dpo/sft_loss", "dpo/rewards/margin"):
        assert got[k] == pytest.approx(m[k], abs=tol), k


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tp2_and_pp2_match_tp1(pool, assets, tmp_path, tp, pp):
    """The first two steps' loss and margin (step 2 after an update) at TP2 x DP2 and PP2 x DP2 equal TP1 x DP4's;
    the bound is the gap between two TP1 runs that cut the batch differently (micro-batches of 1 and 2 pairs),
    measured here, with fp32's rounding of the loss (1e-6) as its floor."""
    ref = run(pool, tmp_path / "tp1", assets, micro_batch_size=1).history
    ref2 = run(pool, tmp_path / "tp1mb2", assets, micro_batch_size=2).history
    gap = max(abs(ref2[i][k] - ref[i][k]) for i in (0, 1) for k in ("dpo/loss", "dpo/rewards/margin"))
    bound = 10 * max(gap, 1e-6)
    got = run(pool, tmp_path / f"tp{tp}pp{pp}", assets, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, micro_batch_size=2).history  # fmt: skip
    gaps = [abs(got[i]["dpo/loss"] - ref[i]["dpo/loss"]) for i in (0, 1)]
    print(f"TP{tp} PP{pp}: loss gaps {gaps}, TP1 cut gap {gap:.2e}; step-2 loss {ref[1]['dpo/loss']:.6f}")
    assert ref[1]["dpo/loss"] < ref[0]["dpo/loss"] - 10 * bound  # step 2 moved: the comparison means something
    for i in (0, 1):
        for k in ("dpo/loss", "dpo/rewards/margin", "dpo/logps/chosen"):
            assert got[i][k] == pytest.approx(ref[i][k], abs=bound * (1 if k != "dpo/logps/chosen" else 100)), (i, k)
    assert got[0]["dpo/grad_norm"] == pytest.approx(ref[0]["dpo/grad_norm"], rel=1e-4)


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """The CLI, one rank, on the tiny task: 40 steps, validation every 10 (the held-out problems); ~25 s with the
    preprocessing, so not marked slow."""
    out = tmp_path_factory.mktemp("dpo_run")
    path = write_config(out, assets, world_size=1, micro_batch_size=16, global_batch_size=16, train_iters=40,
                        eval_interval=10, eval_iters=6, lr_warmup_iters=5, lr_decay_style="cosine", lr=1e-3,
                        use_tensorboard=True)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-m", "mindrl.cli.train_dpo", "--config-name", "dpo_test", "--config-path",
                           path], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


KEYS = ("dpo/loss", "dpo/rewards/accuracy", "dpo/rewards/margin", "dpo/rewards/chosen", "dpo/rewards/rejected",
        "dpo/logps/chosen", "dpo/logps/rejected", "dpo/sft_loss", "dpo/grad_norm", "dpo/lr")  # fmt: skip


def test_tiny_task_is_learnt_and_metrics_are_logged(trained):
    out, stdout = trained
    print(stdout)
    assert stdout.splitlines()[-1] == f"run dir: {out / 'run'}"
    rows = [json.loads(x) for x in open(out / "run" / "metrics.jsonl")]
    assert [r["iteration"] for r in rows] == list(range(1, 41))
    for key in KEYS:
        assert all(np.isfinite(r[key]) for r in rows), key
    assert os.listdir(out / "run" / "tensorboard")
    val = [(r["dpo/val_rewards/accuracy"], r["dpo/val_rewards/margin"]) for r in rows if "dpo/val_loss" in r]
    # all 96 held-out pairs: chance is 0.5 and this run gives 0.82-0.87 (one pair is 0.01, so the floor leaves room for
    # another CPU's rounding); the first evaluation comes after 10 steps, when much is learnt already
    assert len(val) == 4 and min(a for a, _ in val) >= 0.75 and val[-1][1] > val[0][1], val
    acc = [r["dpo/rewards/accuracy"] for r in rows]
    assert np.mean(acc[-5:]) > np.mean(acc[:5]) + 0.3, acc
    assert np.mean([r["dpo/loss"] for r in rows[-5:]]) < np.mean([r["dpo/loss"] for r in rows[:5]])


def test_checkpoint_exports_and_prefers_the_chosen_answers(pool, trained, assets, tmp_path):
    """The save is an actor; mcore2hf writes a causal LM whose held-out chosen-minus-rejected log-prob margin (HF,
    summed over the response tokens) is larger than the starting model's, and positive on most pairs."""
    from mindrl.checkpoint import convert, mcore_ckpt

    out, _ = trained
    d, hf = assets
    spec, meta = mcore_ckpt.read_model_meta(str(out / "ckpt"))
    assert meta["role"] == "actor" and not spec.is_value_model
    convert.mcore2hf(str(out / "ckpt"), str(tmp_path / "hf"), pool=pool)
    data = dpo.DPODataset(str(d / "data" / "pref"), "80,20,0")
    pairs = [data.pair(data.doc("valid", i)) for i in range(0, data.num("valid"), 3)]
    seqs = [p[0] for p in pairs] + [p[1] for p in pairs]
    n = len(pairs)
    before, after = _hf_logps(hf, seqs, torch.float32), _hf_logps(str(tmp_path / "hf"), seqs, torch.float32)
    m0, m1 = before[:n] - before[n:], after[:n] - after[n:]
    print(f"held-out margin: start {m0.mean():.4f} -> trained {m1.mean():.4f}; positive {np.mean(m1 > 0):.3f}")
    assert m1.mean() > m0.mean() + 1.0 and np.mean(m1 > 0) >= 0.8


# ------------------------------------------------------------------------------------------------ config
def test_bad_config_names_the_key(assets, tmp_path):
    path = write_config(tmp_path, assets)
    with pytest.raises(ConfigError, match=r"stage: must be 'dpo' \(mindrl-train-dpo trains"):
        load_dpo_config("dpo_test", path, ["megatron_training.stage=orm"])
    with pytest.raises(ConfigError, match=r"megatron_training\.dpo_beta: must be > 0, got 0.0"):
        load_dpo_config("dpo_test", path, ["megatron_training.dpo_beta=0.0"])
    with pytest.raises(ConfigError, match=r"dpo_loss_type: 'kto' is not one of sigmoid, hinge, ipo"):
        load_dpo_config("dpo_test", path, ["megatron_training.dpo_loss_type=kto"])
    with pytest.raises(ConfigError, match=r"dpo_label_smoothing: applies to dpo_loss_type sigmoid only"):
        load_dpo_config("dpo_test", path, ["megatron_training.dpo_loss_type=ipo", "megatron_training.dpo_label_smoothing=0.1"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"ref_model: .*the reference: a megatron causal LM"):
        load_dpo_config("dpo_test", path, [f"+megatron_training.ref_model={tmp_path}"])
    with pytest.raises(ConfigError, match=r"megatron_training\.pref_ftx: must be a finite number >= 0, got -1"):
        load_dpo_config("dpo_test", path, ["+megatron_training.pref_ftx=-1"])
    with pytest.raises(ConfigError, match=r"refer_model_iter: 5 is not supported"):
        load_dpo_config("dpo_test", write_config(tmp_path / "iter", assets, refer_model_iter=5))
    with pytest.raises(ConfigError, match=r"data_path: .*chosen_input_ids_document.*AlpacaStylePairwiseHandler"):
        load_dpo_config("dpo_test", path, [f"megatron_training.data_path={tmp_path / 'nodata'}"])
    with pytest.raises(ConfigError, match=r"dpo_test\.yaml"):  # the file is named
        load_dpo_config("dpo_test", write_config(tmp_path / "typo", assets, dpo_betta=0.1))
    ms = write_config(tmp_path / "ms", assets, is_pairwise_dataset=True, ref_model=str(assets[0] / "base"),
                      refer_model_iter=1)  # fmt: skip
    cfg = load_dpo_config("dpo_test", ms)
    assert cfg.ignored_keys == ["megatron_training.is_pairwise_dataset", "megatron_training.refer_model_iter"]


def test_cli_help_shipped_config_and_bad_config_exit(capsys, assets, tmp_path):
    from mindrl.cli.train_dpo import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "direct preference optimisation" in capsys.readouterr().out
    cfg = load_dpo_config("dpo_tiny_cpu", check_paths=False)
    mt = cfg.megatron_training
    assert mt.stage == "dpo" and mt.dpo_loss_type == "sigmoid" and mt.dpo_beta == 0.1 and mt.split == "90,10,0"
    assert cfg.ignored_keys == ["megatron_training.is_pairwise_dataset"]
    path = write_config(tmp_path, assets)
    assert main(["--config-name", "dpo_test", "--config-path", path, "megatron_training.dpo_beta=-1"]) == 2
    err = capsys.readouterr().err
    assert "mindrl-train-dpo: error:" in err and "dpo_beta: must be > 0" in err, err
