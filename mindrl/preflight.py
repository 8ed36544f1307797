"""Preflight: the checks of a loaded config that read the disk (checkpoints and their model, packed datasets,
tokenizers, Ray's runtime env file), reported to the loader's collector so one ConfigError lists every problem."""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Sequence

from mindrl.agent.tools import ToolConfigError, build_tools
from mindrl.checkpoint import legacy
from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.checkpoint.iterations import saved_iterations
from mindrl.checkpoint.mcore_ckpt import MODEL_META, TRACKER, iteration_dir, read_model_meta, read_tracker
from mindrl.config import loader
from mindrl.config import sft as sft_config
from mindrl.config.cli import check_override_syntax
from mindrl.config.errors import Collector, ConfigError, Issue
from mindrl.config.megatron import dataset_output_prefix
from mindrl.config.model import ModelArchConfig
from mindrl.config.root import RLConfig
from mindrl.config.settings import LoRASettings
from mindrl.config.sft import SECTION as SFT_SECTION
from mindrl.config.sft import SFTConfig, SFTTrainingConfig, split_counts
from mindrl.data.indexed import IndexedDataset
from mindrl.data.preprocess import dataset_prefix
from mindrl.data.tokenizer import load_tokenizer
from mindrl.models.hf_config import ModelConfigError, ModelSpec
from mindrl.platform import current_platform
from mindrl.rollout.base import TOKENIZER_FILES, has_tokenizer
from mindrl.workers.runtime_env import RuntimeEnvError, read_env_file


def load_config(
    config_name: str, config_path: str | None = None, overrides: Sequence[str] = (), check_paths: bool = True
) -> RLConfig:
    """`mindrl.config.load_config`, plus (unless check_paths is False) the path checks of `check_paths`; one
    ConfigError lists every problem."""
    checks = (check_trackers, check_rl_paths) if check_paths else (check_trackers,)
    return loader.load_config(config_name, config_path, overrides, checks=checks)


def load_sft_config(
    config_name: str, config_path: str | None = None, overrides: Sequence[str] = (), check_paths: bool = True
) -> SFTConfig:
    """`mindrl.config.sft.load_sft_config`, plus (unless check_paths is False) the checkpoint, tokenizer and data
    checks of `check_sft_paths`."""
    checks = (check_sft_paths,) if check_paths else ()
    return sft_config.load_sft_config(config_name, config_path, overrides, checks=checks)


def load_rm_config(
    config_name: str, config_path: str | None = None, overrides: Sequence[str] = (), check_paths: bool = True
) -> SFTConfig:
    """The `stage: orm` config of mindrl-train-rm (`RMTrainingConfig`), plus (unless check_paths is False) the
    checkpoint, tokenizer and preference-data checks of `check_rm_paths`."""
    from mindrl.config.reward_model import RMTrainingConfig

    checks = (check_rm_paths,) if check_paths else ()
    return sft_config.load_sft_config(config_name, config_path, overrides, checks=checks, schema=RMTrainingConfig)


def load_dpo_config(
    config_name: str, config_path: str | None = None, overrides: Sequence[str] = (), check_paths: bool = True
) -> SFTConfig:
    """The `stage: dpo` config of mindrl-train-dpo (`DPOTrainingConfig`), plus (unless check_paths is False) the
    causal-LM checkpoint, tokenizer and preference-data checks of `check_dpo_paths`."""
    from mindrl.config.dpo import DPOTrainingConfig

    checks = (check_dpo_paths,) if check_paths else ()
    return sft_config.load_sft_config(config_name, config_path, overrides, checks=checks, schema=DPOTrainingConfig)


def config_from_args(args: argparse.Namespace) -> RLConfig:
    """Load and validate the config the parsed arguments (`mindrl.config.cli.add_config_args`) name, with the path
    checks unless --no-check-paths; raises ConfigError."""
    check_override_syntax(args.overrides)
    if loader.config_stage(args.config_name, args.config_path, args.overrides) == "dpo":
        why = f"'dpo' is offline DPO, no rollout: mindrl-train-dpo --config-name {args.config_name} trains it"
        raise ConfigError([Issue("megatron_training.stage", why + " (mindrl-plan plans it)", args.config_name)])
    return load_config(
        args.config_name,
        config_path=args.config_path,
        overrides=list(args.overrides),
        check_paths=not getattr(args, "no_check_paths", False),
    )


