"""HF <-> megatron checkpoint conversion and the logits check, on local ranks (`RankPool`), tensor by tensor: no rank
ever holds more than its own shard of the model. Inputs are validated before any rank starts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import dataclass

import torch

from mindrl.checkpoint import legacy, loading, mcore_ckpt
from mindrl.checkpoint.hf_io import CheckpointError, HFCheckpoint, HFShardWriter, carry_files
from mindrl.models.hf_config import ModelSpec, torch_dtype
from mindrl.models.weight_map import (
    expected_hf_names,
    expected_hf_shape,
    mcore_param_names,
    named_weights,
    param_mapping,
)


@dataclass
class ConversionStats:
    seconds: float
    num_params: int
    bytes_written: int
    ranks: int
    peak_rss_bytes: list[int] = dataclasses.field(default_factory=list)  # per rank
    base_rss_bytes: list[int] = dataclasses.field(default_factory=list)  # per rank, before loading weights


def _role(spec: ModelSpec) -> str:
    return "critic" if spec.is_value_model else "actor"


def _check_orm_flag(spec: ModelSpec, orm: bool, where: str) -> None:
    if spec.is_value_model and not orm:
        raise CheckpointError(
            f"{where} holds a reward/critic model ({spec.architecture}, value head); pass --orm to convert it"
        )
    if orm and not spec.is_value_model:
        raise CheckpointError(
            f"--orm expects a reward/critic model (HF *ForSequenceClassification with num_labels=1, or a "
            f"megatron value-head checkpoint), but {where} holds {spec.architecture}; drop --orm for a causal LM"
        )


def _check_pool(pool, world_size: int, ep: int = 1) -> None:
    """The caller's pool must be a multiple of TP*PP (extra ranks are DP replicas) and its DP ranks of EP; checked
    before any output."""
    if pool is not None and pool.world_size % world_size:
        raise ValueError(f"pool of {pool.world_size} ranks cannot host TP*PP = {world_size}")
    if pool is not None and (pool.world_size // world_size) % ep:
        raise ValueError(
            f"pool of {pool.world_size} ranks: its {pool.world_size // world_size} DP ranks cannot host EP={ep}"
        )


@contextlib.contextmanager
def _ranks(pool, world_size: int, ep: int = 1):
    """The caller's pool or a new one of world_size x ep ranks."""
    from mindrl.launch import RankPool

    if pool is not None:
        _check_pool(pool, world_size, ep)
        yield pool
        return
    with RankPool(world_size * ep) as new_pool:
        yield new_pool


def _refuse_mtp_layers(hf_dir: str, spec: ModelSpec, unexpected: list[str]) -> None:
    """A DeepSeek-V3 / R1 checkpoint's multi-token prediction layers (config.json num_nextn_predict_layers, stored as
    the layers after the last decoder layer): refused with what they are, as mindrl builds no MTP module."""
    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            mtp = int(json.load(f).get("num_nextn_predict_layers") or 0)
    except (OSError, ValueError, TypeError):
        return
    extra = sorted({int(m.group(1)) for n in unexpected if (m := re.match(r"model\.layers\.(\d+)\.", n))})
    if not mtp or not extra or extra[0] < spec.num_layers:
        return
    raise CheckpointError(
        f"{hf_dir}: layers {extra} are multi-token prediction (MTP) modules (config.json num_nextn_predict_layers="
        f"{mtp}) after the {spec.num_layers} decoder layers; mindrl builds no MTP module (transformers' "
        f"{spec.architecture} has none either), so it can neither train nor convert them. To train the model "
        f"without them, write a copy of the checkpoint without the model.layers.{extra[0]}.* tensors and with "
        "num_nextn_predict_layers: 0"
    )


