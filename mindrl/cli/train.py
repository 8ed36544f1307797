"""mindrl-train: PPO / GRPO from a MindSpeed-RL-style YAML config, on Ray integrated workers:
`mindrl-train --config-name ppo_tiny_cpu [--config-path DIR] [rl_config.epochs=2 ...]`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time


class Terminated(KeyboardInterrupt):
    """SIGTERM to the driver (a scheduler's pre-emption, `kill PID`, a container stop): raised in the main thread,
    it takes Ctrl-C's way out: the workers, the engines' shared memory and Ray are shut down by train's cleanup."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short (SIGKILL can)
    raise Terminated()


def build_parser() -> argparse.ArgumentParser:
    from mindrl.config.cli import config_parser

    p = config_parser(
        "mindrl-train",
        "Train a policy with PPO or GRPO (rl_config.adv_estimator) on megatron-core with vLLM rollouts "
        "in the same processes (integrated workers), orchestrated by Ray. The config follows MindSpeed-RL's schema; "
        "see docs/config.md and docs/trainer.md. Ends with a line 'run dir: PATH' (metrics.jsonl, rollouts.jsonl, "
        "tensorboard/).",
    )
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (placement, layouts, memory per device, verdict; see mindrl-plan) and exit "
                   "without starting Ray")  # fmt: skip
    from mindrl.cli.plan import add_plan_args

    add_plan_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    args = build_parser().parse_args(argv)
    if args.dry_run:
        from mindrl.cli.plan import run_plan

        return run_plan(args, prog="mindrl-train --dry-run")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from mindrl.config import ConfigError
    from mindrl.preflight import config_from_args
    from mindrl.trainer.ppo_trainer import TrainingAborted, train
    from mindrl.workers.group import WorkerError

    start = time.perf_counter()
    main_thread = threading.current_thread() is threading.main_thread()  # only there can signals be handled
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        cfg = config_from_args(args)
        run_dir, results = train(cfg)
    except (ConfigError, FileNotFoundError) as e:
        print(f"mindrl-train: error: {e}", file=sys.stderr)
        return 2
    except (TrainingAborted, WorkerError) as e:
        print(f"mindrl-train: aborted: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # the workers and Ray were shut down on the way out (train's finally)
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"mindrl-train: {how}; resume from the last complete checkpoint (finetune: false)", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(f"mindrl-train: {len(results)} iterations in {time.perf_counter() - start:.0f} s")
    print(f"run dir: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
