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


# The flags a training config gives defaults to (--config-name), each with its config key and its own default.
CONFIG_DEFAULTS: dict[str, tuple[str, object]] = {
    "data": ("rl_config.val_data_path", None),
    "load_dir": ("actor_config.save", None),
    "tokenizer": ("megatron_training.tokenizer_name_or_path", None),
    "max_prompts": ("rl_config.val_max_prompts", None),
    "max_prompt_length": ("rl_config.max_prompt_length", 512),
    "max_tokens": ("generate_config.sampling_config.max_tokens", 128),
    "protocol": ("rl_config.val_protocol", "standard"),
    "stop": ("generate_config.sampling_config.stop", []),
    "stop_token_ids": ("generate_config.sampling_config.stop_token_ids", []),
    "top_p": ("generate_config.sampling_config.top_p", 1.0),
    "top_k": ("generate_config.sampling_config.top_k", -1),
    "min_p": ("generate_config.sampling_config.min_p", 0.0),
    "verifier": ("rl_config.verifier_function", ["acc_for_ppo"]),
    "verifier_weight": ("rl_config.verifier_weight", None),
    "verifier_timeout": ("rl_config.verifier_timeout", DEFAULT_TIMEOUT_S),
    "n_samples": ("rl_config.val_n_samples", 0),
    "temperature": ("rl_config.val_temperature", 1.0),
    "seed": ("megatron_training.seed", 1234),
    "dtype": ("generate_config.dtype", "float32"),
    "max_num_seqs": ("generate_config.max_num_seqs", 64),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mindrl-eval",
        description=__doc__ + " Same prompts, sampling and verifiers as a training run's evaluation give the same "
        "responses and metrics (docs/evaluation.md). With --config-name, the training config's values are the "
        "defaults (shown as [KEY]): `mindrl-eval -cn grpo_smollm2_cpu` evaluates its actor_config.save on its "
        "rl_config.val_data_path as the run does; a flag given overrides its key.",
    )

    def add(group, flag: str, **kw) -> None:
        dest = flag.lstrip("-").replace("-", "_")
        key, default = CONFIG_DEFAULTS.get(dest, (None, None))
        if key is not None:
            shown = f" (default: {default})" if default not in (None, []) else ""
            kw["help"] = f"{kw.get('help', '')}{shown} [{key}]"
        group.add_argument(flag, default=None, **kw)

    cfg = p.add_argument_group("config (optional): a training config giving the defaults below")
    cfg.add_argument("--config-name", "-cn", help="a training config: <config-path>/NAME.yaml, or a YAML file")
    cfg.add_argument("--config-path", "-cp", help="its folder (default: the repo's configs/)")
    cfg.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of the config, as mindrl-train's")
    src = p.add_argument_group("checkpoint (one of)")
    src.add_argument("--hf-dir", help="HF checkpoint directory (config.json + safetensors)")
    add(src, "--load-dir", help="megatron checkpoint (e.g. actor_config.save): its latest iteration")
    src.add_argument("--hf-config", help="with --load-dir of a legacy mp_rank_* checkpoint: the HF dir giving its "
                     "architecture (see mindrl-convert mcore2hf)")  # fmt: skip
    add(src, "--tokenizer", help="HF tokenizer directory (default: the checkpoint's own)")
    d = p.add_argument_group("data")
    add(d, "--data", action="append", help="a .json / .jsonl / .parquet file (or a directory of them) of "
        "DeepScaleR-style rows, or a mindrl-preprocess output_prefix (with labels); required. Given again (--data A "
        "--data B): each set evaluated by the same engine (one start), each with its own --out")  # fmt: skip
    d.add_argument("--prompt-type", help="raw data: chat template (configs/model/templates.json) (default: the "
                   "tokenizer's own chat template, system prompt included: the prompt_type that renders it)")  # fmt: skip
    d.add_argument("--prompt-key", default="problem", help="raw data: the field holding the prompt")
    d.add_argument("--answer-key", default="answer", help="raw data: the field holding the reference answer")
    add(d, "--max-prompts", type=int, help="only the first N prompts")
    add(d, "--max-prompt-length", type=int, help="drop longer prompts")
    s = p.add_argument_group("sampling and scoring (the training config's values reproduce its evaluation)")
    add(s, "--max-tokens", type=int, help="response tokens")
    add(
        s,
        "--protocol",
        choices=["standard", "rollout"],
        help="standard: greedy, ending only at the model's end "
        "tokens (EOS / <|im_end|>), as a user runs it; rollout: with the config's stop strings and stop tokens",
    )
    add(s, "--stop", nargs="+", help="stop strings (e.g. a newline: $'\\n'); not standard decoding (opt-in)")
    add(
        s,
        "--stop-token-ids",
        nargs="+",
        type=int,
        help="token ids that end a response, besides EOS / <|im_end|>; not standard decoding (opt-in)",
    )
    add(s, "--verifier", nargs="+", help="verifiers")
    add(s, "--verifier-weight", nargs="+", type=float, help="their weights (default: 1 each)")
    add(s, "--verifier-timeout", type=float, help="seconds per response")
    add(s, "--n-samples", type=int, help="sampled responses per prompt for pass@k (0: greedy only)")
    add(s, "--temperature", type=float, help="temperature of the --n-samples samples")
    add(s, "--top-p", type=float)
    add(s, "--top-k", type=int)
    add(s, "--min-p", type=float)
    add(s, "--seed", type=int, help="the samples' seeds")
    e = p.add_argument_group("engine")
    add(e, "--dtype", choices=["float32", "bfloat16", "float16"])
    add(e, "--max-num-seqs", type=int, help="sequences the engine decodes at once")
    e.add_argument("--out", action="append", help="responses JSONL (default: eval_responses.jsonl next to the "
                   "checkpoint); one per --data, in their order")  # fmt: skip
    return p


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left out: from the training config (--config-name) where given, else their own defaults."""
    from_config: dict[str, object] = {}
    given = {dest for dest in CONFIG_DEFAULTS if getattr(args, dest) is not None}
    if args.overrides and not args.config_name:
        raise EvalInputError(f"{args.overrides[0]!r}: KEY=VALUE overrides need --config-name")
    if args.config_name:
        from mindrl.config import load_config
        from mindrl.config.cli import check_override_syntax
        from mindrl.config.errors import ConfigError

        try:
            check_override_syntax(args.overrides)
            cfg = load_config(args.config_name, config_path=args.config_path, overrides=args.overrides)
        except ConfigError as e:
            raise EvalInputError(f"--config-name {args.config_name}: {e}") from None
        if cfg.rl_config.multi_turn_enable:
            raise EvalInputError(
                f"--config-name {args.config_name}: rl_config.multi_turn_enable is true, and mindrl-eval samples one "
                "turn without tools, so it would score answers written without the tools' results; evaluate the "
                "policy in mindrl-train with rl_config.val_data_path (the agent loop with its tools)"
            )
        for dest, (key, _) in CONFIG_DEFAULTS.items():
            section, *rest = key.split(".")
            value = getattr(cfg, section)
            for part in rest:
                value = getattr(value, part)
            from_config[dest] = list(value) if isinstance(value, (list, tuple)) else value
        if args.hf_dir:  # an HF checkpoint given: the config's actor_config.save is not the one evaluated
            from_config["load_dir"] = None
    for dest, (_, default) in CONFIG_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, from_config[dest] if from_config.get(dest) is not None else default)
    if args.protocol == "standard":  # the rollout's stops are not the user's; stops given here are opt-in
        for dest in ("stop", "stop_token_ids"):
            if dest not in given:
                setattr(args, dest, [])
    if args.data is None:
        raise EvalInputError("--data is required (or --config-name with rl_config.val_data_path)")
    if isinstance(args.data, str):  # the config's rl_config.val_data_path
        args.data = [args.data]
    if args.out is not None and len(args.out) != len(args.data):
        raise EvalInputError(f"--out: {len(args.out)} paths for {len(args.data)} --data sets (one each)")
    if args.out is None and len(args.data) > 1:
        raise EvalInputError(f"--out: {len(args.data)} --data sets need one responses path each")
    return args


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    args = build_parser().parse_intermixed_args(argv)
    try:
        results = run(resolve_defaults(args))
    except (EvalInputError, FileNotFoundError) as e:
        print(f"mindrl-eval: error: {e}", file=sys.stderr)
        return 2
    for data, metrics, out in results:
        if len(results) > 1:
            print(f"data: {data}")
        print(json.dumps(metrics, sort_keys=True))
        for name in args.verifier:
            print(f"{name}: greedy {metrics.get(f'val/{name}/mean', 0.0):.4f} over {int(metrics['val/num_prompts'])} "
                  "prompts" + "".join(f", {k.rsplit('/', 1)[1]} {v:.4f}" for k, v in metrics.items()
                                      if k.startswith(f"val/{name}/pass@")) + f" ({args.protocol_label})")  # fmt: skip
        print(f"responses: {out}")
    return 0


def run(args: argparse.Namespace) -> list[tuple[str, dict[str, float], str]]:
    """Check the arguments, get an HF dir (converting a megatron checkpoint), evaluate each --data set with one
    engine; per set (data, metrics, responses path)."""
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
    results = []
    with tempfile.TemporaryDirectory(prefix="mindrl-eval-") as tmp:
        hf_dir = args.hf_dir or _convert(args.load_dir, args.hf_config, os.path.join(tmp, "hf"))
        tok_dir = args.tokenizer or hf_dir
        tokenizer = _tokenizer(tok_dir, "--tokenizer" if args.tokenizer else "the checkpoint")
        from mindrl.trainer.evaluation import EvalSettings, evaluate, load_eval_set, protocol_label, write_rows

        eval_sets = []  # every set read and checked before the engine starts
        for i, path in enumerate(args.data):
            data = _dataset(path, args, tokenizer, tok_dir, os.path.join(tmp, f"data{i}"))
            try:
                eval_set = load_eval_set(data, args.max_prompt_length, args.max_prompts)
            except ValueError as e:
                raise EvalInputError(f"--data {path}: {e}") from None
            if not any(eval_set.labels):
                raise EvalInputError(f"--data {path}: no labels (reference answers); preprocess with labels")
            eval_sets.append(eval_set)
        ends = _end_tokens(tokenizer)
        sampling = SamplingConfig(max_tokens=args.max_tokens, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                  stop=args.stop, detokenize=bool(args.stop),
                                  stop_token_ids=sorted(set(args.stop_token_ids) | set(ends)))  # fmt: skip
        args.protocol_label = protocol_label(sampling, ends)
        settings = EvalSettings(tuple(args.verifier), args.n_samples, args.temperature, args.seed)
        engine = _engine(args, hf_dir, tok_dir, max(len(p) for s in eval_sets for p in s.prompts))
        try:
            for path, eval_set in zip(args.data, eval_sets):
                t0 = time.perf_counter()
                result = evaluate(
                    eval_set,
                    sampling,
                    settings,
                    lambda prompts, params, seeds: engine.generate(prompts, params, seeds),
                    _scorer(tokenizer, args.verifier, weights, args.verifier_timeout),
                    tokenizer,
                )
                print(f"[mindrl-eval] {path}: {len(result.rows)} responses in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)  # fmt: skip
                results.append((path, result))
        finally:
            engine.shutdown()
            from mindrl.rewards import shutdown_shared_pool

            shutdown_shared_pool()
    source = args.hf_dir or args.load_dir
    outs = args.out or [os.path.join(os.path.dirname(os.path.abspath(source)), "eval_responses.jsonl")]
    for (_, result), out in zip(results, outs):
        write_rows(out, result.rows)
    return [(path, result.metrics, out) for (path, result), out in zip(results, outs)]


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
    for path in args.data:
        if not os.path.exists(path) and not _is_preprocessed(path):
            raise EvalInputError(f"--data {path!r}: no such file or directory, nor a preprocessed dataset prefix")
    if len(set(args.out or [])) < len(args.out or []):
        raise EvalInputError(f"--out: the same path twice ({' '.join(args.out)}): each --data set needs its own")


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


def own_prompt_type(tokenizer) -> str:
    """The prompt_type (configs/model/templates.json) rendering exactly what the tokenizer's own chat template
    renders for a user turn (default system prompt included)."""
    from mindrl.data.templates import load_templates

    if not getattr(tokenizer, "chat_template", None):
        raise EvalInputError("the tokenizer has no chat template of its own: pass --prompt-type")
    probe = "What is 12 + 30? {x}"
    want = tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    for name, template in load_templates().items():
        if template.render_prompt(probe, bos_token=bos, eos_token=eos) == want:
            return name
    raise EvalInputError(
        "no prompt_type in configs/model/templates.json renders the tokenizer's own chat template "
        f"({want[:120]!r}...): pass --prompt-type"
    )


def _dataset(path: str, args: argparse.Namespace, tokenizer, tok_dir: str, tmp_prefix: str) -> str:
    """A preprocessed prefix: `path` (one --data) itself, or `path` tokenised into `tmp_prefix` (strict: a bad row is
    an error)."""
    if _is_preprocessed(path):
        return path
    if args.prompt_type is None:
        args.prompt_type = own_prompt_type(tokenizer)
        print(f"[mindrl-eval] chat template: the tokenizer's own (prompt_type {args.prompt_type})")
    from mindrl.data.preprocess import BadRowError, preprocess
    from mindrl.data.preprocess_config import ConfigError, PreprocessConfig
    from mindrl.data.readers import InputError

    cfg = PreprocessConfig(
        input=path,
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
        raise EvalInputError(f"--data {path}: {str(e).split(' (strict=true')[0]}") from None
    except (ConfigError, InputError, ValueError) as e:
        raise EvalInputError(f"--data {path}: {e}") from None
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