def validate_hf_checkpoint(hf_dir: str, spec: ModelSpec) -> HFCheckpoint:
    """Every expected tensor present once with the shape the config implies, nothing unexpected."""
    ckpt = HFCheckpoint(hf_dir)
    have = set(ckpt.keys())
    expected = expected_hf_names(spec)
    missing = [n for n in expected if n not in have]
    if missing:
        raise CheckpointError(f"{hf_dir}: missing tensors for {spec.architecture}: {missing[:8]}")
    # A tied model may also store lm_head (a copy of the embedding); rotary buffers are recomputed.
    ignorable = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    unexpected = [
        n for n in sorted(have - set(expected)) if n not in ignorable and not n.endswith("rotary_emb.inv_freq")
    ]
    if unexpected:
        _refuse_mtp_layers(hf_dir, spec, unexpected)
        raise CheckpointError(f"{hf_dir}: tensors that are not part of a {spec.architecture}: {unexpected[:8]}")
    for name in expected:
        shape = ckpt.shape(name)
        want = expected_hf_shape(spec, name)
        if shape != want:
            raise CheckpointError(f"{hf_dir}: tensor {name!r} has shape {shape}, but config.json implies {want}")
    return ckpt


def _prepare_out_dir(path: str, overwrite: bool, input_dir: str) -> str:
    """Check that `path` may be written and return the sibling `.partial` directory to write into. An existing
    output is replaced only by `_commit`, after success: a failed conversion leaves it as it was."""
    out, src = os.path.realpath(path), os.path.realpath(input_dir)
    if out == src or out.startswith(src + os.sep) or src.startswith(out + os.sep):
        raise CheckpointError(f"output directory {path!r} overlaps the input {input_dir!r}; choose another --save-dir")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"output path {path!r} exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise CheckpointError(f"output directory {path!r} is not empty; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"cannot write to {parent!r}")
    partial = path.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a killed run
    return partial


