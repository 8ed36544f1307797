"""mindrl-train-rm: reward-model training on preference pairs (Bradley-Terry, `stage: orm`), e.g.
`mindrl-train-rm --config-name rm_tiny_cpu [--config-path DIR] [megatron_training.lr=1e-4 ...]`."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    from mindrl.config.cli import config_parser

    return config_parser(
        "mindrl-train-rm",
        "Train a reward model (a value-head model, MindSpeed's ORM) on preference pairs (mindrl-preprocess with "
        "handler_name=AlpacaStylePairwiseHandler) with the Bradley-Terry loss on the score of each sequence's last "
        "token. Starts from a causal-LM checkpoint (fresh value head) or a value-head one. The YAML holds megatron "
        "arguments under 'megatron_training:' with stage: orm (docs/reward_model.md). Saves a value-head checkpoint "
        "to megatron_training.save (critic_config.load, the reward model, mindrl-convert mcore2hf --orm) and ends "
        "with a line 'run dir: PATH' (metrics.jsonl, tensorboard/).",
        epilog="example: mindrl-train-rm --config-name rm_tiny_cpu megatron_training.train_iters=50 "
        "(a split needs quotes: megatron_training.split='\"90,10,0\"')",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.config import ConfigError
    from mindrl.launch import RankError
    from mindrl.preflight import load_rm_config
    from mindrl.trainer.reward_model import train_reward_model

    start = time.perf_counter()
    try:
        cfg = load_rm_config(args.config_name, args.config_path, args.overrides, check_paths=not args.no_check_paths)
    except ConfigError as e:
        print(f"mindrl-train-rm: error: {e}", file=sys.stderr)
        return 2
    if cfg.ignored_keys:
        print(
            f"mindrl-train-rm: ignored MindSpeed keys (no effect here): {', '.join(cfg.ignored_keys)}", file=sys.stderr
        )
    try:
        result = train_reward_model(cfg)
    except CheckpointError as e:
        print(f"mindrl-train-rm: error: {e}", file=sys.stderr)
        return 1
    except RankError as e:  # a rank raised or died: its traceback is in the message
        print(f"mindrl-train-rm: aborted: {e}", file=sys.stderr)
        return 1
    last = result.history[-1]
    val = ""
    if "rm/val_accuracy" in last:
        val = f", val_loss {last['rm/val_loss']:.4f}"
        print(f"reward model held-out accuracy: {last['rm/val_accuracy']:.4f}")
    print(
        f"mindrl-train-rm: {result.iterations} steps in {time.perf_counter() - start:.0f} s, loss {last['rm/loss']:.4f}"
        f"{val}; checkpoint: {result.save_dir} (iteration {result.saved_iterations[-1]})"
    )
    print(f"run dir: {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