# ---------------------------------------------------------------------------------------------- RL configs
def _p(path: str) -> str:
    """A path for messages: as written, plus where it resolves when it is relative."""
    return repr(path) if os.path.isabs(path) else f"{path!r} (= {os.path.abspath(path)})"


def check_rl_paths(cfg: RLConfig, col: Collector) -> None:
    """Report every missing or wrong path of `cfg` to `col`: checkpoints (and that they hold the model the config
    describes), the packed prompt dataset, the tokenizers and the runtime env file; and the keys mindrl-plan sizes
    but a run does not build (`check_runnable`)."""
    check_runnable(cfg, col)
    mt, rl = cfg.megatron_training, cfg.rl_config
    tokenizer = _TokenizerSize(mt.tokenizer_name_or_path)
    checkpoints = [("actor_config", "actor_config.load", cfg.actor_config.load, cfg.model, False)]
    ref = rl.integrated_mode_config.ref_model_load_path
    if ref:  # at the actor's layout
        checkpoints.append(("actor_config", "rl_config.integrated_mode_config.ref_model_load_path", ref, cfg.model,
                            False))  # fmt: skip
    if cfg.critic_config is not None and cfg.critic_model is not None:
        checkpoints.append(("critic_config", "critic_config.load", cfg.critic_config.load, cfg.critic_model, True))
    if cfg.reward_config is not None and cfg.reward_model is not None and cfg.reward_config.load:
        checkpoints.append(("reward_config", "reward_config.load", cfg.reward_config.load, cfg.reward_model, True))
    for role, key, path, arch, value_model in checkpoints:
        spec = _check_checkpoint(col, key, path, arch, value_model)
        if spec is not None:
            _check_vocab_rows(col, key, path, spec.vocab_size, arch, role, getattr(cfg, role).tp, tokenizer)
    if not col.is_bad("actor_config.load"):
        _check_adapters(col, cfg.actor_config.load, cfg.actor_config)
    if mt.data_path and not col.is_bad("megatron_training.data_path"):
        _check_dataset(col, "megatron_training.data_path", mt.data_path, mt.dataset_additional_keys)
    if rl.val_data_path and not col.is_bad("rl_config.val_data_path"):
        _check_dataset(col, "rl_config.val_data_path", rl.val_data_path, mt.dataset_additional_keys)
    if rl.runtime_env_path:
        _check_runtime_env(col, rl.runtime_env_path)
    if rl.tool_config_path and not col.is_bad("rl_config.tool_config_path"):
        check_tool_config(col, rl.tool_config_path)
    if "bfloat16" in (mt.dtype, cfg.generate_config.dtype) and (why := current_platform().bf16_in_software()):
        col.note(f"megatron_training.bf16 / generate_config.dtype bfloat16: {why}; bf16 runs in software here, many "
                 "times slower than float32 (docs/precision.md): set bf16: false and dtype: float32 on this host")  # fmt: skip
    for key, path in (
        ("megatron_training.tokenizer_name_or_path", mt.tokenizer_name_or_path),
        ("generate_config.tokenizer_name_or_path", cfg.generate_config.tokenizer_name_or_path),
    ):
        if path and not (key.startswith("generate") and path == mt.tokenizer_name_or_path):
            _check_tokenizer(col, key, path)


