"""Did a run learn? The mean of a metric (a reward or a held-out accuracy) over the last iterations against its mean
over the first ones, with a bound on the rise; exit 1 when the rise is below the bound.

    python tools/check_learning.py RUN_DIR --run quickstart-ppo            # a bound measured for that run (BOUNDS)
    python tools/check_learning.py RUN_DIR --key KEY --window N --min-rise X

RUN_DIR holds metrics.jsonl (a path to the .jsonl itself works too). Rows without the key, or with null (a
non-finite value, see docs/metrics.md), are skipped: an evaluation key appears only on evaluated iterations. Each
bound in BOUNDS was derived from runs over several seeds, with the learning rate and with the actor's learning rate
at 1e-12 (no learning: the rise is sampling noise); its comment gives both spreads and how to reproduce them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolUse:
    """An agent run's tools work: over its last `window` iterations at least `calls` tool-call blocks per episode
    (agent/tool_calls_mean), and at least a share `success` of all its blocks answered without an error
    (1 - agent/tool_errors / agent/tool_calls: malformed calls and failed runs count against it)."""

    window: int
    calls: float
    success: float


@dataclass(frozen=True)
class Bound:
    """What to compare in one kind of run: `key`'s mean over the first `window` rows against the last `window`;
    the run learned when the rise (last - first) is >= `min_rise`, or for a metric that `falls` (a loss) when the
    fall (first - last) is. `keys` beyond the first are fallbacks, in order, for runs that do not log the first.
    `tools`: an agent run's tool use, checked as well."""

    keys: tuple[str, ...]
    window: int
    min_rise: float
    falls: bool = False
    tools: ToolUse | None = None


@dataclass(frozen=True)
class Rise:
    key: str
    first: float  # mean over the first window
    last: float  # mean over the last window
    rows: int  # rows that hold the key
    window: int

    @property
    def rise(self) -> float:
        return self.last - self.first

    def gain(self, falls: bool = False) -> float:
        """The rise, or for a metric that falls the fall."""
        return -self.rise if falls else self.rise


class NotLearning(AssertionError):
    """The rise is below its bound (an AssertionError: a test that calls assert_rises fails as on an assert)."""


# DAPO trains on the prompts whose samples disagree: the policy's own reward is that of every sampled response.
REWARD_KEYS = ("train/generated_reward_mean", "acc_for_ppo_rewards/mean")

