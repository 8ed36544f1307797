"""Held-out evaluation: the val/* metrics against an independent computation from the written responses, training
unchanged by it, and mindrl-eval (HF and megatron checkpoints) reproducing the trainer's evaluations."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from mindrl.trainer.evaluation import EvalSet, EvalSettings, Evaluator, eval_metrics, evaluate, pass_at_k, pass_ks
from tests.trainer.rl_helpers import ROOT, _config, _train

VAL_PROMPTS = 5  # odd: the trainer pads them over its 2 engine replicas
VAL_SAMPLES = 3
# GRPO at actor TP2 with two TP1 engine replicas (mindrl-eval's engine is TP1: the same greedy arithmetic). The gsm8k
# verifier (the last number of the response is the label's) scores some of the random model's responses 1: rewards
# and held-out scores vary, and the policy moves.
VERIFIER = "gsm8k"
BASE = ["megatron_training.train_iters=2", "megatron_training.save_interval=1",
        "generate_config.infer_tensor_parallel_size=1", f"rl_config.verifier_function=[{VERIFIER}]"]  # fmt: skip


def _val(assets) -> list[str]:
    return [
        f"rl_config.val_data_path={assets / 'data' / 'train'}",
        f"rl_config.val_max_prompts={VAL_PROMPTS}",
        f"rl_config.val_n_samples={VAL_SAMPLES}",
        "rl_config.val_temperature=1.0",
        "megatron_training.eval_interval=1",
    ]


# ------------------------------------------------------------------------------------------------ pure pieces
def _pass_at_k_by_enumeration(correct: list[bool], k: int) -> float:
    """The fraction of the k-subsets of the samples holding a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_subset_fraction():
    for n in range(1, 7):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_enumeration(correct, k), abs=1e-12)
    assert pass_ks(1) == [1] and pass_ks(3) == [1, 2, 3] and pass_ks(8) == [1, 2, 4, 8] and pass_ks(0) == []


def test_schedule_before_every_interval_and_last():
    def due(interval, before, last=10):
        ev = Evaluator(EvalSet([], [], []), EvalSettings(("acc",)), "/nonexistent", interval, before, last)
        return [i for i in range(last + 1) if ev.due(i)]

    assert due(4, True) == [0, 4, 8, 10]
    assert due(5, False) == [5, 10]
    assert due(None, True) == [0, 10]
    assert due(0, False, last=3) == [3]


def test_eval_metrics_of_rows():
    rows = [
        {"index": 7, "sample": -1, "acc": 1.0, "reward": 1.0, "response_length": 4},
        {"index": 9, "sample": -1, "acc": None, "reward": 0.0, "response_length": 6},  # scoring timed out: 0
        *({"index": 7, "sample": j, "acc": s, "reward": s, "response_length": 2} for j, s in enumerate((0.0, 1.0))),
        *({"index": 9, "sample": j, "acc": 0.0, "reward": 0.0, "response_length": 8} for j in range(2)),
    ]
    m = eval_metrics(rows, ["acc"], 2)
    assert m["val/acc/mean"] == 0.5 and m["val/reward/mean"] == 0.5 and m["val/response_length/mean"] == 5
    assert m["val/acc/pass@1"] == 0.25 and m["val/acc/pass@2"] == 0.5 and m["val/num_prompts"] == 2
    assert m["val/sampled_response_length/mean"] == 5


