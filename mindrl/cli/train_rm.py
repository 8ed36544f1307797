"""mindrl-train-rm: reward-model training on preference pairs (Bradley-Terry, `stage: orm`), e.g.
`mindrl-train-rm --config-name rm_tiny_cpu [--config-path DIR] [megatron_training.lr=1e-4 ...]`."""

from __future__ import annotations

import argparse
import sys


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


def _summary(result, seconds: float) -> list[str]:
    last = result.history[-1]
    lines, val = [], ""
    if "rm/val_accuracy" in last:
        lines.append(f"reward model held-out accuracy: {last['rm/val_accuracy']:.4f}")
        val = f", val_loss {last['rm/val_loss']:.4f}"
    lines.append(
        f"mindrl-train-rm: {result.iterations} steps in {seconds:.0f} s, loss {last['rm/loss']:.4f}, accuracy "
        f"{last['rm/accuracy']:.3f}{val}; checkpoint: {result.save_dir} (iteration {result.saved_iterations[-1]})"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    from mindrl.cli.sft import run_trainer
    from mindrl.preflight import load_rm_config
    from mindrl.trainer.reward_model import train_reward_model

    args = build_parser().parse_args(argv)
    return run_trainer("mindrl-train-rm", args, load_rm_config, train_reward_model, _summary)


if __name__ == "__main__":
    sys.exit(main())
