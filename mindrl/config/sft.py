"""The `mindrl-sft` config: MindSpeed-LLM's megatron training arguments under `megatron_training:` in a YAML
file, composed with hydra (+ `key=value` overrides) and validated once, with errors naming the key and where it
was set."""

from __future__ import annotations

import difflib
import os
import sys
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mindrl.data.preprocess_config import ConfigError

SECTION = "megatron_training"
# The repo's configs/ (next to the package), the default --config-path.
DEFAULT_CONFIG_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs"
)
# MindSpeed-LLM arguments that SFT scripts commonly pass but that mean nothing here (the data is already
# preprocessed and tokenised, the model is always megatron-core's): accepted, reported on stderr, not obeyed.
IGNORED_MINDSPEED_KEYS = frozenset(
    {
        "finetune",
        "is_instruction_dataset",
        "tokenizer_type",
        "tokenizer_not_use_fast",
        "prompt_type",
        "use_mcore_models",
        "no_load_optim",
        "no_load_rng",
        "no_save_optim",
        "no_save_rng",
        "no_shared_storage",
        "distributed_backend",
        "num_workers",
        "reset_position_ids",
        "initial_loss_scale",
        "use_fused_rmsnorm",
        "use_fused_swiglu",
        "use_fused_rotary_pos_emb",
        "use_flash_attn",
    }
)
SPLIT_HELP = 'weights "train,valid,test" over the documents, e.g. "95,5,0" (megatron\'s --split)'


@dataclass
class SFTTrainingConfig:
    """`megatron_training:` of an SFT config. Names and meanings follow megatron / MindSpeed-LLM arguments.

    Relative paths are relative to the current directory (the shipped configs assume the repo root)."""

    stage: str = "sft"
    """Training stage; only "sft" (supervised fine-tuning on instruction data)."""
    data_path: str = ""
    """Prefix written by mindrl-preprocess with handler_name=AlpacaStyleInstructionHandler (its output_prefix,
    or the `..._packed_input_ids_document` prefix): input_ids + labels with -100 over the prompt."""
    tokenizer_name_or_path: str = ""
    """Local HF tokenizer directory (the one the data was preprocessed with); gives the padding id and is
    copied into the saved checkpoint when the loaded one carries no tokenizer files."""
    load: str = ""
    """Megatron checkpoint to start from (mindrl-convert hf2mcore, or an earlier mindrl-sft/mindrl-train save)."""
    save: str = ""
    """Checkpoint directory to write (iter_XXXXXXX/ + tracker + hf_files/): what actor_config.load reads."""
    world_size: int = 1
    """Ranks (devices) of the job: TP x PP x DP."""
    tensor_model_parallel_size: int = 1
    """TP: the model's tensors are split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: the model's layers are split into this many stages."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (TP > 1 only)."""
    micro_batch_size: int = 1
    """Samples per forward/backward pass on one rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel ranks; a multiple of DP x micro_batch_size."""
    seq_length: int = 1024
    """Longest sample in tokens: longer samples are cut to this length (their tail then carries no loss)."""
    variable_seq_lengths: bool = True
    """Pad each step's batch to its longest sample (rounded up to `pad_to_multiple_of`) instead of seq_length."""
    pad_to_multiple_of: int = 8
    """With variable_seq_lengths: padded lengths are a multiple of this (fewer distinct shapes)."""
    train_iters: int = 100
    """Optimizer steps of the run."""
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: str = "cosine"
    """constant, linear, cosine, inverse-square-root or WSD."""
    lr_decay_iters: int | None = None
    """Steps over which lr decays to min_lr (default: train_iters)."""
    lr_warmup_iters: int = 0
    """Steps of linear warmup from 0 to lr (the first step runs at lr 0, as in megatron)."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay steps; exclusive with lr_warmup_iters."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks."""
    seed: int = 1234
    """Seeds the data order (a fresh permutation per epoch) and megatron's RNGs."""
    bf16: bool = False
    """Train in bfloat16 (fp32 main params in the optimizer)."""
    fp16: bool = False
    """Train in float16 with loss scaling."""
    split: str = "100,0,0"
    """Train / validation / test weights over the documents, in file order (megatron's --split): "95,5,0"."""
    eval_interval: int = 0
    """Validation loss every this many steps and at the end (0: never; needs a validation split)."""
    eval_iters: int = 1
    """Validation batches (of global_batch_size, cycling through the validation split) per evaluation."""
    save_interval: int = 0
    """A checkpoint every this many steps (0: only at the end; the last step is always saved)."""
    log_interval: int = 1
    """A console line every this many steps (metrics.jsonl and TensorBoard get every step)."""
    run_dir: str = ""
    """Where metrics.jsonl and tensorboard/ go (default: outputs/<config name>)."""
    use_tensorboard: bool = True
    """Also write TensorBoard events under run_dir/tensorboard."""

    @property
    def dp(self) -> int:
        """Data-parallel size: world_size / (TP x PP)."""
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"

    @property
    def warmup_iters(self) -> int:
        if self.lr_warmup_fraction is not None:
            return int(round(self.lr_warmup_fraction * (self.lr_decay_iters or self.train_iters)))
        return self.lr_warmup_iters


