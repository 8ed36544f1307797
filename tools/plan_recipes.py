"""Plan every training recipe of a MindSpeed-RL configs/ folder unchanged: whether it loads, and whether it fits the
device its name says, as a table (text or markdown; docs/plan.md keeps the current one)."""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from dataclasses import dataclass

GIB = 1 << 30


@dataclass
class Row:
    recipe: str
    loads: bool
    device: str = ""
    fits: bool = False
    peak_gib: float = 0.0
    phase: str = ""
    largest: str = ""
    error: str = ""


def plan_recipe(configs: str, name: str, device: str | None) -> Row:
    from mindrl.config import ConfigError, load_config
    from mindrl.config.loader import config_stage
    from mindrl.plan import PlanError, make_plan
    from mindrl.preflight import load_dpo_config

    try:
        if config_stage(name, configs) == "dpo":  # offline DPO: mindrl-train-dpo's config, a training-only plan
            cfg = load_dpo_config(name, configs, check_paths=False)
        else:
            cfg = load_config(name, config_path=configs)
        plan = make_plan(cfg, device)
    except (ConfigError, PlanError, ValueError) as e:
        first = str(e).strip().splitlines()
        return Row(name, False, error=(first[1] if len(first) > 1 else first[0]).strip().removeprefix("- ")[:200])
    v = plan.verdict
    role, phase, term = v["largest_term"].split(".")
    largest = f"{role}.{term.removesuffix('_bytes')} {v['largest_term_bytes'] / GIB:.1f} GiB"
    return Row(name, True, plan.device.key, v["fits"], v["peak_bytes"] / GIB, v["peak_phase"], largest)


def recipes(configs: str) -> list[str]:
    """The folder's top-level YAML files that are training recipes (not model or dataset files): RL runs, and
    offline DPO (`stage: dpo`)."""
    names = []
    for path in sorted(glob.glob(os.path.join(configs, "*.yaml"))):
        with open(path) as f:
            text = f.read()
        if "rl_config:" in text or "actor_config:" in text or re.search(r"^\s+stage:\s*dpo\s*$", text, re.M):
            names.append(os.path.splitext(os.path.basename(path))[0])
    return names


def table(rows: list[Row], markdown: bool) -> str:
    head = ["recipe", "loads", "device", "fits", "peak GiB", "phase", "largest term"]
    body = []
    for r in rows:
        if r.loads:
            body.append(
                [r.recipe, "yes", r.device, "FITS" if r.fits else "no", f"{r.peak_gib:.1f}", r.phase, r.largest]
            )
        else:
            body.append([r.recipe, "no", "", "", "", "", r.error])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
        return "\n".join(out)
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head[:-1])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    return "\n".join(fmt.format(*row) for row in [head, *body])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tools/plan_recipes.py",
        description="Run mindrl's planner on every training recipe of a MindSpeed-RL configs/ folder, unchanged, and "
        "print whether each loads and fits the device its name says (_A3: one Atlas A3 die, _A2: a 910B).",
    )
    p.add_argument("configs", help="a MindSpeed-RL configs/ folder (its model/ files next to the recipes)")
    p.add_argument("--device", default=None, help="plan every recipe on this device instead (see mindrl-plan)")
    p.add_argument("--markdown", action="store_true", help="a markdown table")
    a = p.parse_args(argv)
    if not os.path.isdir(a.configs):
        print(f"tools/plan_recipes.py: error: {a.configs} is not a folder", file=sys.stderr)
        return 2
    rows = [plan_recipe(a.configs, name, a.device) for name in recipes(a.configs)]
    print(table(rows, a.markdown))
    print(f"\n{sum(r.loads for r in rows)} of {len(rows)} recipes load; {sum(r.fits for r in rows)} fit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
