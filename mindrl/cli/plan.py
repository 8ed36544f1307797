"""mindrl-plan (also `mindrl-train ... --dry-run`): a config's placement, layouts, memory per device and phase, and
verdict, without starting Ray or building a model (docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import sys


def add_plan_args(p: argparse.ArgumentParser) -> None:
    from mindrl.plan.devices import CHOICES

    g = p.add_argument_group("plan")
    g.add_argument("--json", action="store_true", help="print one JSON object (memory.<role>.<phase>.<term> in bytes)")
    g.add_argument("--device", choices=CHOICES, default=None,
                   help="the device to check against: 910b or a2 (64 GiB), a3 (64 GiB per die), h100 (80 GiB), "
                   "host (CPU stand-ins sharing this host's RAM); each with its platform's kernels; default: named "
                   "in the config name (..._A3, ..._A2), else the current platform's")  # fmt: skip
    g.add_argument("--device-memory-gib", type=float, default=None, help="override the device's memory (GiB)")
    g.add_argument("--devices-per-node", type=int, default=None, help="override devices per node (A3: 16, else 8)")


def build_parser() -> argparse.ArgumentParser:
    from mindrl.config.cli import config_parser

    p = config_parser(
        "mindrl-plan",
        "Plan a PPO / GRPO run without starting it: which device of which node holds which rank of "
        "the actor, reference, critic and rollout engine; each model's TP/PP/DP/VPP/SP and engine replicas; "
        "memory per device in every phase (weights, grads, optimizer state, activations with and without "
        "recomputation, KV cache); and a verdict naming the largest term and the key that shrinks it. "
        "A DPO config (stage: dpo, mindrl-train-dpo's) is planned as a training-only run: no engine, no rollout. "
        "Checkpoint and data paths need not exist. See docs/plan.md.",
    )
    add_plan_args(p)
    return p


def run_plan(args: argparse.Namespace, cfg=None, prog: str = "mindrl-plan") -> int:
    """Load the config (unless given), print the plan; 0 when it fits, 1 when it does not, 2 on a bad config."""
    from mindrl.config import ConfigError
    from mindrl.config.loader import config_stage
    from mindrl.plan import PlanError, make_plan, to_json, to_text
    from mindrl.preflight import check_override_syntax, config_from_args, load_dpo_config

    try:
        if cfg is None and config_stage(args.config_name, args.config_path, args.overrides) == "dpo":
            check_override_syntax(args.overrides)  # a training-only plan (mindrl.plan.offline)
            cfg = load_dpo_config(args.config_name, args.config_path, list(args.overrides),
                                  check_paths=not getattr(args, "no_check_paths", False))  # fmt: skip
        elif cfg is None:
            cfg = config_from_args(args)
        plan = make_plan(cfg, args.device, args.device_memory_gib, args.devices_per_node)
    except (ConfigError, PlanError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(plan), indent=2) if args.json else to_text(plan))
    return 0 if plan.verdict["fits"] else 1


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    args = build_parser().parse_args(argv)
    args.no_check_paths = True  # a plan is made on a laptop, away from the checkpoints and data
    return run_plan(args)


if __name__ == "__main__":
    sys.exit(main())
