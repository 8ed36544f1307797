"""mindrl-sft: supervised fine-tuning on megatron-core, the warm start for PPO / GRPO (actor_config.load).

mindrl-sft --config-name sft_tiny_cpu [--config-path DIR] [megatron_training.lr=1e-4 ...]
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mindrl-sft",
        description="Supervised fine-tuning of a megatron checkpoint (mindrl-convert hf2mcore) on instruction data "
        "(mindrl-preprocess with handler_name=AlpacaStyleInstructionHandler): loss on the response tokens only. "
        "The YAML holds MindSpeed-LLM's megatron arguments under 'megatron_training:'; see docs/sft.md. Saves a "
        "mindrl checkpoint to megatron_training.save (what actor_config.load and mindrl-convert mcore2hf read) and "
        "ends with a line 'run dir: PATH' (metrics.jsonl, tensorboard/).",
        epilog="example: mindrl-sft --config-name sft_tiny_cpu megatron_training.train_iters=50",
    )
    p.add_argument("--config-name", required=True, help="YAML name in the config path, without .yaml")
    p.add_argument("--config-path", default=None, help="directory of the YAML (default: the repo's configs/)")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="hydra overrides, e.g. megatron_training.train_iters=50"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.config.sft import load_sft_config
    from mindrl.data.preprocess_config import ConfigError
    from mindrl.trainer.sft import train_sft

    start = time.perf_counter()
    try:
        cfg = load_sft_config(args.config_name, args.config_path, args.overrides)
    except ConfigError as e:
        print(f"mindrl-sft: error: {e}", file=sys.stderr)
        return 2
    try:
        result = train_sft(cfg)
    except CheckpointError as e:
        print(f"mindrl-sft: error: {e}", file=sys.stderr)
        return 1
    last = result.history[-1]
    val = f", val_loss {last['sft/val_loss']:.4f}" if "sft/val_loss" in last else ""
    print(
        f"mindrl-sft: {result.iterations} steps in {time.perf_counter() - start:.0f} s, loss {last['sft/loss']:.4f}"
        f"{val}; checkpoint: {result.save_dir} (iteration {result.saved_iterations[-1]})"
    )
    print(f"run dir: {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
