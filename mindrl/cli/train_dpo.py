"""mindrl-train-dpo: offline DPO of a causal LM on preference pairs against a frozen reference (`stage: dpo`),
e.g. `mindrl-train-dpo --config-name dpo_tiny_cpu [megatron_training.dpo_beta=0.2 ...]`."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from mindrl.config.cli import config_parser

    return config_parser(
        "mindrl-train-dpo",
        "Train a causal LM with direct preference optimisation (DPO; sigmoid, cDPO label smoothing, hinge or IPO) "
        "on preference pairs (mindrl-preprocess with handler_name=AlpacaStylePairwiseHandler). The reference is frozen: "
        "the starting checkpoint, or ref_model; its log-probabilities are computed once before the first step. The "
        "YAML holds megatron arguments under 'megatron_training:' with stage: dpo and MindSpeed's dpo_beta, "
        "dpo_label_smoothing, dpo_loss_type, pref_ftx (an SFT term on the chosen responses) (docs/dpo.md). Saves a causal-LM checkpoint to megatron_training.save "
        "(actor_config.load, mindrl-convert mcore2hf) and ends with a line 'run dir: PATH' (metrics.jsonl, "
        "tensorboard/).",
        epilog="example: mindrl-train-dpo --config-name dpo_tiny_cpu megatron_training.train_iters=50 "
        "(a split needs quotes: megatron_training.split='\"90,10,0\"')",
    )


def _summary(result, seconds: float) -> list[str]:
    last = result.history[-1]
    lines, val = [], ""
    if "dpo/val_rewards/accuracy" in last:
        lines.append(
            f"DPO held-out reward accuracy: {last['dpo/val_rewards/accuracy']:.4f}, margin "
            f"{last['dpo/val_rewards/margin']:.4f}"
        )
        val = f", val_loss {last['dpo/val_loss']:.4f}"
    lines.append(
        f"mindrl-train-dpo: {result.iterations} steps in {seconds:.0f} s, loss {last['dpo/loss']:.4f}, reward "
        f"accuracy {last['dpo/rewards/accuracy']:.3f}{val}; checkpoint: {result.save_dir} "
        f"(iteration {result.saved_iterations[-1]})"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    from mindrl.cli.sft import run_trainer
    from mindrl.preflight import load_dpo_config
    from mindrl.trainer.dpo import train_dpo

    args = build_parser().parse_args(argv)
    return run_trainer("mindrl-train-dpo", args, load_dpo_config, train_dpo, _summary)


if __name__ == "__main__":
    sys.exit(main())
