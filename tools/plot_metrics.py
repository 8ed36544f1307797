"""Plot a run's metrics.jsonl as one PNG: rewards, response length, KL, throughput, held-out accuracy (val/*), the
held-out responses' length and, when the evaluation sampled (val/<verifier>/pass@k), pass@k against k.

    python tools/plot_metrics.py RUN_DIR [--out PNG] [--smooth K]

Works on a live run (it only reads the file). Metrics absent from the file are skipped; null values
(non-finite metrics, see docs/metrics.md) are gaps in the lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

# (panel title, y label, fixed keys, extra-key predicate)
PANELS = [
    ("reward", "reward", ["reward/mean"], lambda k: k.endswith("_rewards/mean")),
    ("response length", "tokens", ["response_length/mean", "response_length/max", "response_length/min"], None),
    ("KL", "kl", ["actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"], None),
    ("throughput", "tokens / s / device", ["e2e_tps", "update_tps", "vllm_tps"], None),
    ("held-out accuracy", "score", [], lambda k: k.startswith("val/") and _is_val_score(k)),
    ("held-out response length", "tokens", ["val/response_length/mean", "val/sampled_response_length/mean"], None),
]


def _is_val_score(key: str) -> bool:
    """val/<verifier>/mean and val/<verifier>/pass@k (not the lengths or counts)."""
    parts = key.split("/")
    return len(parts) == 3 and "length" not in parts[1] and (parts[2] == "mean" or parts[2].startswith("pass@"))


def pass_at_k(rows: list[dict]) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """{verifier: {iteration: [(k, pass@k), ...] sorted by k}} from the rows' val/<verifier>/pass@k (null skipped)."""
    out: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for r in rows:
        for key, value in r.items():
            m = re.fullmatch(r"val/([^/]+)/pass@(\d+)", key)
            if m and value is not None:
                out.setdefault(m.group(1), {}).setdefault(r["iteration"], []).append((int(m.group(2)), float(value)))
    for per in out.values():
        for points in per.values():
            points.sort()
    return out


def _shown_iterations(iterations: list[int], most: int = 5) -> list[int]:
    """At most `most` of the evaluated iterations, evenly spread, always the first and the last."""
    if len(iterations) <= most:
        return iterations
    picks = {round(i * (len(iterations) - 1) / (most - 1)) for i in range(most)}
    return [iterations[i] for i in sorted(picks)]


def _plot_pass_at_k(ax, curves: dict[str, dict[int, list[tuple[int, float]]]]) -> None:
    """pass@k against k (log2 axis), one line per shown evaluated iteration and verifier."""
    ks: set[int] = set()
    for name, per in sorted(curves.items()):
        shown = _shown_iterations(sorted(per))
        colours = _colours(len(shown))
        for colour, it in zip(colours, shown):
            k, v = zip(*per[it])
            ks.update(k)
            label = f"iteration {it}" if len(curves) == 1 else f"{name}, iteration {it}"
            ax.plot(k, v, marker="o", color=colour, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ks), [str(k) for k in sorted(ks)])
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    title = "held-out pass@k" + (f" ({next(iter(curves))})" if len(curves) == 1 else "")
    ax.set_title(title)
    ax.set_xlabel("k (sampled responses per prompt)")
    ax.set_ylabel("pass@k")
    ax.grid(alpha=0.3)


def _colours(n: int) -> list:
    """`n` colours from early (light) to late (dark) iterations."""
    import matplotlib.pyplot as plt

    return [plt.get_cmap("viridis")(0.85 - 0.75 * i / max(n - 1, 1)) for i in range(n)]


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl, sorted by iteration. Unreadable lines (a live writer's last line) are skipped."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics file at {path} (is RUN_DIR the trainer's run dir?)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("iteration"), int):
                rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no iterations (empty, or no line with an integer 'iteration')")
    return sorted(rows, key=lambda r: r["iteration"])


def smooth(values: list[float], k: int) -> list[float]:
    """Trailing mean over the last `k` finite values; k <= 1 returns the values unchanged."""
    if k <= 1:
        return values
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - k + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    its = [r["iteration"] for r in rows if key in r]
    vals = [math.nan if r[key] is None else float(r[key]) for r in rows if key in r]
    return its, vals


def plot_metrics(run_dir: str, out: str | None = None, smooth_k: int = 1) -> str:
    """Draw RUN_DIR/metrics.jsonl into `out` (default RUN_DIR/metrics.png) and return the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works on headless nodes
    import matplotlib.pyplot as plt

    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    out = out or os.path.join(run_dir, "metrics.png")
    all_keys = list(dict.fromkeys(k for r in rows for k in r))

    curves = pass_at_k(rows)
    grid_rows = 4 if curves else 3
    fig, axes = plt.subplots(grid_rows, 2, figsize=(12, 4 * grid_rows), squeeze=False)
    if curves:
        _plot_pass_at_k(axes.flat[len(PANELS)], curves)
        axes.flat[len(PANELS) + 1].axis("off")
    for ax, (title, ylabel, fixed, extra) in zip(axes.flat, PANELS):
        keys = [k for k in fixed if k in all_keys]
        if extra is not None:
            keys += [k for k in all_keys if extra(k) and k not in keys]
        for key in keys:
            its, vals = _series(rows, key)
            if smooth_k > 1:
                (line,) = ax.plot(its, vals, alpha=0.25)
                ax.plot(its, smooth(vals, smooth_k), color=line.get_color(), label=key)
            else:
                ax.plot(its, vals, label=key, marker="o" if key.startswith("val/") else None)
        if keys:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    suffix = f" (trailing mean of {smooth_k})" if smooth_k > 1 else ""
    fig.suptitle(f"{os.path.abspath(run_dir)}{suffix}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the trainer's run dir (holds metrics.jsonl)")
    parser.add_argument("--out", metavar="PNG", help="output path (default: RUN_DIR/metrics.png)")
    parser.add_argument("--smooth", metavar="K", type=int, default=1, help="trailing mean over K iterations")
    args = parser.parse_args(argv)
    try:
        path = plot_metrics(args.run_dir, args.out, args.smooth)
    except (FileNotFoundError, ValueError) as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