def check_runnable(cfg: RLConfig, col: Collector) -> None:
    """The keys of MindSpeed-RL's large MoE recipes that mindrl-plan sizes but mindrl-train does not run."""
    gen = cfg.generate_config
    if gen.infer_expert_parallel_size > 1:
        col.add("generate_config.infer_expert_parallel_size", f"{gen.infer_expert_parallel_size}: vLLM's expert "
                "parallelism across engines (its data-parallel groups) is not built by mindrl's rollout; mindrl-plan "
                "sizes it, and a run needs 1 (each engine holds all its experts)")  # fmt: skip
    roles = [("actor_config", cfg.actor_config, cfg.model), ("critic_config", cfg.critic_config, cfg.critic_model)]
    for role, rc, arch in roles:
        if rc is None or arch is None or not arch.noop_layer_indices:
            continue
        noop, layers = arch.noop_layer_indices, int(arch.num_layers)
        why = (f"{arch.noop_layers!r}: MindSpeed's identity layers hold no weights, they pad num_layers to a multiple "
               f"of PP so that the stages split evenly; mindrl builds none, it trains the checkpoint's own layers and "
               f"{role}.num_layer_list splits them unevenly instead (mindrl-plan sizes the recipe as written). For a "
               f"run remove noop_layers and set num_layers to the checkpoint's")  # fmt: skip
        split = _real_layer_split(layers, rc.pp, noop, rc.num_layer_list)
        if split is not None:
            why += f": here num_layers {layers - len(set(noop))} and {role}.num_layer_list '{split}' (the same stages)"
        col.add(f"model.{arch.name}.noop_layers", why)


