"""Legacy (non-distributed) megatron checkpoints as MindSpeed-LLM's converter writes them (one `torch.save` file per TP
x PP rank), unpickled without running code and loaded into a model at any TP / PP (see `LegacyCheckpoint`)."""

from __future__ import annotations

import argparse
import os
import pickle
import re
from dataclasses import dataclass, field

import torch

from mindrl.checkpoint import mcore_ckpt
from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.config.settings import RecomputeSettings
from mindrl.models.hf_config import ModelConfigError, ModelSpec
from mindrl.models.weight_map import (
    ParamMapping,
    expected_hf_shape,
    local_to_full,
    mcore_param_names,
    param_mapping,
)

RANK_FILES = ("model_optim_rng.pt", "model_rng.pt")  # model_rng.pt: megatron's name when the optimizer is apart
_RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_EP_DIR_RE = re.compile(r"^mp_rank_\d{2}_\d{3}_\d{3}$")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MODEL_KEY_RE = re.compile(r"^model(\d*)$")
# Other spellings of mindrl's parameter names: Transformer-Engine layer specs fuse the norms into the linear
# layers that follow them; reward heads are also saved as `rm_head`.
_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_HEAD_ALIASES = {"rm_head.weight": "output_layer.weight"}
_SKIPPED_SUFFIXES = ("_extra_state", "rotary_pos_emb.inv_freq")


def _safe_globals() -> list:
    """Plain-data classes real legacy files hold outside the weights: megatron's `args` namespace and the
    numpy RNG state. Reconstructing them runs no code from the file."""
    import numpy as np

    allowed: list = [argparse.Namespace, np.ndarray, np.dtype]
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1
        try:
            allowed.append(__import__(mod, fromlist=["_reconstruct"])._reconstruct)
            break
        except (ImportError, AttributeError):
            continue
    allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32")]  # numpy's dtype classes
    return allowed


# Enums megatron / MindSpeed keep in `args` (e.g. args.attention_backend = AttnBackend.auto). They are read as
# inert stand-ins under the enum's name: the real class is never imported or called.
_INERT_RE = re.compile(r"^(megatron|mindspeed|mindspeed_llm|mindspeed_rl)(\.\w+)*\.enums\.\w+$")


class InertStandIn:
    """What an allowed non-tensor object (a megatron enum in `args`) unpickles to: its arguments, nothing run."""

    global_name = ""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.global_name}{self.args!r}>"


def _inert_globals(path: str) -> list[tuple[type, str]]:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # unreadable: torch.load below says why
        return []
    return [(type(n.rsplit(".", 1)[-1], (InertStandIn,), {"global_name": n}), n) for n in names if _INERT_RE.match(n)]


