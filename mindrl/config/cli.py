"""The config part of every mindrl command line: `--config-name NAME [--config-path DIR] [key=value ...]`,
hydra's spelling, so MindSpeed-RL launch lines carry over. `mindrl.preflight.config_from_args` loads what they name."""

from __future__ import annotations

import argparse

from mindrl.config.errors import ConfigError, Issue


def add_config_args(parser: argparse.ArgumentParser, default_name: str | None = None) -> None:
    """Add --config-name/-cn, --config-path/-cp, --no-check-paths and trailing key=value overrides."""
    group = parser.add_argument_group("config")
    group.add_argument(
        "--config-name",
        "-cn",
        default=default_name,
        required=default_name is None,
        help="config NAME: <config-path>/NAME.yaml (e.g. ppo_tiny_cpu), or a path to a YAML file",
    )
    group.add_argument(
        "--config-path",
        "-cp",
        default=None,
        help="folder of configs, with model files in DIR/model/NAME.yaml (default: the repo's configs/); "
        "a MindSpeed-RL configs/ folder works as is",
    )
    group.add_argument(
        "--no-check-paths",
        action="store_true",
        help="do not check that checkpoints, dataset and tokenizer exist (e.g. to validate a config elsewhere)",
    )
    group.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="hydra-style overrides: rl_config.epochs=2, actor_config.lr=1e-6, +rl_config.use_kl_in_reward=true, "
        "~rl_config.run_dir",
    )


def config_parser(prog: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """The parser of a mindrl command that takes a config: `prog`'s help texts and the config arguments."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    add_config_args(parser)
    return parser


def check_override_syntax(overrides: list[str]) -> None:
    """Raise one ConfigError naming every argument that is not an override (key=value or ~key)."""
    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise ConfigError([Issue(o, "an override must look like key=value (or ~key to delete)", "command line")
                           for o in bad])  # fmt: skip