# How each bound was derived: the quickstart's assets (`bash examples/quickstart_cpu.sh [dapo]`: the SFT start), then
# its RL step on them over seeds S, learning and not:
#   mindrl-train --config-name ALGO_tiny_cpu megatron_training.seed=S megatron_training.train_iters=N \
#       rl_config.run_dir=R [actor_config.lr=1e-12]  # N 30 (40 at lr 1e-12); plus the quickstart's load/save/data paths
#   python tools/check_learning.py R --window 10 --min-rise 0   # prints the rise
# At lr 1e-12 the policy does not move, so the rise is the noise of two window means; its iterations are then
# exchangeable, and its spread is taken over every pair of disjoint 10-iteration blocks of each such 40-iteration run
# (later minus earlier). The bound is the midpoint between that noise's max and the learning runs' min, rounded down
# to 0.01. Windows of 10, not 5: with 5, PPO's noise max (+0.162) came within 0.03 of its learning min (+0.188).
# A bound holds for runs of >= 30 iterations: the reward rises over the first ~20 and then stays (PPO seed 1234,
# 60 iterations: +0.281 at 30, +0.306 at 60).
BOUNDS: dict[str, Bound] = {
    # PPO, 30 iterations, seeds 1, 2, 3, 1234: rise mean +0.277, min +0.213, max +0.319.
    # lr 1e-12, seeds 1, 2: 12 block pairs mean +0.021, min -0.031, max +0.075 (per-iteration sd 0.14, 0.13: the
    # sd of a window-10 rise 0.061; the bound is 2.3 of it).
    "quickstart-ppo": Bound(("acc_for_ppo_rewards/mean",), 10, 0.14),
    # The same PPO in bf16 (tests/trainer/test_bf16_e2e.py's BF16 overrides: bf16 actor, critic and reference with
    # fp32 main params, vLLM in bfloat16, TIS at 2.0), 30 iterations, seeds 1234, 1, 2, 3: rise +0.200, +0.312,
    # +0.206, +0.275. lr 1e-12, seeds 1, 2: 12 block pairs mean +0.027, min -0.025, max +0.094 (per-iteration sd
    # 0.145, 0.127: the sd of a window-10 rise 0.061; the bound is 2.3 of it). At 24 iterations and windows of 8 seed
    # 2 rose only +0.133.
    "quickstart-ppo-bf16": Bound(("acc_for_ppo_rewards/mean",), 10, 0.14),
    # GRPO, 30 iterations, seeds 1, 2, 3: rise mean +0.250, min +0.234, max +0.281.
    # lr 1e-12, seeds 1, 2: 12 block pairs mean -0.010, min -0.088, max +0.044 (per-iteration sd 0.12, 0.10: the
    # sd of a window-10 rise 0.048; the bound is 2.7 of it).
    "quickstart-grpo": Bound(("acc_for_ppo_rewards/mean",), 10, 0.13),
    # The same GRPO run through LoRA adapters (tests/trainer/test_lora_e2e.py: r 8, alpha 16 on every linear, lr 3e-3,
    # share_backbone), 30 iterations, seeds 1234, 1, 2: rise +0.312, +0.250, +0.253. No learning is the same run
    # either way (a policy that does not move samples alike with or without adapters): quickstart-grpo's lr 1e-12
    # spread, max +0.044. The bound is the midpoint.
    #   mindrl-train --config-name grpo_tiny_cpu + quickstart_cpu.sh grpo's step-5 paths, train_iters=30,
    #       '+actor_config.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]' +actor_config.lora_r=8
    #       +actor_config.lora_alpha=16 actor_config.lr=3e-3 +rl_config.share_backbone=true megatron_training.seed=S
    "quickstart-grpo-lora": Bound(("acc_for_ppo_rewards/mean",), 10, 0.14),
    # DAPO (the tiny Qwen3's own SFT start), train/generated_reward_mean (every sampled response, kept or filtered),
    # 30 iterations, seeds 1, 1234: rise +0.284, +0.270 (seed 1234: +0.324 at its config's 40).
    # lr 1e-12, seed 1: 6 block pairs mean -0.007, min -0.021, max +0.016 (per-iteration sd 0.068: the sd of a
    # window-10 rise 0.031; the bound is 4.5 of it).
    "quickstart-dapo": Bound(("train/generated_reward_mean",), 10, 0.14),
    # Multi-turn GRPO with the code tool (`quickstart_cpu.sh retool`: retool_tiny_cpu from its 300-step SFT start),
    # 20 iterations, windows of 5 (the reward rises within ~6 iterations, then holds; at windows of 8 or 10 the
    # first window already holds the rise: seed 2 +0.120, +0.086): seeds 1234, 1, 2: rise +0.544, +0.366, +0.334.
    # lr 1e-12, seeds 1, 2 (20 iterations each): 12 block pairs mean +0.044, min -0.054, max +0.161 (per-iteration
    # sd 0.17, 0.21: the sd of a window-5 rise ~0.12; the bound is 2 of it, the learning min 0.09 above it). The
    # bound is the midpoint. Tools, last 5 iterations: calls per episode 0.98, 0.97, 0.95 learning against 0.56,
    # 0.56 at lr 1e-12 (bound: the midpoint, 0.75); calls answered without an error 0.955-0.978 either way (bound
    # 0.8: a policy whose calls mostly fail).
    #   mindrl-train --config-name retool_tiny_cpu megatron_training.seed=S [actor_config.lr=1e-12] + step 5's paths
    "quickstart-retool": Bound(("retool_reward_rewards/mean",), 5, 0.24, tools=ToolUse(5, 0.75, 0.8)),
    # examples/rlhf/run_3stage_cpu.sh, each stage from the quickstart's assets (SFT_OUT), measured the same way
    # (seed S: megatron_training.seed=S; no learning: lr 0, or the actor's lr 1e-12 for PPO):
    # SFT (sft_tiny_cpu), sft/loss falls. Its first 20 steps are the same in a 20-step and a 300-step run (the lr
    # warm-up) and the fall only grows after them (seed 1234: +4.124 at 20 steps, +5.415 at 300), so the learning
    # spread is taken at 20 steps: seeds 1234, 1, 2: fall +4.124, +4.136, +4.128. lr 0, seed 1, 40 steps: 6 block
    # pairs mean +0.002, min -0.001, max +0.004 (per-step sd 0.006).
    #   mindrl-sft --config-name sft_tiny_cpu megatron_training.seed=S megatron_training.train_iters=20 + paths
    "rlhf3-sft": Bound(("sft/loss",), 10, 2.06, falls=True),
    # The reward model (rm_tiny_cpu, its 150 steps, on the script's pairs: its PREF_ARGS), rm/accuracy (each step's
    # 16 training pairs), windows of 25 (with 10, learning min +0.219 against noise max +0.181): seeds 1234, 1, 2:
    # rise +0.232, +0.247, +0.245. lr 0, seeds 1, 2: 30 block pairs mean -0.001, min -0.083, max +0.062 (per-step
    # sd 0.114, 0.126: the sd of a window-25 rise 0.034).
    #   mindrl-train-rm --config-name rm_tiny_cpu megatron_training.seed=S [megatron_training.lr=0
    #       megatron_training.min_lr=0] + the paths of examples/rlhf/train_rm_cpu.sh
    "rlhf3-rm": Bound(("rm/accuracy",), 25, 0.14),
    # PPO against that reward model (its seed 1234): `mindrl-train --config-name ppo_tiny_cpu_rm` with the script's
    # step-5 overrides, megatron_training.seed=S, train_iters 30 (40 at lr 1e-12). The metric is the rule check
    # acc_for_ppo, which the reward does not see (weight 0): seeds 1, 2, 3: rise +0.231, +0.181, +0.256. lr 1e-12,
    # seeds 1, 2: 12 block pairs mean +0.021, min -0.031, max +0.075 (the sd of a window-10 rise 0.061). The reward
    # model's own score, reward_model/score/mean, has no bound: its per-iteration sd is ~1.08 (the sd of a window-10
    # rise 0.48), and at 30 iterations its rise over the learning seeds (+0.753, +0.920, +0.376) overlaps its
    # no-learning spread (12 block pairs, min -0.318, max +0.410): no bound separates them.
    "rlhf3-ppo": Bound(("acc_for_ppo_rewards/mean",), 10, 0.12),
}