def _commit(partial: str, path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)  # empty, or --overwrite (checked by _prepare_out_dir)
    os.replace(partial, path)


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------- hf2mcore
def _hf2mcore_rank(
    hf_dir: str, it_dir: str, spec_dict: dict, tp: int, pp: int, dtype: str, ep: int = 1, adapter: str | None = None
) -> dict:
    from megatron.core import parallel_state as ps
    from tqdm import tqdm

    from mindrl.launch import init_model_parallel
    from mindrl.models.builder import build_model
    from mindrl.models.weight_map import full_to_local, global_name, hf_to_full

    init_model_parallel(tp, pp, ep=ep)
    rss_before = _peak_rss()  # interpreter + torch + megatron, before any weight exists
    spec = ModelSpec.from_dict(spec_dict)
    model = build_model(spec, _role(spec), dtype=dtype, perform_initialization=False)
    peft = None
    if adapter is not None:  # an HF model + PEFT adapter: mindrl's LoRA layers, holding the adapter's A and B
        from mindrl.checkpoint.peft_io import load_peft_adapter
        from mindrl.models.lora import adapter_mapping, apply_lora, is_adapter_param

        peft = load_peft_adapter(adapter, spec)
        apply_lora(model, peft.lora_r, peft.lora_alpha, peft.lora_target_modules)
    reader = HFCheckpoint(hf_dir)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    offset = pp_rank * (spec.num_layers // pp)
    expert_offset = ps.get_expert_model_parallel_rank() * (spec.num_experts // ep)
    params = named_weights(model)
    show = torch.distributed.get_rank() == 0
    with torch.no_grad():
        for name, param in tqdm(params, desc="hf2mcore rank 0", disable=not show, unit="tensor"):
            if peft is not None and is_adapter_param(name):
                mapping = adapter_mapping(spec, global_name(name, offset))[0]
                full = peft.tensors[mapping.mcore_name]
            else:
                mapping = param_mapping(spec, global_name(name, offset, expert_offset))
                full = hf_to_full(spec, mapping, [reader.get(n) for n in mapping.hf_names])
            local = full_to_local(mapping, full, tp_rank, tp)
            if tuple(local.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{mapping.hf_names} -> {name}: shape {tuple(local.shape)} != {tuple(param.shape)}"
                )
            param.copy_(local)
    reader.close()
    mcore_ckpt.save_model(model, it_dir)
    return {"num_params": sum(p.numel() for _, p in params), "peak_rss": _peak_rss(), "rss_before": rss_before}


def hf2mcore(
    hf_dir: str, save_dir: str, tp: int = 1, pp: int = 1, orm: bool = False, dtype: str | None = None,
    overwrite: bool = False, pool=None, ep: int = 1, adapter: str | None = None,
) -> ConversionStats:  # fmt: skip
    """Convert an HF checkpoint into a mindrl/megatron checkpoint saved from TP x PP (x EP for a MoE model) ranks.
    adapter: a PEFT LoRA directory for that model (adapter_config.json + adapter_model.safetensors): the checkpoint
    is then a LoRA model's, its adapters in mindrl's LoRA layers (`mindrl.models.lora`), as a LoRA run saves one; a
    run whose lora_r / lora_alpha / lora_target_modules are the adapter's trains on from it."""
    t0 = time.perf_counter()
    spec = ModelSpec.from_hf_dir(hf_dir)
    _check_orm_flag(spec, orm, hf_dir)
    spec.validate_layout(tp, pp, ep)
    dtype = str(torch_dtype(dtype or spec.dtype)).replace("torch.", "")
    validate_hf_checkpoint(hf_dir, spec)
    lora = None
    if adapter is not None:
        lora = _adapter_meta(adapter, spec, orm)
    _check_pool(pool, tp * pp, ep)
    partial = _prepare_out_dir(save_dir, overwrite, hf_dir)
    it_dir = mcore_ckpt.iteration_dir(partial, mcore_ckpt.RELEASE)
    os.makedirs(it_dir)
    try:
        with _ranks(pool, tp * pp, ep) as ranks:
            results = ranks.run(_hf2mcore_rank, hf_dir, it_dir, spec.to_dict(), tp, pp, dtype, ep, adapter)
        mcore_ckpt.write_model_meta(it_dir, spec, _role(spec), tp, pp, dtype, lora=lora)
        carry_files(hf_dir, os.path.join(partial, mcore_ckpt.HF_FILES))
        mcore_ckpt.write_tracker(partial, mcore_ckpt.RELEASE)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _commit(partial, save_dir)
    return ConversionStats(
        seconds=time.perf_counter() - t0,
        num_params=sum(r["num_params"] for r in results),
        bytes_written=mcore_ckpt.dir_nbytes(mcore_ckpt.iteration_dir(save_dir, mcore_ckpt.RELEASE)),
        ranks=len(results),
        peak_rss_bytes=[r["peak_rss"] for r in results],
        base_rss_bytes=[r["rss_before"] for r in results],
    )


def _adapter_meta(adapter: str, spec: ModelSpec, orm: bool) -> dict:
    """The checkpoint meta's `lora` for a PEFT adapter, read and checked (every tensor, before any rank starts)."""
    from mindrl.checkpoint.peft_io import CONFIG, load_peft_adapter

    if orm or spec.is_moe:
        raise CheckpointError(f"--adapter {adapter}: LoRA adapters load onto a dense causal LM only")
    peft = load_peft_adapter(adapter, spec)
    return {
        "lora_r": peft.lora_r,
        "lora_alpha": peft.lora_alpha,
        "lora_target_modules": peft.lora_target_modules,
        "source": os.path.abspath(os.path.join(adapter, CONFIG)),
    }


# ------------------------------------------------------------------------------------- mcore2hf
def _mcore2hf_rank(
    load_dir: str, out_dir: str, max_shard_bytes: int, hf_config: str | None = None, adapter_only: bool = False
) -> dict:
    from tqdm import tqdm

    from mindrl.models.lora import adapted_linears, is_adapter_param, merged_weight
    from mindrl.models.weight_map import full_to_hf

    rss_before = _peak_rss()
    spec, meta, model = loading.build_and_load(load_dir, 1, 1, hf_config=hf_config)
    if torch.distributed.get_rank() != 0:
        return {"peak_rss": _peak_rss()}
    params = dict(named_weights(model))
    if adapter_only:  # a LoRA checkpoint's adapters as a PEFT directory for the base model
        from mindrl.checkpoint.peft_io import save_peft_adapter

        lora = meta.get("lora")
        if not lora:
            raise CheckpointError(f"{load_dir} holds no LoRA adapters (its model meta has no 'lora'): nothing to write")
        tensors = {n: p.detach().cpu() for n, p in params.items() if is_adapter_param(n)}
        save_peft_adapter(out_dir, spec, tensors, lora["lora_r"], lora["lora_alpha"], lora["lora_target_modules"])
        return {
            "peak_rss": _peak_rss(),
            "rss_before": rss_before,
            "bytes": sum(t.nbytes for t in tensors.values()),
            "num_params": sum(t.numel() for t in tensors.values()),
        }
    adapted = adapted_linears(model)  # a LoRA checkpoint: its adapted linears are written merged, W + scale * B A
    writer = HFShardWriter(out_dir, max_shard_bytes)
    names = mcore_param_names(spec)
    for name in tqdm(names, desc="mcore2hf", unit="tensor"):
        mapping = param_mapping(spec, name)
        weight = merged_weight(adapted[name]) if name in adapted else params[name].detach()
        for hf_name, tensor in full_to_hf(spec, mapping, weight.cpu()):
            writer.add(hf_name, tensor)
    shards = writer.finish()
    return {
        "peak_rss": _peak_rss(),
        "rss_before": rss_before,
        "shards": shards,
        "bytes": writer.total_bytes,
        "num_params": sum(p.numel() for n, p in params.items() if not is_adapter_param(n)),
    }


def mcore2hf(
    load_dir: str,
    save_dir: str,
    orm: bool = False,
    max_shard_size_mb: int = 5120,
    overwrite: bool = False,
    pool=None,
    hf_config: str | None = None,
    adapter_only: bool = False,
) -> ConversionStats:
    """Write the checkpoint's latest iteration as an HF safetensors checkpoint (+ config, tokenizer).
    A legacy per-rank checkpoint (mp_rank_* files) needs `hf_config`, the HF model dir giving its architecture
    (unless load_dir/hf_files holds a config.json); its config and tokenizer files are carried over. A LoRA
    checkpoint is written merged (W + scale * B A); with `adapter_only`, its adapters alone as a PEFT directory
    (adapter_config.json + adapter_model.safetensors) that `peft` loads onto the base model."""
    t0 = time.perf_counter()
    if max_shard_size_mb <= 0:
        raise CheckpointError(f"--max-shard-size-mb must be > 0, got {max_shard_size_mb}")
    hf_files = os.path.join(load_dir, mcore_ckpt.HF_FILES)
    if legacy.is_legacy(load_dir):
        spec, source = legacy.resolve_spec(load_dir, hf_config)
        _check_orm_flag(spec, orm, f"{load_dir} (by {source})")
        legacy.LegacyCheckpoint.open(load_dir).check_against(spec, source)
        if hf_config:  # carry the files from where the architecture came from
            hf_files = os.path.dirname(source)
    else:
        spec, _ = mcore_ckpt.read_model_meta(load_dir)
        _check_orm_flag(spec, orm, load_dir)
        mcore_ckpt.check_files(mcore_ckpt.iteration_dir(load_dir, mcore_ckpt.read_tracker(load_dir)))
    partial_dir = _prepare_out_dir(save_dir, overwrite, load_dir)
    try:
        with _ranks(pool, 1) as ranks:
            res = ranks.run(
                _mcore2hf_rank, load_dir, partial_dir, max_shard_size_mb * 1024 * 1024, hf_config, adapter_only
            )[0]
        if adapter_only:
            pass  # a PEFT directory: the base model's config and tokenizer stay with the base model
        elif os.path.isdir(hf_files):
            carry_files(hf_files, partial_dir)
        else:  # not converted from HF: write the config we know
            import json

            with open(os.path.join(partial_dir, "config.json"), "w") as f:
                json.dump(spec.hf_config, f, indent=2)
    except BaseException:
        shutil.rmtree(partial_dir, ignore_errors=True)
        raise
    _commit(partial_dir, save_dir)
    return ConversionStats(
        time.perf_counter() - t0, res["num_params"], res["bytes"], 1, [res["peak_rss"]], [res["rss_before"]]
    )


# ------------------------------------------------------------------------------------- check
# Fields that change the models' shapes: if they differ, the logits cannot be compared at all.
_SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "num_experts", "moe_ffn_hidden_size", "moe_layers",
)  # fmt: skip


def _logits_rank(
    load_dir: str, tp: int, pp: int, input_ids: torch.Tensor, sp: bool, hf_config: str | None = None,
    dtype: str = "float32", ep: int = 1,
) -> torch.Tensor | None:  # fmt: skip
    from megatron.core import parallel_state as ps

    from mindrl.models.forward import forward_outputs

    _, _, model = loading.build_and_load(load_dir, tp, pp, dtype, sequence_parallel=sp, hf_config=hf_config, ep=ep)
    out = forward_outputs(model, input_ids)
    keep = out is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return out if keep else None


def megatron_outputs(
    pool,
    load_dir: str,
    tp: int,
    pp: int,
    input_ids: torch.Tensor,
    sequence_parallel: bool = False,
    hf_config: str | None = None,
    dtype: str = "float32",
    ep: int = 1,
) -> torch.Tensor:
    """Logits (actor) or per-token values (critic) of the checkpoint at TP x PP (x EP) in `dtype`, computed on `pool`.
    hf_config: the HF model dir describing a legacy (mp_rank_*) checkpoint."""
    results = pool.run(_logits_rank, load_dir, tp, pp, input_ids, sequence_parallel, hf_config, dtype, ep)
    return next(r for r in results if r is not None)


def _rms_norm_in_dtype(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon))