def test_evaluate_with_a_reward_model_scores_every_response():
    """`model_score` gets each response's prompt and tokens (an empty response too) and its rule Scores; its mixed
    rewards and raw scores land in the rows and in val/reward/mean, val/reward_model/*."""
    from mindrl.config.settings import SamplingConfig
    from mindrl.rollout.base import RolloutSample
    from mindrl.workers.results import Scores

    eval_set = EvalSet([[5, 6], [7]], [[1], [2]], [3, 4])

    def generate(prompts, sampling, seeds):
        return [[RolloutSample([p[-1] + j] * j, [0.0] * j, "stop") for j in range(sampling.n)] for p in prompts]

    def score(responses, labels):
        return Scores([1.0] * len(responses), [[1.0]] * len(responses), [str(r) for r in responses],
                      [str(x) for x in labels], {})  # fmt: skip

    seen = []

    def model_score(prompts, responses, scored):
        seen.append((prompts, responses))
        raw = [float(len(p) + len(r)) for p, r in zip(prompts, responses)]
        return Scores([a + 2 * b for a, b in zip(scored.rewards, raw)], scored.per_verifier, scored.texts,
                      scored.labels, scored.metrics, raw)  # fmt: skip

    tok = NS(batch_decode=lambda ids, **kw: [str(x) for x in ids])
    result = evaluate(eval_set, SamplingConfig(max_tokens=4), EvalSettings(("acc",), n_samples=2), generate, score,
                      tok, model_score)  # fmt: skip
    assert seen[0] == ([[5, 6], [7]], [[], []])  # greedy: n=1, j=0, empty responses
    assert seen[1] == ([[5, 6], [5, 6], [7], [7]], [[], [7], [], [8]])
    greedy = [r for r in result.rows if r["sample"] < 0]
    assert [r["reward_model_score"] for r in greedy] == [2.0, 1.0] and [r["reward"] for r in greedy] == [5.0, 3.0]
    assert greedy[0]["prompt_ids"] == [5, 6] and result.rows[3]["response_ids"] == [7]
    m = result.metrics
    assert m["val/reward_model/score/mean"] == 1.5 and m["val/reward/mean"] == 4.0
    assert m["val/reward_model/sampled_score/mean"] == (2 + 3 + 1 + 2) / 4


def test_standard_decoding_drops_the_rollouts_stops_and_says_so():
    from mindrl.config.settings import SamplingConfig
    from mindrl.trainer.evaluation import protocol_label, protocol_sampling

    rollout = SamplingConfig(max_tokens=48, stop=["\n"], detokenize=True, stop_token_ids=[2, 7], temperature=0.6)
    standard = protocol_sampling(rollout, "standard", [2])
    assert (standard.stop, standard.stop_token_ids, standard.max_tokens) == ([], [2], 48)
    assert protocol_label(standard, [2]) == "standard decoding: greedy, ends at the end token [2] or 48 tokens"
    assert protocol_sampling(rollout, "rollout", [2]) is rollout
    label = protocol_label(rollout, [2])
    assert label.startswith("NOT standard decoding") and "['\\n']" in label and "[7]" in label
    with pytest.raises(ValueError, match="unknown evaluation protocol 'x'"):
        protocol_sampling(rollout, "x", [2])


def test_the_models_own_chat_template_is_found():
    """mindrl-eval's default prompt_type renders what the tokenizer's own chat template renders; a tokenizer without
    one, or with one no template reproduces, is an error naming --prompt-type."""
    from mindrl.cli.eval import EvalInputError, own_prompt_type
    from mindrl.data.templates import get_template

    smollm2 = get_template("smollm2")

    class Tok:
        bos_token, eos_token = "", "<|im_end|>"
        chat_template = "(jinja)"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return smollm2.render_prompt(messages[0]["content"])

    assert own_prompt_type(Tok()) == "smollm2"
    odd = Tok()
    odd.apply_chat_template = lambda messages, **kw: "<<" + messages[0]["content"]
    with pytest.raises(EvalInputError, match="pass --prompt-type"):
        own_prompt_type(odd)
    none = Tok()
    none.chat_template = None
    with pytest.raises(EvalInputError, match="no chat template of its own: pass --prompt-type"):
        own_prompt_type(none)


