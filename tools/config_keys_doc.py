"""docs/config.md's table of the MindSpeed-RL keys mindrl ignores, or accepts with mindrl's own value only, written from
the config classes: `python tools/config_keys_doc.py` rewrites it; tests/config/test_key_docs.py checks that the doc and
the code agree."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "config.md")
BEGIN = "<!-- key table: written by tools/config_keys_doc.py from the config classes; edit those, then rerun it -->"
END = "<!-- key table end -->"
ANY = "any value"
MEGATRON = "megatron"
PREPROCESS = "mindrl-preprocess (dataset YAML)"


def _value(v: Any) -> str:
    return "null" if v is None else "true" if v is True else "false" if v is False else repr(v)


def _unsupported(rule: tuple[tuple[Any, ...], str]) -> tuple[str, str]:
    neutral, what = rule
    return " or ".join(f"`{_value(v)}`" for v in neutral) + " only", f"refused otherwise: {what}"


def _fields(cls: type) -> Iterator[tuple[str, str, str]]:
    for f in dataclasses.fields(cls):
        if "ignored" in f.metadata:
            yield f.name, ANY, f.metadata["ignored"]


def _section(cls: type) -> Iterator[tuple[str, str, str]]:
    """(key, accepted values, why) of a Section class's IGNORED, UNSUPPORTED and ignored fields."""
    for key, why in cls.IGNORED.items():
        yield key, ANY, why
    for key, rule in cls.UNSUPPORTED.items():
        yield (key, *_unsupported(rule))
    yield from _fields(cls)


def rows() -> list[tuple[str, str, str, str]]:
    """(key, where, accepted, why), sorted by key then where."""
    from mindrl.config.dpo import DPOTrainingConfig
    from mindrl.config.generate import GenerateConfig, SamplingSection
    from mindrl.config.loader import IGNORED_SECTIONS
    from mindrl.config.megatron import (
        MEGATRON_IGNORED,
        MEGATRON_UNSUPPORTED,
        MegatronTrainingConfig,
        RoleConfig,
    )
    from mindrl.config.model import ModelArchConfig
    from mindrl.config.profiler import ProfilerConfig, ProfilerSection
    from mindrl.config.reward_model import RMTrainingConfig
    from mindrl.config.rl import RLSectionConfig
    from mindrl.config.sft import SFTTrainingConfig
    from mindrl.data.preprocess_config import IGNORED_MINDSPEED_KEYS, ONE_VALUE_KEYS

    out: dict[tuple[str, str], tuple[str, str]] = {}
    for key, why in MEGATRON_IGNORED.items():
        out[key, MEGATRON] = (ANY, why)
    for key, rule in MEGATRON_UNSUPPORTED.items():
        out[key, MEGATRON] = _unsupported(rule)
    for cls in (MegatronTrainingConfig, RoleConfig, ModelArchConfig):
        for key, accepted, why in _fields(cls):
            out[key, MEGATRON] = (accepted, why)
    sections = [(RLSectionConfig, "rl_config"), (GenerateConfig, "generate_config"),
                (SamplingSection, "generate_config.sampling_config"), (ProfilerConfig, "profiler_config"),
                (ProfilerSection, "profiler_config.<role>")]  # fmt: skip
    for cls, where in sections:
        for key, accepted, why in _section(cls):
            out[key, where] = (accepted, why)
    for key, why in IGNORED_SECTIONS.items():
        out[key, "(a whole section)"] = (ANY, why)
    for key, why in IGNORED_MINDSPEED_KEYS.items():
        out[key, PREPROCESS] = (ANY, why)
    for key, (value, handlers, what) in ONE_VALUE_KEYS.items():
        accepted = f"`{_value(value)}` only" + (f" with {', '.join(handlers)}" if handlers else "")
        out[key, PREPROCESS] = (accepted, f"refused otherwise: {what}")
    # The offline trainers' megatron_training: a row per key, naming the trainers that share it.
    offline = {
        "mindrl-sft": SFTTrainingConfig,
        "mindrl-train-rm": RMTrainingConfig,
        "mindrl-train-dpo": DPOTrainingConfig,
    }
    by_key: dict[tuple[str, str, str], list[str]] = {}
    for cli, cls in offline.items():
        for key, accepted, why in _section(cls):
            by_key.setdefault((key, accepted, why), []).append(cli)
    for (key, accepted, why), clis in by_key.items():
        out[key, f"megatron_training of {', '.join(clis)}"] = (accepted, why)
    return sorted((k, w, a, y) for (k, w), (a, y) in out.items())


def render() -> str:
    lines = [BEGIN, "", "| key | where | accepted | why |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {w} | {a} | {y.replace('|', '/')} |" for k, w, a, y in rows()]
    return "\n".join([*lines, "", END])


def current_block(text: str) -> str | None:
    """The generated block of docs/config.md's text, or None without its markers."""
    start, end = text.find(BEGIN), text.find(END)
    return text[start : end + len(END)] if 0 <= start < end else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/config_keys_doc.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/config.md's table is not the code's")
    args = p.parse_args(argv)
    text = open(DOC).read()
    block = current_block(text)
    if block is None:
        print(f"{DOC}: no table markers ({BEGIN!r} ... {END!r})", file=sys.stderr)
        return 1
    fresh = render()
    if args.check:
        return 0 if block == fresh else 1
    if block != fresh:
        with open(DOC, "w") as f:
            f.write(text.replace(block, fresh))
        print(f"{DOC}: key table rewritten ({len(rows())} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