def _router_in_dtype(module: torch.nn.Module, hidden_states: torch.Tensor):
    """transformers' Qwen3-MoE top-k router (`Qwen3MoeTopKRouter.forward`) with its softmax in the input's dtype."""
    hidden_states = hidden_states.reshape(-1, module.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, module.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), module.top_k, dim=-1)
    if module.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


def _deepseek_router_in_dtype(module: torch.nn.Module, hidden_states: torch.Tensor):
    """transformers' DeepSeek-V3 router (`DeepseekV3TopkRouter.forward`) with its logits and sigmoid in the input's
    dtype (transformers takes them in fp32 whatever the dtype)."""
    hidden_states = hidden_states.view(-1, module.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, module.weight)
    scores = logits.sigmoid()
    choice = scores + module.e_score_correction_bias
    groups, per_group = module.num_group, module.num_experts // module.num_group
    group_scores = choice.view(-1, groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=module.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, per_group).reshape(-1, module.num_experts)
    index = torch.topk(choice.masked_fill(~score_mask.bool(), float("-inf")), k=module.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if module.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * module.routed_scaling_factor, index


_ROUTERS_IN_DTYPE = {"Qwen3MoeTopKRouter": _router_in_dtype, "DeepseekV3TopkRouter": _deepseek_router_in_dtype}


def hf_outputs(hf_dir: str, input_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The HF model's logits, or per-token scores for a sequence-classification model, in `dtype`. In fp64 its
    RMSNorms keep fp64 statistics too (HF computes them in fp32 whatever the dtype), as mindrl's do in fp64, and so
    does a MoE router's softmax (sigmoid). A MoE model runs transformers' eager per-expert loop (its grouped-GEMM default
    refuses fp64) in every dtype."""
    import functools

    import transformers

    spec = ModelSpec.from_hf_dir(hf_dir)
    cls = getattr(transformers, spec.architecture)
    extra = {"experts_implementation": "eager"} if spec.is_moe else {}
    model = cls.from_pretrained(hf_dir, dtype=dtype, **extra).eval()
    if dtype == torch.float64:
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
                module.forward = functools.partial(_rms_norm_in_dtype, module)
            if type(module).__name__ in _ROUTERS_IN_DTYPE:
                module.forward = functools.partial(_ROUTERS_IN_DTYPE[type(module).__name__], module)
    with torch.no_grad():
        if spec.is_value_model:
            hidden = model.model(input_ids=input_ids).last_hidden_state
            return model.score(hidden).squeeze(-1)
        return model(input_ids=input_ids).logits


# `check`'s default bound as a fraction of HF's fp32-vs-fp64 gap: three orders of magnitude below what fp32 itself
# does to the model, about five above the fp64 agreement of a correct conversion.
GAP_FRACTION = 1e-3


@dataclass
class CheckResult:
    """What `check` measured on one batch of random tokens."""

    max_abs_diff: float
    """max |megatron - HF| over the logits (values), both models in fp64."""
    reference_gap: float
    """max |HF in fp32 - HF in fp64| on the same tokens: how far a correct fp32 forward lands from the fp64 one."""
    max_abs_output: float
    """max |logit| (value) of HF's fp64 forward, for scale."""
    tol: float
    """The bound max_abs_diff was held to: --tol if given, else GAP_FRACTION * reference_gap."""

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tol


def check(
    hf_dir: str, load_dir: str, tp: int | None = None, pp: int | None = None, batch: int = 2, seq_len: int = 64,
    seed: int = 0, pool=None, tol: float | None = None, ep: int = 1,
) -> CheckResult:  # fmt: skip
    """Compare the checkpoint's logits (values) with HF's on random tokens, both models entirely in fp64. A converted
    model passes when its difference from HF is below GAP_FRACTION of fp32's own error on the same tokens (HF fp32 vs
    HF fp64), or below `tol` if given. A fixed bound in fp32 fails a correct 30-layer model on rounding alone; in
    fp64 a correct conversion agrees to ~1e-13 and one slightly wrong weight stands out. A legacy (mp_rank_*)
    checkpoint at load_dir takes its architecture from hf_dir."""
    is_legacy = legacy.is_legacy(load_dir)
    if is_legacy:
        spec, _ = legacy.resolve_spec(load_dir, hf_dir)
        saved = legacy.LegacyCheckpoint.open(load_dir)
        saved.check_against(spec, hf_dir)
        meta = {"tp": saved.tp, "pp": saved.pp}
    else:
        spec, meta = mcore_ckpt.read_model_meta(load_dir)
    hf_spec = ModelSpec.from_hf_dir(hf_dir)
    if hf_spec.architecture != spec.architecture:
        raise CheckpointError(f"{hf_dir} is {hf_spec.architecture} but {load_dir} holds {spec.architecture}")
    differ = [
        f"{k} {getattr(hf_spec, k)} vs {getattr(spec, k)}"
        for k in _SHAPE_FIELDS
        if getattr(hf_spec, k) != getattr(spec, k)
    ]
    if differ:
        raise CheckpointError(f"{hf_dir} and {load_dir} hold differently shaped models: {', '.join(differ)}")
    if not is_legacy:
        mcore_ckpt.check_files(mcore_ckpt.iteration_dir(load_dir, mcore_ckpt.read_tracker(load_dir)))
    tp, pp = tp or meta["tp"], pp or meta["pp"]
    spec.validate_layout(tp, pp, ep)
    _check_pool(pool, tp * pp, ep)
    input_ids = torch.randint(0, spec.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    with _ranks(pool, tp * pp, ep) as ranks:
        ours = megatron_outputs(
            ranks, load_dir, tp, pp, input_ids, hf_config=hf_dir if is_legacy else None, dtype="float64", ep=ep
        )
    ref = hf_outputs(hf_dir, input_ids, torch.float64)
    gap = (hf_outputs(hf_dir, input_ids, torch.float32).double() - ref).abs().max().item()
    return CheckResult(
        max_abs_diff=(ours - ref).abs().max().item(),
        reference_gap=gap,
        max_abs_output=ref.abs().max().item(),
        tol=GAP_FRACTION * gap if tol is None else tol,
    )
