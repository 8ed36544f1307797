"""The preprocessing config: MindSpeed-RL's dataset YAML (configs/datasets/*.yaml) plus `key=value` overrides, checked
once, with messages that name the key, where it came from, and the close matches."""

from __future__ import annotations

import difflib
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import yaml

from mindrl.data.handlers import MAP_KEY_NAMES

# Keys of MindSpeed-RL's dataset YAMLs that cannot change what is written here: accepted (so its configs load) and
# listed as ignored, with the reason. docs/data.md lists them.
IGNORED_MINDSPEED_KEYS: dict[str, str] = {
    "neat_pack": "read only with pack, which mindrl refuses",
    "keep_newlines": "read only with split_sentences, which mindrl refuses",
    "tokenizer_not_use_fast": "a model's slow and fast tokenizers give the same ids; mindrl loads the fast one",
    "n_subs": "how MindSpeed-RL splits the input over its processes; workers does that here",
    "json_keys": "each handler sets its own documents, in MindSpeed-RL too (handler_name decides them)",
    "overwrite_cache": "Hugging Face datasets' cache of the raw rows; mindrl reads the input files directly",
    "cache_dir": "Hugging Face datasets' cache of the raw rows; mindrl reads the input files directly",
    "script_data_dir": "Hugging Face dataset loading scripts; mindrl reads .json, .jsonl and .parquet files",
}
# Keys accepted only with mindrl's value, where a handler reads them (None: every handler): key -> (that value, the
# handlers, what another value would turn on). With a handler that does not read it (MindSpeed-RL's doesn't either),
# any value is ignored.
ONE_VALUE_KEYS: dict[str, tuple[Any, tuple[str, ...] | None, str]] = {
    "pack": (False, None, "packing rows into sequences of seq_length tokens"),
    "split_sentences": (False, None, "one document per sentence (pretraining data)"),
    "append_eod": (False, ("AlpacaStyleInstructionHandler",), "an end-of-document token after each SFT sample"),
    "enable_thinking": (
        False,
        ("AlpacaStylePairwiseHandler",),
        "the thinking template's empty thought at the start of each response instead of the prompt's end",
    ),
}
SUPPORTED_TOKENIZER_TYPES = ("HuggingFaceTokenizer",)


class ConfigError(ValueError):
    """A config value is wrong; raised before anything is read or written."""