def test_a_fresh_run_forgets_an_earlier_runs_evaluations(tmp_path):
    """metrics.jsonl's rows and the eval JSONLs after the start go; a resumed run keeps those up to its iteration."""
    from mindrl.trainer.evaluation import eval_file, write_rows
    from mindrl.trainer.metrics import MetricsLogger

    ev = Evaluator(EvalSet([], [], []), EvalSettings(("acc",)), str(tmp_path), 1, True, 4)
    for it in (0, 1, 2):
        write_rows(eval_file(str(tmp_path), it), [{"sample": -1}], iteration=it)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "x": 1.0}) + "\n" for i in (0, 1, 2)))
    with MetricsLogger(str(tmp_path), 4, use_tensorboard=False, console=False, start_iteration=1):
        pass
    ev.forget_after(1)
    assert [json.loads(x)["iteration"] for x in open(tmp_path / "metrics.jsonl")] == [0, 1]
    assert sorted(os.listdir(tmp_path / "eval")) == ["iter_0000000.jsonl", "iter_0000001.jsonl"]
    with MetricsLogger(str(tmp_path), 4, use_tensorboard=False, console=False, start_iteration=0):
        pass
    ev.forget_after(-1)
    assert (tmp_path / "metrics.jsonl").read_text() == "" and os.listdir(tmp_path / "eval") == []


def test_config_keys(tmp_path):
    from mindrl.config import ConfigError, load_config

    cfg = load_config("grpo_tiny_cpu", overrides=["megatron_training.eval_interval=5"])
    assert cfg.megatron_training.eval_interval == 5 and cfg.rl_config.val_data_path is None
    assert "megatron_training.eval_interval" in cfg.ignored_keys  # no held-out set: no effect
    assert (
        "megatron_training.eval_iters"
        in load_config("grpo_tiny_cpu", overrides=["+megatron_training.eval_iters=3"]).ignored_keys
    )
    with pytest.raises(ConfigError) as e:
        load_config("grpo_tiny_cpu", overrides=["rl_config.val_temperature=0", "rl_config.val_n_samples=-1",
                                                "megatron_training.eval_interval=-2", "rl_config.val_max_prompts=0",
                                                "rl_config.val_protocol=one_line"])  # fmt: skip
    for key in ("val_temperature", "val_n_samples", "eval_interval", "val_max_prompts", "val_protocol"):
        assert key in str(e.value)


def test_val_data_path_is_checked_before_start(tmp_path):
    from mindrl.config import ConfigError
    from mindrl.preflight import load_config

    with pytest.raises(ConfigError, match=r"rl_config.val_data_path.*packed dataset files missing"):
        load_config("grpo_tiny_cpu", overrides=[f"rl_config.val_data_path={tmp_path / 'nothing'}"])