def read_rows(path: str) -> list[dict]:
    """metrics.jsonl's rows; `path` is a run dir or the file. Errors name the file and the line."""
    file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: no such file (expected a run dir holding metrics.jsonl, or the file)")
    rows = []
    with open(file) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file}:{n}: not a JSON line ({e.msg})") from None
    return rows


def measure(rows: list[dict], keys: tuple[str, ...] | str, window: int, where: str = "metrics") -> Rise:
    """The first key of `keys` that some row holds: its first-`window` and last-`window` means. ValueError when no
    row holds any of the keys, or fewer than 2 * window rows hold it (the windows would overlap)."""
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    for key in keys:
        values = [float(r[key]) for r in rows if r.get(key) is not None and math.isfinite(float(r[key]))]
        if values:
            break
    else:
        raise ValueError(f"{where}: no row holds {' or '.join(keys)} ({len(rows)} rows)")
    if len(values) < 2 * window:
        raise ValueError(f"{where}: {len(values)} rows hold {key}, fewer than 2 windows of {window}: run more "
                         f"iterations or use a smaller window")  # fmt: skip
    first, last = values[:window], values[-window:]
    return Rise(key, sum(first) / window, sum(last) / window, len(values), window)


def message(r: Rise, min_rise: float, falls: bool = False) -> str:
    way = "fall" if falls else "rise"
    failed = f"FAILED: the {'loss did not fall' if falls else 'reward did not rise'}"
    return (f"learning check: {r.key} first-{r.window} mean {r.first:.3f} -> last-{r.window} mean {r.last:.3f} "
            f"({r.rows} iterations): {way} {r.gain(falls):+.3f}, bound {min_rise:+.3f}: "
            f"{'ok' if r.gain(falls) >= min_rise else failed}")  # fmt: skip