def load_rank_file(path: str) -> dict:
    """One legacy rank file, unpickled with weights_only=True plus `_safe_globals` (and megatron's enums as
    inert stand-ins). Anything else in the pickle (a class, a function) is refused, naming the file and what it
    would have imported."""
    try:
        with torch.serialization.safe_globals(_safe_globals() + _inert_globals(path)):
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # a pre-zipfile (torch < 1.6) file cannot be memory-mapped
                if "mmap" not in str(e):
                    raise
                state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:
            unsafe = []
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in _safe_globals()}
        names = [u for u in unsafe if u not in allowed and not _INERT_RE.match(u)] or unsafe
        what = f"objects of {names}" if names else "pickled objects other than tensors and plain data"
        raise CheckpointError(
            f"{path}: refused to load: it holds {what}, which torch.load(weights_only=True) will not unpickle "
            "(mindrl never runs code from a checkpoint). Re-save the file with only tensors and plain data under "
            "'model' (e.g. drop 'args' / 'optimizer')"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # truncated zip, not a torch file
        raise CheckpointError(f"{path}: not a readable torch.save file ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict with a 'model' state dict, got {type(state).__name__}")
    return state


def _model_chunks(state: dict, path: str) -> list[dict]:
    """The state dict(s) in a rank file: [model] or [model0, model1, ...] (virtual pipeline chunks)."""
    if "model" in state:
        chunks = [state["model"]]
    else:
        keys = sorted((k for k in state if isinstance(k, str) and _MODEL_KEY_RE.match(k)), key=lambda k: int(k[5:]))
        if not keys:
            raise CheckpointError(f"{path}: no 'model' state dict in it (keys: {sorted(map(str, state))[:8]})")
        chunks = [state[k] for k in keys]
    for c in chunks:
        if not isinstance(c, dict):
            raise CheckpointError(f"{path}: 'model' is a {type(c).__name__}, expected a state dict")
    return chunks


def _canonical(key: str) -> str | None:
    """mindrl's (stage-local) name for a legacy state-dict key; None for non-weights to skip."""
    if key.endswith(_SKIPPED_SUFFIXES):
        return None
    if key in _HEAD_ALIASES:
        return _HEAD_ALIASES[key]
    m = _LAYER_RE.match(key)
    if m and m.group(2) in _ALIASES:
        return f"decoder.layers.{m.group(1)}.{_ALIASES[m.group(2)]}"
    return key


# ------------------------------------------------------------------------------------------ layout
def is_legacy(root: str, iteration: int | str | None = None) -> bool:
    """True when ROOT's tracked (or given) iteration holds mp_rank_* directories: a legacy per-rank checkpoint."""
    try:
        iteration = mcore_ckpt.read_tracker(root) if iteration is None else iteration
        it_dir = mcore_ckpt.iteration_dir(root, iteration)
        return any(_RANK_DIR_RE.match(d) or _EP_DIR_RE.match(d) for d in os.listdir(it_dir))
    except (CheckpointError, OSError):
        return False


def tracked_iteration(root: str, iteration: int | str | None = None) -> tuple[str, int | str]:
    """(the directory of the tracked, or given, iteration; the iteration), with errors naming the tracker."""
    from_tracker = iteration is None
    iteration = mcore_ckpt.read_tracker(root) if from_tracker else iteration
    it_dir = mcore_ckpt.iteration_dir(root, iteration)
    if not os.path.isdir(it_dir):
        named = f"{os.path.join(root, mcore_ckpt.TRACKER)} names" if from_tracker else "asked for"
        raise CheckpointError(f"{named} iteration {iteration!r}, but {it_dir} does not exist")
    return it_dir, iteration


@dataclass
class LegacyCheckpoint:
    """The rank files of one legacy iteration, checked complete, with a per-name index of where each
    parameter lives. Files are memory-mapped and read lazily, tensor by tensor.

        ROOT/latest_checkpointed_iteration.txt                "release" or the iteration number
        ROOT/release/ or ROOT/iter_0000010/
            mp_rank_TT/model_optim_rng.pt                     TP rank TT (PP = 1)
            mp_rank_TT_PPP/model_optim_rng.pt                 TP rank TT, PP rank PPP (PP > 1)

    Each file is a dict: `model` (or `model0`, `model1`, ... under virtual pipelining) holds that rank's megatron
    state dict, layer numbers local to its stage; `args`, `iteration`, `rng_state`, `optimizer` ... are not
    needed to load the weights (docs/legacy_checkpoints.md)."""

    root: str
    it_dir: str = ""
    iteration: int | str = 0
    tp: int = 0
    pp: int = 0
    files: dict[tuple[int, int], str] = field(default_factory=dict)  # (tp_rank, pp_rank) -> path
    # global mindrl name -> [(pp_rank, chunk, stage-local legacy key)] (one entry; a tied copy may add one)
    index: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)
    num_layers: int = 0  # over all stages and chunks
    _cache: dict[tuple[int, int], list[dict]] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: str, iteration: int | str | None = None) -> LegacyCheckpoint:
        it_dir, iteration = tracked_iteration(root, iteration)
        ranks = {}
        for d in sorted(os.listdir(it_dir)):
            if _EP_DIR_RE.match(d):
                raise CheckpointError(
                    f"{os.path.join(it_dir, d)}: an expert-parallel (MoE) rank directory; mindrl reads dense models only"
                )
            m = _RANK_DIR_RE.match(d)
            if m:
                ranks[(int(m.group(1)), int(m.group(2) or 0))] = (os.path.join(it_dir, d), m.group(2) is not None)
        if not ranks:
            raise CheckpointError(f"{it_dir} holds no mp_rank_XX[_YYY] directories: not a legacy megatron checkpoint")
        if len({with_pp for _, with_pp in ranks.values()}) > 1:
            raise CheckpointError(f"{it_dir} mixes mp_rank_XX and mp_rank_XX_YYY directories")
        tp = max(t for t, _ in ranks) + 1
        pp = max(p for _, p in ranks) + 1
        ckpt = cls(root, it_dir, iteration, tp, pp)
        for t in range(tp):
            for p in range(pp):
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                if (t, p) not in ranks:
                    raise CheckpointError(
                        f"{os.path.join(it_dir, name)} is missing: the checkpoint has TP={tp} x PP={pp} ranks "
                        "(judging by the other mp_rank directories), the copy is incomplete"
                    )
                rank_dir = ranks[(t, p)][0]
                path = next(
                    (os.path.join(rank_dir, f) for f in RANK_FILES if os.path.isfile(os.path.join(rank_dir, f))), None
                )
                if path is None:
                    raise CheckpointError(f"{rank_dir} has no {' or '.join(RANK_FILES)}: the checkpoint is incomplete")
                ckpt.files[(t, p)] = path
        ckpt._build_index()
        return ckpt

    def chunks(self, tp_rank: int, pp_rank: int) -> list[dict]:
        key = (tp_rank, pp_rank)
        if key not in self._cache:
            path = self.files[key]
            self._cache[key] = _model_chunks(load_rank_file(path), path)
        return self._cache[key]

    def _build_index(self) -> None:
        """Global layer numbers from TP rank 0's files: stages (and virtual chunks) hold consecutive layers in
        the order chunk-major, then stage, which also covers uneven splits (MindSpeed's --num-layer-list)."""
        per_stage = [self.chunks(0, p) for p in range(self.pp)]
        num_chunks = {len(c) for c in per_stage}
        if len(num_chunks) != 1:
            raise CheckpointError(f"{self.it_dir}: pipeline stages hold different numbers of model chunks")
        offset = 0
        for chunk in range(num_chunks.pop()):
            for p in range(self.pp):
                layers = set()
                for key in per_stage[p][chunk]:
                    name = _canonical(key)
                    if name is None:
                        continue
                    m = _LAYER_RE.match(name)
                    if m:
                        layers.add(int(m.group(1)))
                        name = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"
                    self.index.setdefault(name, []).append((p, chunk, key))
                if layers and sorted(layers) != list(range(len(layers))):
                    raise CheckpointError(
                        f"{self.files[(0, p)]}: layer numbers {sorted(layers)} are not 0..{len(layers) - 1} "
                        "(legacy files number layers from 0 in each pipeline stage)"
                    )
                offset += len(layers)
        self.num_layers = offset

    def dtype(self) -> torch.dtype:
        """The dtype the weights were saved in (that of the first floating-point tensor)."""
        for t in self.chunks(0, 0)[0].values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return t.dtype
        raise CheckpointError(f"{self.files[(0, 0)]}: the 'model' state dict holds no floating-point tensor")

    def check_against(self, spec: ModelSpec, source: str) -> None:
        """Every parameter the spec's model needs is there, and nothing else: names the key and the file."""
        if self.num_layers != spec.num_layers:
            raise CheckpointError(
                f"{self.it_dir} holds {self.num_layers} layers but {source} says num_hidden_layers={spec.num_layers}"
            )
        needed = set(mcore_param_names(spec))
        missing = sorted(needed - set(self.index))
        if missing:
            raise CheckpointError(
                f"{self.it_dir}: parameter {missing[0]!r} is missing from the rank files "
                f"({len(missing)} missing in all), which a {spec.architecture} ({source}) needs"
            )
        tied_copy = {"output_layer.weight"} if spec.tie_word_embeddings and not spec.is_value_model else set()
        extra = sorted(set(self.index) - needed - tied_copy)
        if extra:
            p, _, key = self.index[extra[0]][0]
            raise CheckpointError(
                f"{self.files[(0, p)]}: tensor {key!r} is not part of a {spec.architecture} ({source}); "
                f"{len(extra)} such tensors (is it the right HF config, causal LM vs *ForSequenceClassification?)"
            )
        for name in sorted(needed | (tied_copy & set(self.index))):  # a tied copy must be shaped like the embedding
            p, chunk, key = self.index[name][0]
            tensor = self.chunks(0, p)[chunk][key]
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"{self.files[(0, p)]}: {key!r} is a {type(tensor).__name__}, not a tensor")
            have = tuple(tensor.shape)
            fits, want = _shard_shape_fits(spec, name, self.tp, have)
            if not fits:
                raise CheckpointError(
                    f"{self.files[(0, p)]}: tensor {key!r} has shape {have}, but {source} implies {want} on each of "
                    f"the checkpoint's TP={self.tp} ranks (is it the right HF config?)"
                )

    def full(self, spec: ModelSpec, name: str) -> torch.Tensor:
        """The TP=1 (full) tensor of global parameter `name`, gathered over the legacy TP ranks."""
        mapping = param_mapping(spec, name)
        if name == "output_layer.weight" and spec.tie_word_embeddings and not spec.is_value_model:
            name = "embedding.word_embeddings.weight"  # a tied model's output layer is its embedding
        p, chunk, key = self.index[name][0]
        shards = []
        for t in range(self.tp):
            sd = self.chunks(t, p)[chunk]
            if key not in sd:
                raise CheckpointError(f"{self.files[(t, p)]}: tensor {key!r} is missing (TP rank 0 has it)")
            shards.append(sd[key])
        if mapping.tp_split == "replicated" and name == "output_layer.weight" and self.tp > 1:
            # A value head saved as a row-parallel layer: each rank holds a slice of the hidden dimension.
            if shards[0].shape[-1] * self.tp == spec.hidden_size:
                mapping = ParamMapping(mapping.mcore_name, mapping.hf_names, "row")
        full = local_to_full(mapping, shards)
        if mapping.tp_split == "column" and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if full.shape[0] > spec.vocab_size:
                full = full[: spec.vocab_size]  # rows megatron padded the vocabulary with
        return full

    def close(self) -> None:
        self._cache.clear()