def _real_layer_split(num_layers: int, pp: int, noop: list[int], num_layer_list) -> str | None:
    """The real layers per pipeline stage of MindSpeed's layout with identity layers `noop` (each stage
    num_layers / PP layers, or num_layer_list's), as a num_layer_list; None where a stage would hold none or the
    layout is not a split of num_layers."""
    try:
        counts = [int(x) for x in num_layer_list.split(",")] if isinstance(num_layer_list, str) else num_layer_list
    except ValueError:
        return None
    if counts is None:
        counts = [num_layers // pp] * pp if pp >= 1 and not num_layers % pp else []
    if len(counts) != pp or sum(counts) != num_layers:
        return None
    starts, skip = [sum(counts[:s]) for s in range(pp)], set(noop)
    real = [sum(1 for i in range(a, a + n) if i not in skip) for a, n in zip(starts, counts)]
    return ",".join(map(str, real)) if min(real) >= 1 else None


# WANDB_MODE values wandb accepts (its Settings.mode).
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install, or a module entry without a spec
        return False


def check_trackers(cfg: RLConfig, col: Collector) -> None:
    """The trackers' packages are installed and wandb's mode is one it knows: found at load, not when the trainer
    has started its workers and opens the metrics sinks."""
    rl = cfg.rl_config
    for kind in ("wandb", "swanlab"):
        if getattr(rl, f"use_{kind}") and not _installed(kind):
            col.add(f"rl_config.use_{kind}", f"is true but the `{kind}` package is not installed: "
                    f"`pip install {kind}`, or set use_{kind}: false")  # fmt: skip
    mode = os.environ.get("WANDB_MODE")
    if rl.use_wandb and mode is not None and mode not in WANDB_MODES:
        col.add("rl_config.use_wandb", f"the environment's WANDB_MODE={mode!r} is not a wandb mode (one of "
                f"{', '.join(WANDB_MODES)}; offline writes the run locally)")  # fmt: skip
    if rl.use_swanlab and rl.swanlab_mode == "local" and _installed("swanlab") and not _installed("swanboard"):
        col.add("rl_config.swanlab_mode", "'local' needs SwanLab's dashboard package: "
                "`pip install \"swanlab[dashboard]\"`, or use swanlab_mode: offline (files only, no dashboard)")  # fmt: skip


def _older_iteration_spec(path: str):
    for it in reversed(saved_iterations(path)):
        try:
            return read_model_meta(path, it)[0]
        except (CheckpointError, OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _check_checkpoint(
    col: Collector, key: str, path: str | None, arch: ModelArchConfig, value_model: bool
) -> ModelSpec | None:
    """Report what is wrong with the checkpoint at `path` to `col`; its model description (None: none to read)."""
    if not path or col.is_bad(key):
        return None
    if not os.path.isdir(path):
        col.add(key, f"checkpoint directory {_p(path)} does not exist")
        return None
    if not os.path.isfile(os.path.join(path, TRACKER)):
        col.add(key, f"{_p(path)} is not a megatron checkpoint: it has no {TRACKER} (convert an HF model with "
                "mindrl-convert hf2mcore, or point at a finished save)")  # fmt: skip
        return None
    try:
        spec = legacy.resolve_spec(path)[0] if legacy.is_legacy(path) else read_model_meta(path)[0]
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        # A damaged newest iteration: a resume falls back to an older complete one (with a warning), whose
        # description serves the checks here; with none readable, the error stands.
        spec = _older_iteration_spec(path)
        if spec is None:
            col.add(key, f"cannot read the checkpoint's model description: {e}")
            return None
    if spec.is_value_model != value_model:
        want = "a value model (convert with --orm)" if value_model else "a causal LM"
        col.add(key, f"{path!r} holds a {spec.architecture}, but this role needs {want}")
    if not arch.name:
        return spec
    # The model file must describe the network in the checkpoint: layouts and the planner trust it.
    where = f"model.{arch.name}"
    pairs = [
        ("num_layers", arch.num_layers, spec.num_layers),
        ("hidden_size", arch.hidden_size, spec.hidden_size),
        ("ffn_hidden_size", arch.ffn_size, spec.ffn_hidden_size),
        ("num_attention_heads", arch.num_attention_heads, spec.num_heads),
        ("num_query_groups", arch.num_kv_heads, spec.num_kv_heads),
        ("kv_channels", arch.head_dim, spec.head_dim),
        ("padded_vocab_size", arch.padded_vocab_size, spec.vocab_size),
        ("add_qkv_bias", arch.add_qkv_bias, spec.qkv_bias),
        # with MLA, MindSpeed's qk_layernorm names the query / key-value latents' RMSNorms, which MLA always has
        ("qk_layernorm", arch.qk_layernorm, spec.is_mla or spec.qk_layernorm),
        ("num_experts", arch.num_experts or 0, spec.num_experts),
        ("multi_latent_attention", arch.multi_latent_attention, spec.is_mla),
    ]
    if arch.multi_latent_attention and spec.is_mla:
        pairs += [
            ("q_lora_rank", arch.q_lora_rank or 0, spec.q_lora_rank),
            ("kv_lora_rank", arch.kv_lora_rank, spec.kv_lora_rank),
            ("qk_head_dim", arch.qk_head_dim, spec.qk_nope_head_dim),
            ("qk_pos_emb_head_dim", arch.qk_pos_emb_head_dim, spec.qk_rope_head_dim),
            ("v_head_dim", arch.v_head_dim, spec.v_head_dim),
            ("rope_scaling_factor", arch.rope_scaling_factor if arch.rope_scaling_type == "yarn" else 0.0,
             spec.yarn_factor),
        ]  # fmt: skip
    if arch.is_moe and spec.is_moe:
        pairs += [
            ("moe_router_topk", arch.moe_router_topk, spec.moe_router_topk),
            ("moe_ffn_hidden_size", arch.expert_ffn_size, spec.moe_ffn_hidden_size),
            ("norm_topk_prob", arch.norm_topk_prob, spec.norm_topk_prob),
        ]
    if arch.is_moe and spec.family == "deepseek_v3":
        pairs += [
            ("first_k_dense_replace", arch.first_k_dense_replace, min(spec.moe_layers, default=0)),
            ("n_shared_experts (x moe_ffn_hidden_size)", arch.shared_expert_ffn_size, spec.moe_shared_expert_ffn),
            ("moe_router_score_function", arch.moe_router_score_function, spec.moe_score_function),
            ("moe_router_enable_expert_bias", arch.moe_router_enable_expert_bias, spec.moe_expert_bias),
            ("moe_router_num_groups", arch.moe_router_num_groups or 0, spec.moe_num_groups),
            ("moe_router_group_topk", arch.moe_router_group_topk or 0, spec.moe_group_topk),
            ("moe_router_topk_scaling_factor", arch.moe_router_topk_scaling_factor or 1.0,
             spec.moe_routed_scaling_factor),
        ]  # fmt: skip
    if not value_model:
        pairs.append(("untie_embeddings_and_output_weights", arch.untie_embeddings_and_output_weights,
                      not spec.tie_word_embeddings))  # fmt: skip
    for name, ours, theirs in pairs:
        if ours is not None and ours != theirs and not col.is_bad(f"{where}.{name}"):
            col.add(f"{where}.{name}", f"is {ours} but the checkpoint {key}={path!r} has {theirs}: the model file "
                    "must describe the checkpoint's network")  # fmt: skip
    return spec


def _check_adapters(col: Collector, path: str | None, settings: LoRASettings) -> None:
    """The LoRA adapters the checkpoint at `path` holds (a LoRA run's save, or an HF model + PEFT adapter converted
    with mindrl-convert hf2mcore --adapter) are the ones the actor's keys describe."""
    if not path or not os.path.isdir(path) or legacy.is_legacy(path):
        return
    try:
        _, meta = read_model_meta(path)
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return  # reported by _check_checkpoint, or an older iteration serves
    saved = meta.get("lora")
    where = os.path.join(iteration_dir(path, read_tracker(path)), MODEL_META)
    if saved and saved.get("source"):
        where += f", converted from {saved['source']}"
    for key, message in settings.checkpoint_problems(saved):
        col.add(f"actor_config.{key}", f"{message} (actor_config.load: {where})")


class _TokenizerSize:
    """len(tokenizer) of megatron_training.tokenizer_name_or_path, read once, on first use (only a model file without
    padded_vocab_size needs it)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._size: int | None = None
        self.error: str | None = None

    def __call__(self) -> int | None:
        if self._size is None and self.error is None:
            try:
                self._size = len(load_tokenizer(self.path))
            except Exception as e:  # noqa: BLE001 (any failure to read it is reported, with its message)
                self.error = f"cannot read megatron_training.tokenizer_name_or_path={self.path!r}: {e}"
        return self._size


def _check_vocab_rows(
    col: Collector, key: str, path: str, rows: int, arch: ModelArchConfig, role: str, tp: int, tokenizer
) -> None:
    """With padded_vocab_size unset, megatron's rows (`ModelArchConfig.vocab_rows`) must be the checkpoint's `rows`:
    mindrl builds the checkpoint's own rows and does not re-pad it."""
    where = f"model.{arch.name}"
    name = f"{where}.make_vocab_size_divisible_by"
    if not arch.name or arch.padded_vocab_size is not None or col.is_bad(name, f"{role}.tensor_model_parallel_size"):
        return
    size = tokenizer()
    if size is None:
        col.add(name, f"with {where}.padded_vocab_size unset, the vocabulary rows come from the tokenizer's size, "
                f"but {tokenizer.error}; set padded_vocab_size: {rows} (the checkpoint's)")  # fmt: skip
        return
    want = arch.vocab_rows(size, tp)
    if want != rows:
        div = arch.make_vocab_size_divisible_by
        col.add(name, f"with {where}.padded_vocab_size unset, megatron pads the tokenizer's {size} tokens to {want} "
                f"rows (a multiple of make_vocab_size_divisible_by x {role}.tensor_model_parallel_size = {div} x "
                f"{tp}), but the checkpoint {key}={path!r} has {rows}; mindrl builds the checkpoint's rows and does "
                f"not re-pad it: set padded_vocab_size: {rows}, or a make_vocab_size_divisible_by that pads "
                f"{size} to {rows}")  # fmt: skip


def _check_dataset(col: Collector, key: str, data_path: str, extra_keys: list[str]) -> None:
    prefix = dataset_output_prefix(data_path)
    missing = []
    for k in ["input_ids", *extra_keys]:
        base = f"{prefix}_packed_{k}_document"
        missing += [base + ext for ext in (".bin", ".idx") if not os.path.isfile(base + ext)]
    if missing:
        col.add(key, f"packed dataset files missing: {', '.join(missing)} ({key.rsplit('.', 1)[1]} "
                f"{_p(data_path)}; run mindrl-preprocess with output_prefix={prefix!r}, and check "
                "dataset_additional_keys)")  # fmt: skip


def _check_tokenizer(col: Collector, key: str, path: str) -> None:
    if not os.path.isdir(path):
        col.add(key, f"tokenizer directory {_p(path)} does not exist")
    elif not has_tokenizer(path):
        col.add(key, f"{_p(path)} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")


def check_tool_config(col: Collector, path: str) -> None:
    """The tool YAML builds (each entry's class, config and schema); every bad entry reported, naming the file."""
    try:
        build_tools(path)
    except ToolConfigError as e:
        col.add("rl_config.tool_config_path", str(e))


def _check_runtime_env(col: Collector, path: str) -> None:
    key = "rl_config.runtime_env_path"
    if not os.path.isfile(path):
        col.add(key, f"runtime env file {_p(path)} does not exist")
        return
    try:
        read_env_file(path)
    except RuntimeEnvError as e:
        col.add(key, str(e))


# ---------------------------------------------------------------------------------------------- SFT configs
def check_sft_paths(mt: SFTTrainingConfig, col: Collector) -> None:
    """The checkpoint (and that the layout fits its model), the tokenizer and the SFT data, reported to col."""
    _check_training_paths(mt, col, sft_data_counts, value_head=False)


def check_rm_paths(mt: SFTTrainingConfig, col: Collector) -> None:
    """The checkpoint (a causal LM or a value-head model), the tokenizer and the preference data, reported to col."""
    _check_training_paths(mt, col, pairwise_data_counts, value_head=True)


def check_dpo_paths(mt: SFTTrainingConfig, col: Collector) -> None:
    """The checkpoint (a causal LM), the tokenizer and the preference data with its labels, reported to col; and a
    separate reference (ref_model): a causal LM with the policy's vocabulary that the layout fits."""
    _check_training_paths(mt, col, dpo_data_counts, value_head=False)
    if not getattr(mt, "separate_reference", False):
        return
    with col.scope(SFT_SECTION):
        try:
            spec, meta = read_model_meta(mt.ref_model)
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            col.add("ref_model", f"{e} (the reference: a megatron causal LM, e.g. from mindrl-convert hf2mcore)")
            return
        if meta.get("role") != "actor":
            col.add("ref_model", f"{mt.ref_model!r} holds a {spec.architecture} (value head); the DPO reference is a "
                    "causal LM")  # fmt: skip
        try:
            spec.validate_layout(mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size,
                                 uneven_pp=mt.num_layer_list is not None)  # fmt: skip
        except ModelConfigError as e:
            col.add("ref_model", f"TP x PP = {mt.tensor_model_parallel_size} x {mt.pipeline_model_parallel_size} "
                    f"(the policy's layout, which the reference runs at) does not fit it: {e}")  # fmt: skip
        try:
            policy, _ = read_model_meta(mt.load)
        except (CheckpointError, OSError, ValueError, KeyError):
            return  # reported for load
        if policy.vocab_size != spec.vocab_size:
            col.add("ref_model", f"its vocabulary ({spec.vocab_size}) differs from the policy's in load "
                    f"({policy.vocab_size}): the two must score the same token ids")  # fmt: skip


def _check_training_paths(mt: SFTTrainingConfig, col: Collector, data_counts, value_head: bool) -> None:
    with col.scope(SFT_SECTION):
        try:
            spec, meta = read_model_meta(mt.load)
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            col.add("load", f"{e} (make one with mindrl-convert hf2mcore)")
        else:
            if meta.get("role") != "actor" and not value_head:
                col.add("load", f"{mt.load!r} holds a {spec.architecture} (value head); SFT trains a causal LM")
            try:
                spec.validate_layout(mt.tensor_model_parallel_size, 1)
            except ModelConfigError as e:
                col.add("tensor_model_parallel_size", f"does not fit the model in {mt.load!r}: {e}")
            counts = mt.layer_list() if not col.is_bad("num_layer_list") else None
            if counts is not None and sum(counts) != spec.num_layers:
                col.add("num_layer_list", f"{mt.num_layer_list!r} gives {sum(counts)} layers in all; the model in "
                        f"{mt.load!r} has {spec.num_layers}")  # fmt: skip
            try:
                spec.validate_layout(1, mt.pipeline_model_parallel_size, uneven_pp=counts is not None)
            except ModelConfigError as e:
                col.add("pipeline_model_parallel_size", f"does not fit the model in {mt.load!r}: {e}"
                        + (" (an uneven split needs num_layer_list)" if counts is None else ""))  # fmt: skip
            else:
                layers = spec.num_layers // mt.pipeline_model_parallel_size
                for key, message in mt.recompute_problems(layers):
                    if (key, message) not in mt.recompute_problems():  # the rest was reported at load
                        col.add(key, f"{message} (the model in {mt.load!r})")
        if not os.path.isdir(mt.tokenizer_name_or_path):
            col.add("tokenizer_name_or_path", f"tokenizer directory {mt.tokenizer_name_or_path!r} does not exist")
        try:
            counts = data_counts(mt.data_path, mt.split)
        except ValueError as e:
            col.add("data_path", f"{mt.data_path!r}: {e}")
            return
        if counts[0] < mt.global_batch_size:
            col.add("global_batch_size", f"{mt.global_batch_size} is larger than the training split ({counts[0]} "
                    f"samples of {mt.data_path!r} with split {mt.split!r})")  # fmt: skip
        if mt.eval_interval and counts[1] == 0:
            col.add("split", f"{mt.split!r} leaves no validation sample of the {sum(counts)} in {mt.data_path!r}")


def pairwise_data_counts(data_path: str, split: str) -> tuple[int, int, int]:
    """(train, valid, test) pair counts of the preference data at `data_path`, read from the .idx files only.
    Raises ValueError unless it holds the pairwise handler's chosen / rejected ids and margins, one per pair."""
    from mindrl.trainer.reward_model import PAIR_KEYS

    prefix = dataset_output_prefix(data_path)
    counts = []
    for key in PAIR_KEYS:
        p = dataset_prefix(prefix, key)
        if not (os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx")):
            raise ValueError(
                f"{p}.{{bin,idx}} not found (run mindrl-preprocess with handler_name=AlpacaStylePairwiseHandler)"
            )
        counts.append(len(IndexedDataset(p)))
    if len(set(counts)) != 1:
        raise ValueError(f"{', '.join(PAIR_KEYS)} hold {counts} documents: the preference data is inconsistent")
    return split_counts(counts[0], split)


def dpo_data_counts(data_path: str, split: str) -> tuple[int, int, int]:
    """`pairwise_data_counts`, and the chosen / rejected labels (which pick the response tokens) are there too."""
    counts = pairwise_data_counts(data_path, split)
    prefix = dataset_output_prefix(data_path)
    for side in ("chosen", "rejected"):
        ids, labels = (dataset_prefix(prefix, f"{side}_{k}") for k in ("input_ids", "labels"))
        if not (os.path.isfile(labels + ".bin") and os.path.isfile(labels + ".idx")):
            raise ValueError(f"{labels}.{{bin,idx}} not found (DPO needs the pairwise handler's labels)")
        if (IndexedDataset(ids).sequence_lengths != IndexedDataset(labels).sequence_lengths).any():
            raise ValueError(f"{side}_labels are not per-token labels of {side}_input_ids (their lengths differ)")
    return counts


def sft_data_counts(data_path: str, split: str) -> tuple[int, int, int]:
    """(train, valid, test) document counts of the SFT data at `data_path`, read from the .idx files only.
    Raises ValueError unless it holds input_ids and labels of equal lengths per document (the Alpaca handler's)."""
    prefix = dataset_output_prefix(data_path)
    for key in ("input_ids", "labels"):
        p = dataset_prefix(prefix, key)
        if not (os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx")):
            raise ValueError(
                f"{p}.{{bin,idx}} not found (run mindrl-preprocess with handler_name=AlpacaStyleInstructionHandler)"
            )
    ids = IndexedDataset(dataset_prefix(prefix, "input_ids"))
    labels = IndexedDataset(dataset_prefix(prefix, "labels"))
    if len(ids) != len(labels) or (ids.sequence_lengths != labels.sequence_lengths).any():
        raise ValueError(
            "labels are not per-token targets of input_ids (their lengths differ): SFT data comes from "
            "mindrl-preprocess with handler_name=AlpacaStyleInstructionHandler (labels -100 over the prompt)"
        )
    return split_counts(len(ids), split)
