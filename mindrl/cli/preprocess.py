"""mindrl-preprocess: tokenise a raw dataset into Megatron indexed datasets from a MindSpeed-RL dataset YAML, e.g.
`mindrl-preprocess --config configs/datasets/deepscaler.yaml input=... output_prefix=... workers=2`."""

from __future__ import annotations

import argparse
import sys

from mindrl.data.preprocess_config import PreprocessConfig


def _key_help() -> str:
    lines = []
    for name, f in PreprocessConfig.__dataclass_fields__.items():
        default = f.default if not callable(f.default_factory) else f.default_factory()
        lines.append(f"  {name} (default {default!r})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mindrl-preprocess",
        description="Tokenise a JSON / JSONL / parquet dataset (or a directory of them) with a chat template into "
        "Megatron indexed datasets {output_prefix}_packed_{input_ids,attention_mask,labels}_document.{bin,idx}, "
        "plus {output_prefix}_report.json listing skipped rows. See docs/data.md.",
        epilog="config keys (YAML or key=value):\n" + _key_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="dataset YAML, e.g. configs/datasets/deepscaler.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. workers=2 strict=true")
    return p


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    args = build_parser().parse_args(argv)
    # Imported here so that --help answers without loading transformers.
    from mindrl.data.preprocess import BadRowError, preprocess
    from mindrl.data.preprocess_config import ConfigError, load_preprocess_config
    from mindrl.data.readers import InputError

    try:
        cfg, ignored = load_preprocess_config(args.config, args.overrides)
        if ignored:
            print(f"[mindrl-preprocess] ignoring keys mindrl does not use: {', '.join(ignored)}", file=sys.stderr)
        preprocess(cfg)
    except (ConfigError, InputError, BadRowError) as e:
        print(f"mindrl-preprocess: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
