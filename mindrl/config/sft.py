"""The `mindrl-sft` config: MindSpeed-LLM's megatron training arguments under `megatron_training:`, composed with hydra
(+ `key=value` overrides) and validated once, every problem named with its key and where it came from."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mindrl.config.errors import Collector, ConfigError, Issue, collecting, did_you_mean
from mindrl.config.section import Section
from mindrl.config.settings import LR_DECAY_STYLES, LoRASettings, OptimSettings, RecomputeSettings

SECTION = "megatron_training"
_DATA = "the data is already tokenised and templated by mindrl-preprocess"
_KERNEL = "a kernel fusion / performance switch; mindrl chooses kernels per platform"


@dataclass
class SFTTrainingConfig(Section, OptimSettings, RecomputeSettings, LoRASettings):
    """`megatron_training:` of an SFT config. Names and meanings follow megatron / MindSpeed-LLM arguments; the
    optimizer and LR keys are `OptimSettings`', the activation recomputation keys `RecomputeSettings`', the LoRA keys
    `LoRASettings`' (MindSpeed-RL's; mindrl-sft only: the backbone frozen, only the adapters train).

    Relative paths are relative to the current directory (the shipped configs assume the repo root)."""

    SECTION: ClassVar[str] = SECTION
    STAGE: ClassVar[str] = "sft"
    TRAINS: ClassVar[str] = "mindrl-sft trains supervised fine-tuning only"
    READS_MODEL: ClassVar[bool] = False
    """Whether the config also reads the architecture megatron_training.model names (a `model:` section from the
    defaults list, architecture keys in megatron_training), for mindrl-plan."""
    # MindSpeed-LLM arguments that SFT launch scripts pass but that mean nothing here: accepted and listed.
    IGNORED: ClassVar[Mapping[str, str]] = {
        **dict.fromkeys(["is_instruction_dataset", "prompt_type", "tokenizer_type", "tokenizer_not_use_fast"], _DATA),
        **dict.fromkeys(["no_shared_storage", "num_workers", "reset_position_ids"], _DATA),  # fmt: skip
        **dict.fromkeys(
            ["use_flash_attn", "use_fused_rmsnorm", "use_fused_swiglu", "use_fused_rotary_pos_emb"], _KERNEL
        ),  # fmt: skip
        **dict.fromkeys(
            ["no_save_optim", "no_save_rng"],
            "mindrl-sft saves the model only (a run starts from weights alone: finetune)",
        ),
        "distributed_backend": "the platform picks the torch.distributed backend (hccl / nccl / gloo)",
    }
    # Accepted only with the value that says what mindrl-sft does: it loads the weights alone and starts at step 0.
    UNSUPPORTED: ClassVar[Mapping[str, tuple[tuple[Any, ...], str]]] = {
        "finetune": (
            (True,),
            "resuming a run's step, optimizer and RNG from load (mindrl-sft starts from the weights)",
        ),
        "no_load_optim": ((True,), "loading the optimizer state from load (mindrl-sft starts a fresh optimizer)"),
        "no_load_rng": ((True,), "loading the RNG state from load (mindrl-sft seeds from seed)"),
        "use_mcore_models": ((True,), "megatron's legacy (non-core) models"),
        "full_shuffle_instruction_dataset": (
            (False,),
            "a shuffle of the whole dataset across epochs (mindrl-sft shuffles each epoch by the seed)",
        ),
    }

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
    world_size: int | None = None
    """Ranks (devices) of the job: TP x PP x DP. Unset: TP x PP, the fewest the layout runs on (DP 1; MindSpeed-LLM's
    YAML has no device count, its launcher gives one)."""
    tensor_model_parallel_size: int = 1
    """TP: the model's tensors are split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: the model's layers are split into this many stages."""
    num_layer_list: str | list[int] | None = None
    """MindSpeed's layers per pipeline stage ("1,2"): PP entries >= 1 summing to the model's num_layers, each stage
    building and training that many (megatron's pipeline layout); needed where PP does not divide the layers. None:
    num_layers / PP each."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (TP > 1 only)."""
    micro_batch_size: int = 1
    """Samples per forward/backward pass on one rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel ranks; a multiple of DP x micro_batch_size."""
    seq_length: int = 1024
    """Longest sample in tokens: longer samples are cut to this length (their tail then carries no loss)."""
    variable_seq_lengths: bool = True
    """Pad each step's batch to its longest sample (rounded up to pad_to_multiple_of) instead of seq_length."""
    pad_to_multiple_of: int = 8
    """With variable_seq_lengths: padded lengths are a multiple of this (fewer distinct shapes)."""
    train_iters: int = 100
    """Optimizer steps of the run."""
    lr: float = 1e-5
    """Peak learning rate."""
    lr_decay_style: str = "cosine"
    """constant, linear, cosine, inverse-square-root or WSD."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay steps; exclusive with lr_warmup_iters."""
    seed: int = 1234
    """Seeds the data order (a fresh permutation per epoch) and megatron's RNGs."""
    no_shuffle: bool = False
    """Draw the training samples in file order, epoch after epoch, instead of a seeded permutation per epoch."""
    bf16: bool = False
    """Train in bfloat16 (fp32 main params in the optimizer)."""
    fp16: bool = False
    """Train in float16 with loss scaling."""
    split: str = "100,0,0"
    """Train / validation / test weights over the documents, in file order (megatron's --split): "95,5,0"."""
    eval_interval: int = 0
    """Validation loss every this many steps and at the end (0: never; needs a validation split)."""
    eval_iters: int = 1
    """Validation batches (of global_batch_size, cycling through the validation split) per evaluation; 0: no
    evaluation, whatever eval_interval says (megatron's meaning)."""
    save_interval: int = 0
    """A checkpoint every this many steps (0: only at the end; the last step is always saved)."""
    log_interval: int = 1
    """A console line every this many steps (metrics.jsonl and TensorBoard get every step)."""
    run_dir: str = ""
    """Where metrics.jsonl, tensorboard/ and sft_config.json go (default: outputs/<config name>)."""
    use_tensorboard: bool = True
    """Also write TensorBoard events under run_dir/tensorboard."""

    @classmethod
    def normalize(cls, key: str, value: Any) -> Any:
        # megatron's --split 100 (one weight) reads as a number in YAML
        if key == "split" and isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        return value

    def __post_init__(self) -> None:
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        # not a field (the config's dict round-trips through the ranks): whether world_size came from the layout
        self.world_size_from_layout = self.world_size is None
        if self.world_size is None:
            ok = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (tp, pp))
            self.world_size = tp * pp if ok else 1
        super().__post_init__()

    def layer_list(self) -> list[int] | None:
        """num_layer_list as integers (None: unset); raises ValueError on a malformed one."""
        given = self.num_layer_list
        if given is None:
            return None
        return [int(x) for x in given.split(",")] if isinstance(given, str) else [int(x) for x in given]

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

    def validate(self, col: Collector) -> None:
        if self.stage != self.STAGE:
            col.add("stage", f"must be {self.STAGE!r} ({self.TRAINS}), got {self.stage!r}")
        for key in ("data_path", "tokenizer_name_or_path", "load", "save"):
            if not getattr(self, key) and not col.is_bad(key):
                col.add(key, "is required (a path)")
        for key in ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                    "global_batch_size", "seq_length", "train_iters", "log_interval", "pad_to_multiple_of"):  # fmt: skip
            if getattr(self, key) < 1:
                col.add(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("eval_interval", "eval_iters", "save_interval", "lr_warmup_iters"):
            if getattr(self, key) < 0:
                col.add(key, f"must be >= 0, got {getattr(self, key)}")
        tp, pp, mbs = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.micro_batch_size
        if min(tp, pp, mbs, self.world_size) >= 1:
            if self.world_size % (tp * pp):
                col.add("world_size", f"{self.world_size} is not divisible by TP x PP = {tp} x {pp}")
            elif self.global_batch_size % (self.dp * mbs):
                col.add("global_batch_size", f"{self.global_batch_size} is not divisible by DP x micro_batch_size "
                        f"= {self.dp} x {mbs} (DP = world_size / (TP x PP) = {self.world_size} / ({tp} x {pp}))")  # fmt: skip
        if self.sequence_parallel and tp == 1:
            col.add("sequence_parallel", "needs tensor_model_parallel_size > 1")
        try:
            counts = self.layer_list()
        except (TypeError, ValueError):
            col.add("num_layer_list", f"{self.num_layer_list!r} is not a comma-separated list of layer counts like "
                    "'16,16,16,16'")  # fmt: skip
        else:
            if counts is not None and pp >= 1 and (len(counts) != pp or min(counts) < 1):
                col.add("num_layer_list", f"{self.num_layer_list!r} must give each of the PP={pp} stages >= 1 layer")
        # the rules on layers per stage need the model: the checkpoint check (mindrl.preflight) and the builder
        for key, message in self.recompute_problems():
            col.add(key, message)
        if self.recompute_granularity is None:
            for key in ("recompute_method", "recompute_num_layers"):
                if getattr(self, key) is not None:
                    col.ignore(key, "has no effect without recompute_granularity")
        self._check_lora(col)
        if self.bf16 and self.fp16:
            col.add("bf16", "and fp16 are both true; pick one")
        if not 0 <= self.min_lr <= self.lr:
            col.add("min_lr", f"must be within [0, lr = {self.lr}], got {self.min_lr}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            col.add("lr_decay_style", f"{self.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters:
                col.add("lr_warmup_fraction", "and lr_warmup_iters are both set; give one")
            elif not 0 <= self.lr_warmup_fraction <= 1:
                col.add("lr_warmup_fraction", f"must be within [0, 1], got {self.lr_warmup_fraction}")
        try:
            weights = split_weights(self.split)
        except ValueError:
            col.add("split", f'must be weights "train,valid,test" such as "95,5,0", got {self.split!r}')
            return
        if self.eval_interval and self.eval_iters == 0:  # megatron: eval_iters 0 turns evaluation off
            col.ignore("eval_interval", "eval_iters is 0: no evaluation runs (megatron's meaning)")
            self.eval_interval = 0
        if min(weights) < 0 or weights[0] <= 0:
            col.add("split", f"needs a positive train weight and no negative one, got {self.split!r}")
        elif self.eval_interval and weights[1] == 0:
            col.add("eval_interval", f"{self.eval_interval} needs a validation split, but split is {self.split!r}")
        if self.eval_interval and self.eval_iters < 1:
            col.add("eval_iters", f"must be >= 1 when eval_interval is set, got {self.eval_iters}")

    def _check_lora(self, col: Collector) -> None:
        for key, message in self.lora_problems():
            col.add(key, message)
        if self.lora and self.STAGE != "sft":
            col.add("lora_target_modules", f"LoRA is implemented for mindrl-sft only, not for stage {self.STAGE!r} "
                    "(docs/lora.md); remove the lora_* keys")  # fmt: skip
        if self.lora_fusion:
            col.ignore("lora_fusion", "MindSpeed's CCLoRA overlap; the math is the same and mindrl runs it unfused")
        if self.lora and self.lora_ckpt_filter:
            col.ignore("lora_ckpt_filter", "mindrl-sft saves the whole model (backbone and adapters), which "
                       "mindrl-train and mindrl-convert load")  # fmt: skip
        if not self.lora:
            for key, default in (("lora_r", 8), ("lora_alpha", 16.0), ("lora_ckpt_filter", False)):
                if getattr(self, key) != default:
                    col.ignore(key, "has no effect without lora_target_modules")


@dataclass
class SFTConfig:
    """A loaded SFT config: the validated `megatron_training` section and where it came from."""

    megatron_training: SFTTrainingConfig
    config_name: str = "sft"
    """The --config-name (names the default run dir)."""
    source: str = ""
    """The YAML file read (empty when built in code)."""
    ignored_keys: list[str] = field(default_factory=list)
    """MindSpeed-LLM keys accepted but ignored."""
    model: Any = None
    """The architecture `megatron_training.model` names (a `mindrl.config.model.ModelArchConfig`, for a schema that
    reads one: DPO), which mindrl-plan sizes; None otherwise."""

    def to_dict(self) -> dict[str, Any]:
        return {SECTION: self.megatron_training.to_dict()}


# --------------------------------------------------------------------------------------------------- loading
def load_sft_config(
    config_name: str,
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    checks: Sequence[Callable[[SFTTrainingConfig, Collector], None]] = (),
    schema: type[SFTTrainingConfig] = SFTTrainingConfig,
) -> SFTConfig:
    """Compose <config_path>/<config_name>.yaml with hydra (config_path None: the repo's configs/; config_name
    may also be a path to a YAML file), apply hydra-style `megatron_training.key=value` overrides, validate.
    Raises one ConfigError listing every problem.

    checks: further checks of the valid section, reporting to the same collector (mindrl.preflight's checks of
    the data, checkpoint and tokenizer); they run only when the config itself has no problem. schema: the section's
    class (a subclass for another stage: `mindrl.config.reward_model.RMTrainingConfig`)."""
    from mindrl.config.loader import _locate  # the same resolution (and messages) as mindrl-train's

    config_dir, name = _locate(config_name, config_path)
    source = os.path.join(config_dir, name + ".yaml")
    raw, provenance, issues = _compose(config_dir, name, list(overrides), source, schema)
    col = Collector(default_source=source, provenance=provenance, issues=issues)
    arch = None
    with collecting(col):
        tops = [SECTION, "model"] if schema.READS_MODEL else [SECTION]
        for key in raw:
            if key not in tops:
                only = " and ".join(f"'{t}:'" for t in tops)
                col.add(str(key), f"unknown section; a {schema.STAGE} config has only {only}" + did_you_mean(key, tops))
        section = raw.get(SECTION)
        if not isinstance(section, Mapping):
            col.add(SECTION, "is required: a mapping of megatron training arguments")
            col.raise_if_any(name)  # nothing else is worth checking
        arch_keys: dict[str, Any] = {}
        if schema.READS_MODEL:
            from mindrl.config.arch_section import split_arch_keys

            section, arch_keys = split_arch_keys(section, schema)
        noop = {}
        if schema.READS_MODEL and arch_keys.get("noop_layers") is not None:
            noop = {f"{SECTION}.noop_layers": arch_keys.pop("noop_layers")}
        mt = schema.from_dict(section, SECTION, col)
        if schema.READS_MODEL:
            from mindrl.config.arch_section import read_arch

            arch = read_arch(mt.model, raw.get("model"), arch_keys, config_dir, col, source)
            if arch is not None and arch.noop_layers is not None:
                noop = noop or {f"model.{arch.name}.noop_layers": arch.noop_layers}
        for key, value in noop.items():  # MindSpeed's identity layers pad a model's layers to a multiple of PP
            col.add(key, f"{value!r}: mindrl-train-{schema.STAGE} builds no identity layers, it trains the "
                    f"checkpoint's own (megatron_training.num_layer_list splits them unevenly over the pipeline "
                    f"stages); remove it")  # fmt: skip
        for check in checks if not col.issues else ():
            check(mt, col)
    col.raise_if_any(name)
    return SFTConfig(mt, config_name=name, source=source, ignored_keys=list(col.ignored), model=arch)


def _compose(
    config_dir: str, name: str, overrides: list[str], source: str, schema: type[SFTTrainingConfig]
) -> tuple[dict, dict, list[Issue]]:
    """(the composed config, provenance of overridden keys, issues of unknown override keys)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    known = set(schema.known_keys())
    provenance: dict[str, tuple[str, str]] = {}
    issues: list[Issue] = []
    fixed: list[str] = []
    parser = OverridesParser.create()
    for text in overrides:
        where = f"override {text!r}"
        try:
            (ov,) = parser.parse_overrides([text])
        except HydraException as e:
            issues.append(Issue(text.split("=", 1)[0].lstrip("+~"), f"bad override: {e}".strip(), where))
            continue
        key = ov.key_or_group
        section, _, leaf = key.partition(".")
        if section != SECTION or leaf.replace("-", "_") not in known:
            hint = f"; did you mean '{SECTION}.{key}'?" if key in known else did_you_mean(key, [f"{SECTION}.{k}" for k in known])  # fmt: skip
            issues.append(Issue(key, "unknown key" + hint, where))
            continue
        if ov.is_sweep_override():  # hydra reads a,b,c as a sweep over three values
            issues.append(Issue(key, f"a comma-separated value needs quotes: {key}='\"{ov.input_line.split('=', 1)[1]}\"'", where))  # fmt: skip
            continue
        provenance[key] = (key, where)
        # '++' sets a key whether or not the YAML has it: every schema key may be overridden.
        fixed.append(text if text.startswith("~") else "++" + text.lstrip("+"))
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*_self_.*")
            with initialize_config_dir(config_dir=config_dir, version_base=None):
                cfg = compose(config_name=name, overrides=fixed)
    except HydraException as e:
        raise ConfigError([Issue("overrides" if fixed else "config", f"{e}".strip(), source)], name) from None
    raw = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(raw, dict):
        raise ConfigError([Issue("config", f"expected a mapping with '{SECTION}:' at the top level", source)], name)
    return raw, provenance, issues


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
