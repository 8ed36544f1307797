"""mindrl-eval: the trainer's held-out evaluation (greedy accuracy, optionally pass@k) of any checkpoint, HF or megatron,
on a DeepScaleR-style JSON / JSONL file or a preprocessed dataset; prints the metrics and writes the responses."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from mindrl.rewards.scoring import DEFAULT_TIMEOUT_S


class EvalInputError(ValueError):
    """A bad argument or input file; the message names it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mindrl-eval",
        description=__doc__ + " Same prompts, sampling and verifiers as a training run's evaluation give the same "
        "responses and metrics (docs/evaluation.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_argument_group("checkpoint (one of)")
    src.add_argument("--hf-dir", help="HF checkpoint directory (config.json + safetensors)")
    src.add_argument("--load-dir", help="megatron checkpoint (e.g. actor_config.save): its latest iteration")
    src.add_argument("--hf-config", help="with --load-dir of a legacy mp_rank_* checkpoint: the HF dir giving its "
                     "architecture (see mindrl-convert mcore2hf)")  # fmt: skip
    src.add_argument("--tokenizer", help="HF tokenizer directory (default: the checkpoint's own)")
    d = p.add_argument_group("data")
    d.add_argument("--data", required=True, help="a .json / .jsonl / .parquet file (or a directory of them) of "
                   "DeepScaleR-style rows, or a mindrl-preprocess output_prefix (with labels)")  # fmt: skip
    d.add_argument("--prompt-type", default="qwen", help="raw data: chat template (configs/model/templates.json)")
    d.add_argument("--prompt-key", default="problem", help="raw data: the field holding the prompt")
    d.add_argument("--answer-key", default="answer", help="raw data: the field holding the reference answer")
    d.add_argument("--max-prompts", type=int, help="only the first N prompts (default: all)")
    d.add_argument("--max-prompt-length", type=int, default=512, help="drop longer prompts (rl_config's key)")
    s = p.add_argument_group("sampling and scoring (the training config's values reproduce its evaluation)")
    s.add_argument("--max-tokens", type=int, default=128, help="sampling_config.max_tokens")
    s.add_argument("--verifier", nargs="+", default=["acc_for_ppo"], help="rl_config.verifier_function")
    s.add_argument("--verifier-weight", nargs="+", type=float, help="rl_config.verifier_weight (default: 1 each)")
    s.add_argument("--verifier-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per response")
    s.add_argument("--n-samples", type=int, default=0, help="sampled responses per prompt for pass@k (0: greedy only)")
    s.add_argument("--temperature", type=float, default=1.0, help="temperature of the --n-samples samples")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--seed", type=int, default=1234, help="megatron_training.seed (the samples' seeds)")
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--max-num-seqs", type=int, default=64, help="sequences the engine decodes at once")
    e.add_argument("--out", help="responses JSONL (default: eval_responses.jsonl next to the checkpoint)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        metrics, out = run(args)
    except (EvalInputError, FileNotFoundError) as e:
        print(f"mindrl-eval: error: {e}", file=sys.stderr)
        return 2
    names = args.verifier
    print(json.dumps(metrics, sort_keys=True))
    for name in names:
        print(f"{name}: greedy {metrics.get(f'val/{name}/mean', 0.0):.4f} over {int(metrics['val/num_prompts'])} "
              "prompts" + "".join(f", {k.rsplit('/', 1)[1]} {v:.4f}" for k, v in metrics.items()
                                  if k.startswith(f"val/{name}/pass@")))  # fmt: skip
    print(f"responses: {out}")
    return 0


def run(args: argparse.Namespace) -> tuple[dict[str, float], str]:
    """Check the arguments, get an HF dir (converting a megatron checkpoint), evaluate; (metrics, responses path)."""
    from mindrl.config.settings import SamplingConfig
    from mindrl.rewards.verifiers import get_verifier

    _check_args(args)
    for name in args.verifier:
        try:
            get_verifier(name)
        except ValueError as e:
            raise EvalInputError(f"--verifier: {e}") from None
    weights = args.verifier_weight or [1.0] * len(args.verifier)
    if len(weights) != len(args.verifier):
        raise EvalInputError(f"--verifier-weight: {len(weights)} weights for {len(args.verifier)} verifiers")
    with tempfile.TemporaryDirectory(prefix="mindrl-eval-") as tmp:
        hf_dir = args.hf_dir or _convert(args.load_dir, args.hf_config, os.path.join(tmp, "hf"))
        tok_dir = args.tokenizer or hf_dir
        tokenizer = _tokenizer(tok_dir, "--tokenizer" if args.tokenizer else "the checkpoint")
        data = _dataset(args, tok_dir, os.path.join(tmp, "data"))
        from mindrl.trainer.evaluation import EvalSettings, evaluate, load_eval_set, write_rows

        try:
            eval_set = load_eval_set(data, args.max_prompt_length, args.max_prompts)
        except ValueError as e:
            raise EvalInputError(f"--data {args.data}: {e}") from None
        if not any(eval_set.labels):
            raise EvalInputError(f"--data {args.data}: no labels (reference answers); preprocess with labels")
        sampling = SamplingConfig(max_tokens=args.max_tokens, top_p=args.top_p, top_k=args.top_k,
                                  stop_token_ids=_end_tokens(tokenizer))  # fmt: skip
        settings = EvalSettings(tuple(args.verifier), args.n_samples, args.temperature, args.seed)
        engine = _engine(args, hf_dir, tok_dir, max(len(p) for p in eval_set.prompts))
        try:
            t0 = time.perf_counter()
            result = evaluate(
                eval_set,
                sampling,
                settings,
                lambda prompts, params, seeds: engine.generate(prompts, params, seeds),
                _scorer(tokenizer, args.verifier, weights, args.verifier_timeout),
                tokenizer,
            )
            print(f"[mindrl-eval] {len(result.rows)} responses in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        finally:
            engine.shutdown()
            from mindrl.rewards import shutdown_shared_pool

            shutdown_shared_pool()
    source = args.hf_dir or args.load_dir
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(source)), "eval_responses.jsonl")
    write_rows(out, result.rows)
    return result.metrics, out


def _check_args(args: argparse.Namespace) -> None:
    if bool(args.hf_dir) == bool(args.load_dir):
        raise EvalInputError("give exactly one of --hf-dir (HF checkpoint) and --load-dir (megatron checkpoint)")
    if args.hf_config and not args.load_dir:
        raise EvalInputError("--hf-config describes a legacy megatron checkpoint: use it with --load-dir")
    for flag in ("hf_dir", "load_dir", "tokenizer", "hf_config"):
        path = getattr(args, flag)
        if path and not os.path.isdir(path):
            raise EvalInputError(f"--{flag.replace('_', '-')} {path!r} is not a directory")
    if args.hf_dir and not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        raise EvalInputError(f"--hf-dir {args.hf_dir!r} has no config.json (not an HF checkpoint)")
    for flag, low in (("max_tokens", 1), ("max_prompt_length", 1), ("max_num_seqs", 1), ("n_samples", 0)):
        if getattr(args, flag) < low:
            raise EvalInputError(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise EvalInputError(f"--max-prompts must be >= 1, got {args.max_prompts}")
    if not args.temperature > 0:
        raise EvalInputError(f"--temperature (of the pass@k samples) must be > 0, got {args.temperature}")
    if not os.path.exists(args.data) and not _is_preprocessed(args.data):
        raise EvalInputError(f"--data {args.data!r}: no such file or directory, nor a preprocessed dataset prefix")


def _is_preprocessed(path: str) -> bool:
    from mindrl.config.megatron import dataset_output_prefix
    from mindrl.data.preprocess import dataset_prefix

    return os.path.isfile(dataset_prefix(dataset_output_prefix(path), "input_ids") + ".idx")


def _convert(load_dir: str, hf_config: str | None, out: str) -> str:
    from mindrl.checkpoint import convert
    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.models.hf_config import ModelConfigError

    try:
        stats = convert.mcore2hf(load_dir, out, hf_config=hf_config)
    except (CheckpointError, ModelConfigError) as e:
        raise EvalInputError(f"--load-dir {load_dir}: {e}") from None
    print(f"[mindrl-eval] {load_dir} -> HF in {stats.seconds:.1f} s", file=sys.stderr)
    return out


def _tokenizer(path: str, what: str):
    from transformers import AutoTokenizer

    from mindrl.rollout.base import TOKENIZER_FILES, has_tokenizer

    if not has_tokenizer(path):
        raise EvalInputError(
            f"{what} ({path}) has no tokenizer (one of {', '.join(TOKENIZER_FILES)}): pass --tokenizer"
        )
    return AutoTokenizer.from_pretrained(path)


def _end_tokens(tokenizer) -> list[int]:
    from mindrl.workers.from_config import end_token_ids

    return end_token_ids(tokenizer)


def _dataset(args: argparse.Namespace, tok_dir: str, tmp_prefix: str) -> str:
    """A preprocessed prefix: --data itself, or --data tokenised into `tmp_prefix` (strict: a bad row is an error)."""
    if _is_preprocessed(args.data):
        return args.data
    from mindrl.data.preprocess import BadRowError, preprocess
    from mindrl.data.preprocess_config import ConfigError, PreprocessConfig
    from mindrl.data.readers import InputError

    cfg = PreprocessConfig(
        input=args.data,
        tokenizer_name_or_path=tok_dir,
        output_prefix=tmp_prefix,
        prompt_type=args.prompt_type,
        map_keys={"prompt": args.prompt_key, "response": args.answer_key},
        dataset_additional_keys=["labels"],
        strict=True,
    )
    try:
        cfg.validate("mindrl-eval")
        preprocess(cfg, log=open(os.devnull, "w"))  # noqa: SIM115 (closed with the process)
    except BadRowError as e:  # every row counts: mindrl-eval skips none (the hint is mindrl-preprocess's)
        raise EvalInputError(f"--data {args.data}: {str(e).split(' (strict=true')[0]}") from None
    except (ConfigError, InputError, ValueError) as e:
        raise EvalInputError(f"--data {args.data}: {e}") from None
    return tmp_prefix


def _engine(args: argparse.Namespace, hf_dir: str, tok_dir: str, longest_prompt: int):
    from mindrl.config.settings import RolloutConfig
    from mindrl.rollout.vllm_engine import VllmEngine

    max_len = longest_prompt + args.max_tokens
    config = RolloutConfig(
        model=hf_dir,
        load_format="auto",
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(8192, max_len * args.max_num_seqs),  # whole prefills: seeded requests need it
        seed=args.seed,
        tokenizer=tok_dir,
    )
    return VllmEngine(config)


def _scorer(tokenizer, names: list[str], weights: list[float], timeout: float):
    """A ScoreFn scoring in this process's verifier pool (the trainer's RewardClient does the same, from a thread)."""
    from mindrl.rewards import score_rule_rewards
    from mindrl.workers.results import Scores

    def score(responses: list[list[int]], labels: list[list[int]]) -> Scores:
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        label_texts = tokenizer.batch_decode(labels, skip_special_tokens=True)
        s = score_rule_rewards(texts, label_texts, names, weights, timeout=timeout)
        return Scores(s.rewards, s.per_verifier, texts, label_texts, s.metrics)

    return score


if __name__ == "__main__":
    sys.exit(main())
