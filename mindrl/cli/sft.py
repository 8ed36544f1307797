"""mindrl-sft: supervised fine-tuning on megatron-core, the warm start for PPO / GRPO (actor_config.load), e.g.
`mindrl-sft --config-name sft_tiny_cpu [--config-path DIR] [megatron_training.lr=1e-4 ...]`."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    from mindrl.config.cli import config_parser

    p = config_parser(
        "mindrl-sft",
        "Supervised fine-tuning of a megatron checkpoint (mindrl-convert hf2mcore) on instruction data "
        "(mindrl-preprocess with handler_name=AlpacaStyleInstructionHandler), the loss on the response tokens only. "
        "The YAML holds MindSpeed-LLM's megatron arguments under 'megatron_training:' (docs/sft.md). Saves a mindrl "
        "checkpoint to megatron_training.save (what actor_config.load and mindrl-convert mcore2hf read) and ends "
        "with a line 'run dir: PATH' (metrics.jsonl, tensorboard/).",
        epilog="example: mindrl-sft --config-name sft_tiny_cpu megatron_training.train_iters=50 "
        "megatron_training.lr=1e-3  (a split needs quotes: megatron_training.split='\"95,5,0\"')",
    )
    return p


def run_trainer(tool: str, args: argparse.Namespace, load, train, summary) -> int:
    """The body of an offline trainer's CLI (mindrl-sft, mindrl-train-rm): load(config_name, config_path, overrides,
    check_paths) the config, train(cfg) it, print summary(result, seconds)'s lines and last 'run dir: PATH'."""
    # WARNING: the progress lines are our own (every log_interval), not the metrics logger's per-step INFO line.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.config import ConfigError
    from mindrl.launch import RankError

    start = time.perf_counter()
    try:
        cfg = load(args.config_name, args.config_path, args.overrides, check_paths=not args.no_check_paths)
    except ConfigError as e:
        print(f"{tool}: error: {e}", file=sys.stderr)
        return 2
    if cfg.ignored_keys:
        print(f"{tool}: ignored MindSpeed keys (no effect here): {', '.join(cfg.ignored_keys)}", file=sys.stderr)
    try:
        result = train(cfg)
    except CheckpointError as e:
        print(f"{tool}: error: {e}", file=sys.stderr)
        return 1
    except RankError as e:  # a rank raised or died: its traceback is in the message
        print(f"{tool}: aborted: {e}", file=sys.stderr)
        return 1
    for line in summary(result, time.perf_counter() - start):
        print(line)
    print(f"run dir: {result.run_dir}")
    return 0


def _summary(result, seconds: float) -> list[str]:
    last = result.history[-1]
    val = f", val_loss {last['sft/val_loss']:.4f}" if "sft/val_loss" in last else ""
    return [
        f"mindrl-sft: {result.iterations} steps in {seconds:.0f} s, loss {last['sft/loss']:.4f}{val}; "
        f"checkpoint: {result.save_dir} (iteration {result.saved_iterations[-1]})"
    ]


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    from mindrl.preflight import load_sft_config
    from mindrl.trainer.sft import train_sft

    return run_trainer("mindrl-sft", build_parser().parse_args(argv), load_sft_config, train_sft, _summary)


if __name__ == "__main__":
    sys.exit(main())