@dataclass
class PreprocessConfig:
    """Everything `mindrl-preprocess` needs. Field names follow MindSpeed-RL's dataset YAML."""

    input: str = ""
    """A .json (list or JSON lines), .jsonl or .parquet file, or a directory of them (read in name order)."""
    tokenizer_name_or_path: str = ""
    """Local directory of a Hugging Face tokenizer (the model's HF checkpoint directory)."""
    output_prefix: str = ""
    """Writes {output_prefix}_packed_{key}_document.{bin,idx} and {output_prefix}_report.json."""
    handler_name: str = "R1AlpacaStyleInstructionHandler"
    """How a row becomes a document; see mindrl.data.handlers.HANDLERS."""
    tokenizer_type: str = "HuggingFaceTokenizer"
    """Only Hugging Face tokenizers are supported."""
    workers: int = 1
    """Tokenising processes; any value gives byte-identical output."""
    log_interval: int = 1000
    """A progress line (rows, rows/s) every this many input rows."""
    prompt_type: str = "empty"
    """Chat template name in configs/model/templates.json."""
    map_keys: dict[str, str] = field(default_factory=dict)
    """Role -> row field: prompt, query, response, system (pairwise: chosen, rejected, margin). '' leaves a role unused."""
    dataset_additional_keys: list[str] = field(default_factory=list)
    """Extra documents to write: 'labels' (from the handler) or raw string columns of the row, tokenised."""
    strict: bool = False
    """Any bad row stops the run instead of being skipped and reported."""
    templates_path: str = ""
    """Another templates file; empty = configs/model/templates.json."""
    chunk_rows: int = 256
    """Rows per tokenisation task; affects speed only, never the output."""
    seq_length: int | None = None
    """Rows with a document of seq_length tokens or more are dropped and counted in the report (MindSpeed-RL's rule);
    None keeps every row."""

    def validate(self, where: str = "config") -> None:
        for name in ("input", "tokenizer_name_or_path", "output_prefix"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{where}: '{name}' is required (a path), got {getattr(self, name)!r}")
        for name in ("workers", "log_interval", "chunk_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{where}: '{name}' must be an integer >= 1, got {v!r}")
        if self.seq_length is not None and (
            isinstance(self.seq_length, bool) or not isinstance(self.seq_length, int) or self.seq_length < 1
        ):
            raise ConfigError(f"{where}: 'seq_length' must be an integer >= 1 (or null), got {self.seq_length!r}")
        if not isinstance(self.strict, bool):
            raise ConfigError(f"{where}: 'strict' must be true or false, got {self.strict!r}")
        if self.tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
            raise ConfigError(
                f"{where}: tokenizer_type '{self.tokenizer_type}' is not supported; use one of {SUPPORTED_TOKENIZER_TYPES}"
            )
        if not isinstance(self.map_keys, dict):
            raise ConfigError(
                f'{where}: \'map_keys\' must be a mapping like {{"prompt": "problem"}}, got {self.map_keys!r}'
            )
        for role, key in self.map_keys.items():
            if role not in MAP_KEY_NAMES:
                raise ConfigError(
                    f"{where}: map_keys has unknown role '{role}'{_close(role, MAP_KEY_NAMES)}; roles: {', '.join(MAP_KEY_NAMES)}"
                )
            if not isinstance(key, str):
                raise ConfigError(f"{where}: map_keys['{role}'] must be a field name (string), got {key!r}")
        if not isinstance(self.dataset_additional_keys, list) or not all(
            isinstance(k, str) and k for k in self.dataset_additional_keys
        ):
            raise ConfigError(
                f"{where}: 'dataset_additional_keys' must be a list of names, got {self.dataset_additional_keys!r}"
            )
        if "input_ids" in self.dataset_additional_keys or "attention_mask" in self.dataset_additional_keys:
            raise ConfigError(
                f"{where}: dataset_additional_keys must not repeat 'input_ids'/'attention_mask' (always written)"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _close(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=3)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _apply(
    values: dict[str, Any],
    cfg_fields: set[str],
    source: str,
    out: dict[str, Any],
    ignored: list[str],
    one_value: dict[str, tuple[Any, str]],
) -> None:
    for key, value in values.items():
        if not isinstance(key, str):  # YAML reads `1:` or `null:` as a number / None
            raise ConfigError(f"{source}: key {key!r} is not a name; keys are strings like 'input'")
        if key in cfg_fields:
            out[key] = value
        elif key in IGNORED_MINDSPEED_KEYS:
            ignored.append(f"{key} ({source})")
        elif key in ONE_VALUE_KEYS:
            one_value[key] = (value, source)  # judged once the handler is known
        else:
            raise ConfigError(
                f"{source}: unknown key '{key}'{_close(key, cfg_fields)}; known keys: {', '.join(sorted(cfg_fields))}"
            )


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value`, the value read as YAML so that workers=2 is an int and strict=true a bool."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML: {e}") from None
    # A path like "dataset/x.json" stays a string; YAML would only ever change numbers/bools/lists/maps.
    return key.strip(), value


def load_preprocess_config(path: str | None, overrides: list[str] = ()) -> tuple[PreprocessConfig, list[str]]:
    """Read the YAML at `path` (may be None), apply the overrides; returns the config and the ignored keys."""
    cfg_fields = {f.name for f in fields(PreprocessConfig)}
    values: dict[str, Any] = {}
    ignored: list[str] = []
    one_value: dict[str, tuple[Any, str]] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML: {e}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}: not UTF-8 text ({e.reason})") from None
            except RecursionError:
                raise ConfigError(f"{path}: nested too deeply to be a config") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of keys to values at the top level")
        _apply(data, cfg_fields, path, values, ignored, one_value)
    for text in overrides:
        key, value = parse_override(text)
        _apply({key: value}, cfg_fields, f"override '{text}'", values, ignored, one_value)
    # YAML reads `input: 123` or `output_prefix: null` as non-strings; say so rather than crash later.
    cfg = PreprocessConfig(**values)
    cfg.validate(path or "overrides")
    for key, (value, source) in one_value.items():
        wanted, handlers, what = ONE_VALUE_KEYS[key]
        if value != wanted and (handlers is None or cfg.handler_name in handlers):
            shown = str(wanted).lower() if isinstance(wanted, bool) else repr(wanted)
            raise ConfigError(f"{source}: {key}: {value!r} is not supported by mindrl ({what}); remove it or set it "
                              f"to {shown}")  # fmt: skip
        ignored.append(f"{key} ({source})")
    return cfg, ignored