def test_eval_help():
    out = subprocess.run([sys.executable, "-m", "mindrl.cli.eval", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "--load-dir" in out.stdout and "--n-samples" in out.stdout


def test_eval_bad_input_names_it(tmp_path, tiny_models, capsys):
    from mindrl.cli.eval import main

    hf = tmp_path / "hf"
    hf.mkdir()
    good = tiny_models["untied"]
    bad_row = tmp_path / "bad.json"
    bad_row.write_text(json.dumps([{"problem": "1 + 1?", "answer": "2"}, {"problem": 5, "answer": "3"}]))
    cases = [
        (["--hf-dir", str(hf), "--data", str(bad_row)], "has no config.json"),
        (["--hf-dir", good, "--load-dir", good, "--data", str(bad_row)], "exactly one of --hf-dir"),
        (["--hf-dir", good, "--data", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["--hf-dir", good, "--data", str(bad_row), "--verifier", "acc_for_pop"], "did you mean 'acc_for_ppo'"),
        (["--hf-dir", good, "--data", str(bad_row)], "non-string value for key 'problem'"),
        (["--load-dir", good, "--tokenizer", good, "--data", str(bad_row)], "not a megatron checkpoint"),
        (["--hf-dir", good, "--data", str(bad_row), "--n-samples", "-1"], "--n-samples must be >= 0"),
        (["--hf-dir", good, "--data", str(bad_row), "rl_config.epochs=2"], "overrides need --config-name"),
        (["--hf-dir", good], "--data is required"),
        (["--hf-dir", good, "--data", str(bad_row), "--data", str(bad_row)], "2 --data sets need one responses path"),
        (["--hf-dir", good, "--data", str(bad_row), "--out", "a", "--out", "b"], "--out: 2 paths for 1 --data sets"),
        (
            ["--hf-dir", good, "--data", str(bad_row), "--data", str(bad_row), "--out", "a", "--out", "a"],
            "the same path twice",
        ),
        (["-cn", "grpo_tiny_cpu", "--hf-dir", good, "rl_config.epoch=2"], "rl_config.epoch"),
    ]
    for argv, named in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("mindrl-eval: error: ") and named in err, (argv, err)


def test_eval_defaults_come_from_a_training_config():
    """-cn: every covered flag takes the config's value (overrides applied), a flag given wins; without -cn the
    flags' own defaults."""
    from mindrl.cli.eval import CONFIG_DEFAULTS, build_parser, resolve_defaults
    from mindrl.config import load_config

    overrides = ["rl_config.val_n_samples=3", "generate_config.sampling_config.stop=[END]",
                 "generate_config.sampling_config.detokenize=true", "rl_config.val_data_path=/data/test"]  # fmt: skip
    cfg = load_config("grpo_smollm2_cpu", overrides=overrides)
    args = resolve_defaults(build_parser().parse_intermixed_args(["-cn", "grpo_smollm2_cpu", "--max-tokens", "7",
                                                                   *overrides]))  # fmt: skip
    # standard decoding (the config's val_protocol): the rollout's stop string is not the user's
    assert (args.max_tokens, args.n_samples, args.stop, args.data) == (7, 3, [], ["/data/test"])
    assert args.protocol == "standard" and args.stop_token_ids == []
    rollout = resolve_defaults(build_parser().parse_intermixed_args(["-cn", "grpo_smollm2_cpu", *overrides,
                                                                      "rl_config.val_protocol=rollout"]))  # fmt: skip
    assert (rollout.protocol, rollout.stop) == ("rollout", ["END"])
    given = resolve_defaults(build_parser().parse_intermixed_args(["-cn", "grpo_smollm2_cpu", "--stop", "X"]))
    assert (given.protocol, given.stop) == ("standard", ["X"])  # opt-in: protocol_label says it is not standard
    assert (args.load_dir, args.verifier, args.temperature) == (
        cfg.actor_config.save,
        cfg.rl_config.verifier_function,
        cfg.rl_config.val_temperature,
    )
    assert (args.max_prompts, args.max_prompt_length, args.seed, args.max_num_seqs) == (
        cfg.rl_config.val_max_prompts, cfg.rl_config.max_prompt_length, cfg.megatron_training.seed,
        cfg.generate_config.max_num_seqs)  # fmt: skip
    # an HF checkpoint given: the config's actor_config.save is not used as a second one
    args = resolve_defaults(build_parser().parse_intermixed_args(["-cn", "grpo_smollm2_cpu", "--hf-dir", "/m"]))
    assert args.load_dir is None and args.tokenizer == cfg.megatron_training.tokenizer_name_or_path
    plain = resolve_defaults(build_parser().parse_intermixed_args(["--data", "d", "--hf-dir", "/m"]))
    assert {k: getattr(plain, k) for k in CONFIG_DEFAULTS if k != "data"} == {
        k: d for k, (_, d) in CONFIG_DEFAULTS.items() if k != "data"
    }


def test_eval_refuses_a_multi_turn_config():
    """mindrl-eval samples one turn without tools: a multi-turn config's policy would be scored without the tools'
    results, so it says where the agent loop's evaluation is instead."""
    from mindrl.cli.eval import EvalInputError, build_parser, resolve_defaults

    with pytest.raises(EvalInputError, match=r"retool_tiny_cpu: rl_config.multi_turn_enable .*rl_config.val_data_path"):
        resolve_defaults(build_parser().parse_intermixed_args(["-cn", "retool_tiny_cpu", "--data", "d"]))


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def eval_run(assets, tmp_path_factory):
    """GRPO for 2 iterations, evaluated before, after 1 and after 2."""
    run_dir = tmp_path_factory.mktemp("eval_on")
    cfg = _config("grpo_tiny_cpu", assets, run_dir, *BASE, *_val(assets))
    _, results, lines, _ = _train(cfg)
    return run_dir, lines


@pytest.mark.slow
def test_val_metrics_equal_the_written_responses_scored_again(eval_run):
    from mindrl.rewards import score_rule_rewards
    from tools.plot_metrics import plot_metrics

    run_dir, lines = eval_run
    assert [x["iteration"] for x in lines] == [0, 1, 2]
    assert set(lines[0]) == {"iteration", "timing/eval"} | {k for k in lines[0] if k.startswith("val/")}
    for line in lines:
        it = line["iteration"]
        rows = [json.loads(x) for x in open(run_dir / "eval" / f"iter_{it:07d}.jsonl")]
        assert {r["iteration"] for r in rows} == {it} and len(rows) == VAL_PROMPTS * (1 + VAL_SAMPLES)
        # scored again here, by the verifier itself (not the trainer's reward worker)
        again = score_rule_rewards([r["response"] for r in rows], [r["label"] for r in rows], [VERIFIER], [1.0])
        assert [s[0] for s in again.per_verifier] == [r[VERIFIER] for r in rows]
        greedy = [s[0] for s, r in zip(again.per_verifier, rows) if r["sample"] < 0]
        assert line[f"val/{VERIFIER}/mean"] == pytest.approx(sum(greedy) / VAL_PROMPTS, abs=1e-12)
        lengths = [r["response_length"] for r in rows if r["sample"] < 0]
        assert line["val/response_length/mean"] == pytest.approx(sum(lengths) / VAL_PROMPTS, abs=1e-12)
        for k in (1, 2, 3):
            per_prompt = {}
            for s, r in zip(again.per_verifier, rows):
                if r["sample"] >= 0:
                    per_prompt.setdefault(r["index"], []).append(s[0] > 0)
            want = sum(_pass_at_k_by_enumeration(c, k) for c in per_prompt.values()) / VAL_PROMPTS
            assert line[f"val/{VERIFIER}/pass@{k}"] == pytest.approx(want, abs=1e-12)
        assert line["timing/eval"] > 0
    assert any(line[f"val/{VERIFIER}/pass@3"] > 0 for line in lines)  # not a trivial all-zero check
    # the sinks: TensorBoard has the scalars, the PNG draws them
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars(f"val/{VERIFIER}/mean")] == [0, 1, 2]
    assert os.path.getsize(plot_metrics(str(run_dir))) > 0


@pytest.mark.slow
def test_evaluation_leaves_training_unchanged(eval_run, assets, tmp_path_factory):
    run_dir, on = eval_run
    off_dir = tmp_path_factory.mktemp("eval_off")
    _, _, off, _ = _train(_config("grpo_tiny_cpu", assets, off_dir, *BASE))
    assert [x["iteration"] for x in off] == [1, 2]
    assert off[-1]["actor/grad_norm"] > 0  # the policy moves (iteration 1's rewards are all 0 here)
    for a, b in zip(on[1:], off):
        kept = {k for k in b if not k.startswith("timing/") and not k.endswith("_tps")}
        assert {k: a[k] for k in kept} == {k: b[k] for k in kept}
        assert set(a) - set(b) == {k for k in a if k.startswith("val/")} | {"timing/eval"}


@pytest.mark.slow
def test_resumed_run_evaluates_where_the_straight_run_did(eval_run, assets, tmp_path):
    """Resumed from iteration 1's checkpoint: iteration 1's evaluation is not run again (its row is kept), iteration
    2's is, with the straight run's responses and metrics."""
    from mindrl.checkpoint import mcore_ckpt

    run_dir, lines = eval_run
    d = tmp_path / "split"
    shutil.copytree(run_dir, d)
    shutil.rmtree(d / "ckpt_actor" / "iter_0000002")
    mcore_ckpt.write_tracker(str(d / "ckpt_actor"), 1)
    (d / "eval" / "iter_0000002.jsonl").unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in (d / "eval").iterdir()}
    resume = [f"actor_config.{k}" for k in ("finetune=false", "no_load_optim=false", "no_load_rng=false")]
    _, _, resumed, _ = _train(_config("grpo_tiny_cpu", assets, d, *BASE, *_val(assets), *resume,
                                      actor_load=d / "ckpt_actor"))  # fmt: skip

    def comparable(m):
        return {k: v for k, v in m.items() if not k.startswith("timing/") and not k.endswith("_tps")}

    assert [comparable(m) for m in resumed] == [comparable(m) for m in lines]
    assert {p.name: p.stat().st_mtime_ns for p in (d / "eval").iterdir() if p.name in kept} == kept
    assert (d / "eval" / "iter_0000002.jsonl").read_text() == (run_dir / "eval" / "iter_0000002.jsonl").read_text()


def _mindrl_eval(*args: str) -> tuple[dict, list[dict], list[str]]:
    out = subprocess.run([sys.executable, "-m", "mindrl.cli.eval", *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads(
        [x for x in out.stdout.splitlines() if x.startswith("{") and '"val/num_prompts"' in x][-1]
    )  # vLLM logs to stdout; several --data sets: the last set's
    path = out.stdout.strip().splitlines()[-1].removeprefix("responses: ")
    return metrics, [json.loads(x) for x in open(path)], [x for x in out.stdout.splitlines() if x.startswith("data: ")]


def _same_evaluation(cli: tuple, metrics: dict, rows: list[dict]) -> None:
    got, got_rows = cli[:2]
    assert {k: v for k, v in got.items() if k.startswith("val/")} == {
        k: v for k, v in metrics.items() if k.startswith("val/")
    }
    strip = ("iteration",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in rows] == got_rows


@pytest.mark.slow
def test_mindrl_eval_reproduces_the_trainers_evaluation(eval_run, assets, tmp_path):
    """The starting weights (HF dir, on the raw DeepScaleR JSON, every setting a flag) are evaluated as iteration 0
    was; a second --data set in the same process (the same file again, after the first on the warm engine) too.
    (A megatron checkpoint on the preprocessed set: the next test's.)"""
    run_dir, lines = eval_run
    task, outs = str(assets / "task.json"), [str(tmp_path / "responses.jsonl"), str(tmp_path / "again.jsonl")]
    cli = _mindrl_eval(
        "--hf-dir", str(assets / "hf"), "--data", task, "--data", task, "--prompt-type", "qwen", "--max-prompts",
        str(VAL_PROMPTS), "--max-prompt-length", "64", "--max-tokens", "24", "--verifier", VERIFIER, "--n-samples",
        str(VAL_SAMPLES), "--temperature", "1.0", "--seed", "1234", "--out", outs[0], "--out", outs[1],
    )  # fmt: skip
    rows = [json.loads(x) for x in open(run_dir / "eval" / "iter_0000000.jsonl")]
    _same_evaluation(cli, lines[0], rows)
    first = cli[0]
    assert cli[2] == [f"data: {task}", f"data: {task}"]
    cli = (first, [json.loads(x) for x in open(outs[0])])
    _same_evaluation(cli, lines[0], rows)


@pytest.mark.slow
def test_mindrl_eval_with_the_training_config_reproduces_the_last_evaluation(eval_run, assets, tmp_path):
    """`mindrl-eval -cn CONFIG` with the run's overrides and no other flag: the final checkpoint (megatron, from
    actor_config.save) on rl_config.val_data_path (the preprocessed set) with the config's sampling and verifiers, as
    the trainer's iteration 2."""
    run_dir, lines = eval_run
    overrides = [f"actor_config.save={run_dir / 'ckpt_actor'}", f"actor_config.load={assets / 'actor'}",
                 f"megatron_training.tokenizer_name_or_path={assets / 'hf'}", *BASE, *_val(assets)]  # fmt: skip
    cli = _mindrl_eval("-cn", "grpo_tiny_cpu", *overrides, "--out", str(tmp_path / "responses.jsonl"))
    rows = [json.loads(x) for x in open(run_dir / "eval" / "iter_0000002.jsonl")]
    _same_evaluation(cli, lines[2], rows)