def tool_use(rows: list[dict], t: ToolUse, where: str = "metrics") -> tuple[bool, str]:
    """(whether the last `t.window` rows meet `t`, the message); ValueError when fewer rows hold the agent metrics."""
    keys = ("agent/tool_calls_mean", "agent/tool_calls", "agent/tool_errors")
    last = [r for r in rows if all(r.get(k) is not None for k in keys)][-t.window :]
    if len(last) < t.window:
        raise ValueError(f"{where}: {len(last)} rows hold {', '.join(keys)}, fewer than {t.window}")
    calls = sum(r["agent/tool_calls_mean"] for r in last) / t.window
    blocks = sum(r["agent/tool_calls"] for r in last)
    success = 1 - sum(r["agent/tool_errors"] for r in last) / blocks if blocks else 0.0
    ok = calls >= t.calls and success >= t.success
    return ok, (f"tool check: last-{t.window} tool calls per episode {calls:.2f} (bound {t.calls:.2f}), answered "
                f"without an error {success:.3f} (bound {t.success:.3f}): "
                f"{'ok' if ok else 'FAILED: the tools are not used, or fail'}")  # fmt: skip


def assert_rises(rows: list[dict], bound: Bound, where: str = "metrics") -> Rise:
    """The Rise when it meets the bound (for a Bound that `falls`: when the fall does); else NotLearning with
    message()."""
    r = measure(rows, bound.keys, bound.window, where)
    if r.gain(bound.falls) < bound.min_rise:
        raise NotLearning(f"{where}: {message(r, bound.min_rise, bound.falls)}")
    if bound.tools is not None:
        ok, text = tool_use(rows, bound.tools, where)
        if not ok:
            raise NotLearning(f"{where}: {text}")
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                epilog="named bounds (--run):\n" + "\n".join(
                                    f"  {n}: {' or '.join(b.keys)}, window {b.window}, "
                                    f"min {'fall' if b.falls else 'rise'} {b.min_rise}"
                                    for n, b in BOUNDS.items()))  # fmt: skip
    p.add_argument("run_dir", help="a run dir holding metrics.jsonl, or the .jsonl file")
    p.add_argument("--run", choices=sorted(BOUNDS), help="a measured bound: its keys, window and min rise")
    p.add_argument("--key", action="append", help="the metric (repeat: fallbacks in order; default: the --run's, "
                   f"else {' or '.join(REWARD_KEYS)})")  # fmt: skip
    p.add_argument("--window", type=int, help="iterations in each window (default: the --run's)")
    p.add_argument("--min-rise", type=float, help="the least last-minus-first rise that passes (default: the --run's)")
    p.add_argument("--falls", action="store_true", help="the metric is a loss: the least first-minus-last fall "
                   "that passes is --min-rise (default: the --run's)")  # fmt: skip
    a = p.parse_args(argv)
    base = BOUNDS[a.run] if a.run else None
    keys = tuple(a.key) if a.key else (base.keys if base else REWARD_KEYS)
    window = a.window if a.window is not None else (base.window if base else None)
    min_rise = a.min_rise if a.min_rise is not None else (base.min_rise if base else None)
    falls = a.falls or (base.falls if base else False)
    if window is None or min_rise is None:
        p.error("give --run, or both --window and --min-rise")
    try:
        rows = read_rows(a.run_dir)
        r = measure(rows, keys, window, where=a.run_dir)
        tools = tool_use(rows, base.tools, a.run_dir) if base and base.tools else None
    except (OSError, ValueError) as e:
        print(f"learning check: error: {e}", file=sys.stderr)
        return 2
    ok = r.gain(falls) >= min_rise
    print(message(r, min_rise, falls), file=sys.stdout if ok else sys.stderr)
    if tools is not None:
        print(tools[1], file=sys.stdout if tools[0] else sys.stderr)
        ok = ok and tools[0]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