def _shard_shape_fits(spec: ModelSpec, name: str, tp: int, have: tuple[int, ...]) -> tuple[bool, str]:
    """(does one legacy TP rank's shard of `name` have a shape the spec allows, the shape expected). Vocabulary
    rows may be padded (megatron pads the vocabulary to a multiple of its divisor x TP), and a value head may
    be split over TP (a row-parallel reward head)."""
    from mindrl.models.weight_map import full_to_local, hf_to_full

    mapping = param_mapping(spec, name)
    hf = [torch.empty(expected_hf_shape(spec, n), device="meta") for n in mapping.hf_names]
    want = tuple(full_to_local(mapping, hf_to_full(spec, mapping, hf), 0, tp).shape)
    if have == want:
        return True, str(want)
    if mapping.tp_split == "column" and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return have[1:] == want[1:] and have[0] > want[0], f"{want} (or more rows: a padded vocabulary)"
    if name == "output_layer.weight" and spec.is_value_model and tp > 1:
        return have == (1, spec.hidden_size // tp), f"{want} or {(1, spec.hidden_size // tp)}"
    return False, str(want)


# ------------------------------------------------------------------------------------------ model
def resolve_spec(root: str, hf_config: str | None = None) -> tuple[ModelSpec, str]:
    """(spec, where it came from). The architecture of a legacy checkpoint comes from, in order: `hf_config`
    (an HF model directory or its config.json), ROOT/hf_files/config.json, ROOT/config.json."""
    candidates = []
    if hf_config:
        candidates.append(hf_config if hf_config.endswith(".json") else os.path.join(hf_config, "config.json"))
        if not os.path.isfile(candidates[0]):
            raise CheckpointError(
                f"HF config {candidates[0]!r} (given for the legacy checkpoint {root!r}) does not exist"
            )
    candidates += [os.path.join(root, "hf_files", "config.json"), os.path.join(root, "config.json")]
    for path in candidates:
        if os.path.isfile(path):
            try:
                return ModelSpec.from_hf_dir(os.path.dirname(path) or "."), path
            except ModelConfigError as e:
                raise CheckpointError(f"the HF config for the legacy checkpoint {root!r}: {e}") from None
    raise CheckpointError(
        f"{root!r} is a legacy megatron checkpoint (mp_rank_* files), which does not record the model's "
        "architecture: give the HF model's config.json (mindrl-convert mcore2hf --hf-config HF_DIR), or copy it "
        f"into {os.path.join(root, 'hf_files')}/ (actor_config.load / critic_config.load)"
    )


def load_into(model: torch.nn.Module, ckpt: LegacyCheckpoint, spec: ModelSpec) -> None:
    """Fill this rank's stage of `model` (any TP / PP) from the legacy files. Call inside a rank."""
    from megatron.core import parallel_state as ps

    from mindrl.models.weight_map import full_to_local, global_name

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = ps.get_pipeline_model_parallel_rank() * (spec.num_layers // ps.get_pipeline_model_parallel_world_size())
    with torch.no_grad():
        for name, param in model.named_parameters():
            gname = global_name(name, offset)
            full = ckpt.full(spec, gname)
            local = full_to_local(param_mapping(spec, gname), full, tp_rank, tp)
            if tuple(local.shape) != tuple(param.shape):
                p = ckpt.index.get(gname, [(0, 0, gname)])[0][0]
                raise CheckpointError(
                    f"{ckpt.files[(0, p)]}: {gname} gathers to shape {tuple(full.shape)}, which does not fit the "
                    f"model the HF config describes (this rank's shard {tuple(param.shape)} at TP={tp})"
                )
            param.copy_(local)


def build_and_load(
    root: str,
    tp: int,
    pp: int,
    dtype: str | None = None,
    sequence_parallel: bool = False,
    hf_config: str | None = None,
    iteration: int | str | None = None,
    recompute: RecomputeSettings | None = None,
    cp: int = 1,
) -> tuple[ModelSpec, dict, torch.nn.Module]:
    """(spec, meta, model) like `loading.build_and_load`, from a legacy checkpoint at any saved TP / PP.
    Collective in name only (each rank reads the files it needs); call inside a rank."""
    from mindrl.launch import init_model_parallel
    from mindrl.models.builder import build_model

    init_model_parallel(tp, pp, cp=cp)
    spec, source = resolve_spec(root, hf_config)
    ckpt = LegacyCheckpoint.open(root, iteration)
    try:
        ckpt.check_against(spec, source)
        saved = str(ckpt.dtype()).replace("torch.", "")
        role = "critic" if spec.is_value_model else "actor"
        model = build_model(
            spec,
            role,
            dtype=dtype or saved,
            sequence_parallel=sequence_parallel,
            perform_initialization=False,
            recompute=recompute,
        )
        load_into(model, ckpt, spec)
    finally:
        ckpt.close()
    meta = {"format": "legacy", "role": role, "tp": ckpt.tp, "pp": ckpt.pp, "dtype": saved,
            "iteration": ckpt.iteration, "spec": spec.to_dict(), "spec_source": source}  # fmt: skip
    return spec, meta, model