@dataclass
class SFTConfig:
    """A loaded SFT config: the validated `megatron_training` section and where it came from."""

    megatron_training: SFTTrainingConfig
    config_name: str = "sft"
    """The --config-name (names the default run dir)."""
    config_file: str = ""
    """The YAML file read (empty when built in code)."""
    ignored_keys: list[str] = field(default_factory=list)
    """MindSpeed-LLM keys accepted but ignored, with where they were set."""

    def to_dict(self) -> dict[str, Any]:
        return {SECTION: asdict(self.megatron_training)}


# --------------------------------------------------------------------------------------------------- loading
def _close(name: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _field_names() -> list[str]:
    return [f.name for f in fields(SFTTrainingConfig)]


def _dotted_names() -> list[str]:
    return [f"{SECTION}.{n}" for n in _field_names()]


def _override_keys(overrides: list[str]) -> list[tuple[str, str]]:
    """(dotted key, override text) of each hydra override, parsed with hydra's own grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = []
    for text in overrides:
        try:
            (parsed,) = parser.parse_overrides([text])
        except Exception as e:  # hydra's OverrideParseException, with the grammar's explanation
            raise ConfigError(f"override '{text}' is not key=value: {e}") from None
        out.append((parsed.key_or_group, text))
    return out


def resolve_config_file(config_name: str, config_path: str | None = None) -> tuple[str, str]:
    """(config dir, YAML file) of --config-name in --config-path (default: the repo's configs/)."""
    config_dir = os.path.abspath(config_path or DEFAULT_CONFIG_DIR)
    name = config_name[:-5] if config_name.endswith(".yaml") else config_name
    path = os.path.join(config_dir, name + ".yaml")
    if not os.path.isfile(path):
        known = (
            sorted(f[:-5] for f in os.listdir(config_dir) if f.endswith(".yaml")) if os.path.isdir(config_dir) else []
        )
        raise ConfigError(
            f"config '{name}' not found: no file {path}{_close(name, known)}"
            + (f"; configs there: {', '.join(known)}" if known else "")
        )
    return config_dir, path


def load_sft_config(
    config_name: str,
    config_path: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    check_paths: bool = True,
) -> SFTConfig:
    """Compose <config_path>/<config_name>.yaml with hydra, apply `megatron_training.key=value` overrides
    (hydra's override grammar), validate.

    check_paths=False skips the checks that read the data, checkpoint and tokenizer (for syntax-only checks)."""
    config_dir, path = resolve_config_file(config_name, config_path)
    origin: dict[str, str] = {}
    hydra_overrides = []
    for key, text in _override_keys(list(overrides)):
        bare = key.lstrip("+~")
        if bare not in _dotted_names():
            hint = f" (did you mean '{SECTION}.{bare}'?)" if bare in _field_names() else _close(bare, _dotted_names())
            raise ConfigError(f"override '{text}': unknown key '{bare}'{hint}; keys are {SECTION}.<name>")
        if key.startswith("~"):
            raise ConfigError(f"override '{text}': deleting keys is not supported; set the value instead")
        origin[bare.split(".", 1)[1]] = f"override '{text}'"
        # '++': set the key whether or not the YAML has it (every known key may be overridden).
        hydra_overrides.append("++" + text.lstrip("+"))
    name = os.path.basename(path)[:-5]
    # The file alone first: its unknown keys are reported against the file, not against an override.
    data = _compose(config_dir, name, [], path)
    _check_top_level(data, path)
    ignored = []
    for key in data[SECTION]:
        if key in IGNORED_MINDSPEED_KEYS:
            ignored.append(f"{SECTION}.{key} ({path})")
        elif key not in _field_names():
            raise ConfigError(f"{path}: unknown key '{SECTION}.{key}'{_close(key, _field_names())}")
    if hydra_overrides:
        data = _compose(config_dir, name, hydra_overrides, path)
    section = {k: v for k, v in data[SECTION].items() if k not in IGNORED_MINDSPEED_KEYS}
    values = {k: _coerce(k, v, origin.get(k, path)) for k, v in section.items()}
    cfg = SFTConfig(SFTTrainingConfig(**values), config_name=name, config_file=path, ignored_keys=ignored)
    if ignored:
        print(f"[mindrl-sft] ignored MindSpeed-LLM keys (no effect here): {', '.join(ignored)}", file=sys.stderr)
    validate(cfg, lambda key: origin.get(key, path), check_paths=check_paths)
    return cfg


def _compose(config_dir: str, name: str, overrides: list[str], path: str) -> Any:
    """The composed config as plain containers, interpolations resolved."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            composed = compose(config_name=name, overrides=overrides)
        return OmegaConf.to_container(composed, resolve=True) or {}
    except Exception as e:  # YAML syntax, a bad defaults list, an override value hydra's grammar rejects
        what = f"overrides {' '.join(o[2:] for o in overrides)}" if overrides else path
        raise ConfigError(f"{what}: {type(e).__name__}: {e}") from None


def _check_top_level(data: Any, path: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with a '{SECTION}:' section at the top level")
    for key in data:
        if key != SECTION:
            raise ConfigError(
                f"{path}: unknown top-level key '{key}'{_close(str(key), [SECTION])}; an SFT config has only "
                f"'{SECTION}:'"
            )
    if not isinstance(data.get(SECTION), dict):
        raise ConfigError(f"{path}: '{SECTION}:' must be a mapping of megatron arguments")


def _coerce(key: str, value: Any, where: str) -> Any:
    """The value as its field's type; YAML-typed wrongly (a string for a number, ...) is an error naming the key."""
    hint = typing.get_type_hints(SFTTrainingConfig)[key]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if t is float and isinstance(value, str):
            try:  # PyYAML (YAML 1.1) reads 1e-5 as a string
                return float(value)
            except ValueError:
                pass
        if t is str and isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    want = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{where}: {SECTION}.{key} must be {want}, got {value!r}")


# --------------------------------------------------------------------------------------------------- checks
def validate(cfg: SFTConfig, where: typing.Callable[[str], str] | None = None, check_paths: bool = True) -> None:
    """Every check that can fail before a rank starts; `where(key)` names the file or override that set `key`."""
    mt = cfg.megatron_training
    where = where or (lambda key: cfg.config_file or "config")

    def fail(key: str, msg: str) -> typing.NoReturn:
        raise ConfigError(f"{where(key)}: {SECTION}.{key} {msg}")

    if mt.stage != "sft":
        fail("stage", f"must be 'sft' (mindrl-sft trains supervised fine-tuning only), got {mt.stage!r}")
    for key in ("data_path", "tokenizer_name_or_path", "load", "save"):
        if not getattr(mt, key):
            fail(key, "is required (a path)")
    positive = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size")
    for key in (*positive, "global_batch_size", "seq_length", "train_iters", "log_interval", "pad_to_multiple_of"):
        if getattr(mt, key) < 1:
            fail(key, f"must be >= 1, got {getattr(mt, key)}")
    for key in ("eval_interval", "eval_iters", "save_interval", "lr_warmup_iters"):
        if getattr(mt, key) < 0:
            fail(key, f"must be >= 0, got {getattr(mt, key)}")
    tp, pp = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size
    if mt.world_size % (tp * pp):
        fail("world_size", f"= {mt.world_size} is not divisible by TP x PP = {tp} x {pp}")
    if mt.global_batch_size % (mt.dp * mt.micro_batch_size):
        fail(
            "global_batch_size",
            f"= {mt.global_batch_size} is not divisible by DP x micro_batch_size = {mt.dp} x {mt.micro_batch_size} "
            f"(DP = world_size / (TP x PP) = {mt.world_size} / ({tp} x {pp}))",
        )
    if mt.sequence_parallel and tp == 1:
        fail("sequence_parallel", "needs tensor_model_parallel_size > 1")
    if mt.bf16 and mt.fp16:
        fail("bf16", "and fp16 are both true; pick one")
    if not 0 <= mt.min_lr <= mt.lr:
        fail("min_lr", f"must be within [0, lr = {mt.lr}], got {mt.min_lr}")
    from mindrl.workers.train_setup import LR_DECAY_STYLES

    if mt.lr_decay_style not in LR_DECAY_STYLES:
        fail("lr_decay_style", f"{mt.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
    if mt.lr_warmup_fraction is not None:
        if mt.lr_warmup_iters:
            fail("lr_warmup_fraction", "and lr_warmup_iters are both set; give one")
        if not 0 <= mt.lr_warmup_fraction <= 1:
            fail("lr_warmup_fraction", f"must be within [0, 1], got {mt.lr_warmup_fraction}")
    try:
        weights = split_weights(mt.split)
    except ValueError:
        fail("split", f"must be {SPLIT_HELP}, got {mt.split!r}")
    if min(weights) < 0 or weights[0] <= 0:
        fail("split", f"must be {SPLIT_HELP} with a positive train weight, got {mt.split!r}")
    if mt.eval_interval and weights[1] == 0:
        fail("eval_interval", f"= {mt.eval_interval} needs a validation split, but split is {mt.split!r}")
    if mt.eval_interval and mt.eval_iters < 1:
        fail("eval_iters", f"must be >= 1 when eval_interval is set, got {mt.eval_iters}")
    if check_paths:
        _check_paths(mt, fail)


def _check_paths(mt: SFTTrainingConfig, fail: typing.Callable[[str, str], typing.NoReturn]) -> None:
    from mindrl.checkpoint.hf_io import CheckpointError
    from mindrl.checkpoint.mcore_ckpt import read_model_meta
    from mindrl.models.hf_config import ModelConfigError

    try:
        spec, meta = read_model_meta(mt.load)
    except CheckpointError as e:
        fail("load", f"= {mt.load!r}: {e} (make one with mindrl-convert hf2mcore)")
    if meta["role"] != "actor":
        fail("load", f"= {mt.load!r} holds a {meta['role']} (value-head) model; SFT trains a causal LM")
    try:
        spec.validate_layout(mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size)
    except ModelConfigError as e:
        key = (
            "pipeline_model_parallel_size" if "PP=" in str(e) and "TP=" not in str(e) else "tensor_model_parallel_size"
        )
        fail(key, f"does not fit the model in {mt.load!r}: {e}")
    if not os.path.isdir(mt.tokenizer_name_or_path):
        fail("tokenizer_name_or_path", f"= {mt.tokenizer_name_or_path!r}: directory not found")
    counts = sft_data_counts(mt.data_path, mt.split, fail)
    if counts[0] < mt.global_batch_size:
        fail(
            "global_batch_size",
            f"= {mt.global_batch_size} is larger than the training split ({counts[0]} samples of {mt.data_path!r} "
            f"with split {mt.split!r})",
        )
    if mt.eval_interval and counts[1] == 0:
        fail("split", f"= {mt.split!r} leaves no validation sample of the {sum(counts)} in {mt.data_path!r}")


def sft_data_counts(
    data_path: str, split: str, fail: typing.Callable[[str, str], typing.NoReturn] | None = None
) -> tuple[int, int, int]:
    """(train, valid, test) document counts of the SFT data at `data_path`, read from the .idx files only.

    The data must hold input_ids and labels of equal lengths per document (AlpacaStyleInstructionHandler)."""
    from mindrl.data.preprocess import dataset_prefix

    def _fail(key: str, msg: str) -> typing.NoReturn:
        if fail is not None:
            fail(key, msg)
        raise ConfigError(f"{SECTION}.{key} {msg}")

    prefix = strip_data_suffix(data_path)
    for key in ("input_ids", "labels"):
        p = dataset_prefix(prefix, key)
        if not (os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx")):
            _fail("data_path", f"= {data_path!r}: {p}.{{bin,idx}} not found (run mindrl-preprocess with "
                  "handler_name=AlpacaStyleInstructionHandler)")  # fmt: skip
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ids = IndexedDataset(dataset_prefix(prefix, "input_ids"))
    labels = IndexedDataset(dataset_prefix(prefix, "labels"))
    if len(ids) != len(labels) or (ids.sequence_lengths != labels.sequence_lengths).any():
        _fail(
            "data_path",
            f"= {data_path!r}: labels are not per-token targets of input_ids (lengths differ); SFT data comes from "
            "mindrl-preprocess handler_name=AlpacaStyleInstructionHandler (prompt labels -100, then the response)",
        )
    return split_counts(len(ids), split)


def strip_data_suffix(data_path: str) -> str:
    """data_path as the preprocess output_prefix (the `_packed_input_ids_document` prefix is accepted too)."""
    suffix = "_packed_input_ids_document"
    return data_path[: -len(suffix)] if data_path.endswith(suffix) else data_path


def split_weights(split: str) -> list[float]:
    """The three weights of a megatron split string ("95,5,0" or "95/5/0"; missing ones are 0, as megatron pads)."""
    weights = [float(w) for w in str(split).replace("/", ",").split(",")]
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"split {split!r}: expected 1 to 3 weights")
    return weights + [0.0] * (3 - len(weights))


def split_counts(n: int, split: str) -> tuple[int, int, int]:
    """Megatron's document split (get_train_valid_test_split_): contiguous ranges [0, a), [a, b), [b, n)
    sized by the normalised weights, the rounding corrected on the upper boundaries."""
    weights = split_weights(split)
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * n)))
    diff = bounds[-1] - n
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return bounds[1] - bounds[0], bounds[2] - bounds[1], bounds[3] - bounds[2]
