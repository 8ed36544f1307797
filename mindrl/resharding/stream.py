"""Train -> infer weight streaming: `(hf_name, tensor)` pairs in HF layout from a megatron model at any (TP, PP), on
every rank, in buckets of bounded size for the rollout engine's `load_weights` (see `WeightStreamer`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import socket
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mindrl.models.hf_config import ModelSpec
from mindrl.models.weight_map import global_name, mcore_param_names, named_weights, param_mapping, shards_to_hf
from mindrl.models.wrappers import unwrap
from mindrl.platform import current_platform, env_switch
from mindrl.platform.host import shm_prefix

DEFAULT_BUCKET_MB = 512
# The HF tensor dimension a megatron TP split cuts (gate/up and q/k/v shards are row chunks of each).
_SHARD_DIM = {"column": 0, "gated_column": 0, "row": 1, "replicated": None}


class ReshardError(RuntimeError):
    """The model cannot be streamed to a rollout engine (e.g. a critic), or the ranks disagree."""


@dataclass
class ReshardStats:
    """What one pass of the stream did on this rank."""

    seconds: float = 0.0  # first bucket's collectives to the last tensor consumed
    num_tensors: int = 0  # (hf_name, tensor) pairs emitted
    bytes_emitted: int = 0  # sum of emitted tensors' bytes (the model's HF bytes)
    num_buckets: int = 0
    bucket_bytes: int = 0  # the configured bucket size
    largest_param_bytes: int = 0  # largest full (TP=1) megatron parameter
    peak_extra_bytes: int = 0  # max bytes of live streamer-allocated buffers (see _LiveBytes)
    bucket_sizes: list[int] = field(default_factory=list)  # gathered bytes per bucket
    transport: str = "gloo"  # "shm": same-host CPU ranks read each other's slots in place; "none": TP1 x PP1
    layout: str = "buckets"  # "hf": the whole model in shared memory in HF layout, emitted as views (see the module)


@dataclass(frozen=True)
class _Param:
    name: str  # global megatron name
    stage: int  # pipeline stage that owns it
    local_shape: tuple[int, ...]  # this name's TP shard shape (the same on every TP rank)
    dtype: torch.dtype

    @property
    def local_numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n


class _LiveBytes:
    """Bytes of buffers the streamer allocated that are still alive (weakrefs: a consumer that keeps an
    emitted view keeps its bucket alive, and that counts too)."""

    def __init__(self) -> None:
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        self._live[key] = (weakref.ref(t, lambda _, k=key: self._live.pop(k, None)), t.nbytes)
        self.peak = max(self.peak, self.current())
        return t

    def current(self) -> int:
        return sum(n for ref, n in self._live.values() if ref() is not None)


_GLOBAL_EXPERT_RE = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def _layer_offset(model: torch.nn.Module) -> int:
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    return int(layers[0].layer_number) - 1 if layers is not None and len(layers) else 0


def _pp_group():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()


def _tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def local_params(model: torch.nn.Module, spec: ModelSpec) -> Mapping[str, torch.Tensor]:
    """This stage's parameters (and mapped buffers) by global megatron name, in HF order; the tied output copy is
    left out. A LoRA model's adapted linears give their merged weight W + scale * B A (what an engine without LoRA
    layers runs), computed when looked up: the merge buffer is one linear's shard at a time."""
    from megatron.core import parallel_state as ps

    model = unwrap(model)
    offset = _layer_offset(model)
    wanted = set(mcore_param_names(spec))
    # an EP rank's local experts 0..E/EP-1 are experts ep_rank x E/EP ... globally
    experts = spec.num_experts // ps.get_expert_model_parallel_world_size() if spec.is_moe else 0
    expert_offset = experts * ps.get_expert_model_parallel_rank() if experts else 0
    out = {}
    for name, p in named_weights(model):  # the router's expert bias too: a buffer the engine's router reads
        g = global_name(name, offset, expert_offset)
        if g in wanted:  # a tied output_layer.weight on the last stage is the embedding: not emitted
            out[g] = p
    from mindrl.models.lora import adapted_linears

    adapted = {global_name(n, offset): m for n, m in adapted_linears(model).items()}
    return _MergedParams(out, adapted) if adapted else out


class _MergedParams(Mapping):
    """local_params of a LoRA model: the base parameters, with each adapted linear's weight merged on lookup."""

    def __init__(self, params: dict[str, torch.Tensor], adapted: dict[str, torch.nn.Module]):
        self._params, self._adapted = params, adapted

    def __getitem__(self, name: str) -> torch.Tensor:
        from mindrl.models.lora import merged_weight

        module = self._adapted.get(name)
        return self._params[name] if module is None else merged_weight(module)

    def __iter__(self):
        return iter(self._params)

    @property
    def unmerged(self) -> dict[str, torch.Tensor]:
        """The parameters as they are (a merged weight has its base weight's shape and dtype): for looking at them
        without merging."""
        return self._params

    def __len__(self) -> int:
        return len(self._params)


class WeightStreamer:
    """Streams a megatron actor's weights in HF layout. Building it and every `stream()` are collective
    over all ranks of the model-parallel world (all ranks must call them, in the same order).

    Per bucket (the parameters of one pipeline stage, `bucket_size_mb` at most unless one parameter is larger):
      1. the owner stage packs its local TP shards into one flat buffer, the gathered buffer's own TP slot;
      2. broadcast of that slot over the pipeline group (train PP becomes inference DP: every stage needs it);
      3. all-gather over the tensor-parallel group, in place, into the gathered buffer (tp x slot);
      4. per parameter, `shards_to_hf` reassembles the HF tensors from the TP shards (QKV / gate-up un-fused in
         the same copy).
    The plan is global (one metadata exchange), so a rank whose stage owns nothing in a bucket still takes part.
    With the whole model-parallel group on one host, steps 2-3 go through shared memory (`ReshardStats.transport
    == "shm"`), and a model that fits in one bucket is held once per host in HF layout (`layout == "hf"`): every
    rank writes its shard into the HF tensors and emits views of them, valid until the next pass on any rank.
    Peak extra memory: `ReshardStats.peak_extra_bytes`; details in docs/resharding.md.

        streamer = WeightStreamer(model, spec, bucket_size_mb=256)
        engine.load_weights(streamer.stream())   # or streamer.load_into(engine.load_weights)
    """

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, bucket_size_mb: float = DEFAULT_BUCKET_MB):
        from megatron.core import parallel_state as ps

        role = getattr(unwrap(model), "mindrl_role", "critic" if spec.is_value_model else "actor")
        if spec.is_value_model or role == "critic":
            raise ReshardError(
                f"the critic / reward model ({spec.architecture}, role {role!r}) is not streamed to the rollout "
                "engine: only the actor's weights are resharded for inference"
            )
        if not 0 < bucket_size_mb < float("inf"):  # also NaN
            raise ValueError(f"bucket_size_mb must be > 0 and finite, got {bucket_size_mb}")
        self.model = model
        self.spec = spec
        self.bucket_bytes = int(bucket_size_mb * 1024 * 1024)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.ep = ps.get_expert_model_parallel_world_size() if spec.is_moe else 1
        self.device = current_platform().device()
        self.stats = ReshardStats(bucket_bytes=self.bucket_bytes)
        # un-fusing one rank's own QKV shard: its query groups only
        self._rank_spec = dataclasses.replace(
            spec, num_heads=spec.num_heads // self.tp, num_kv_heads=spec.num_kv_heads // self.tp
        )
        self._plan = self._make_plan()
        self._shm: dict[tuple[int, int], torch.Tensor] | None = None  # (pp_rank, tp_rank) -> mapped segment
        self._shm_slot = 0  # bytes of this rank's segment: the largest bucket's slot
        self._hf: dict[str, torch.Tensor] | None = None  # layout "hf": hf_name -> the HF tensor in shared memory
        self._hf_order: list[tuple[str, int | None]] = []  # layout "hf": (hf_name, TP split dim) in stream order
        self._hf_bytes = 0  # bytes of those tensors (the model, once per host)
        self._hf_writes: list[tuple[str, Any, int | None]] = []  # layout "hf": what this rank writes each pass
        self._setup_shm()
        self._transport = (
            "shm" if self._shm is not None or self._hf is not None else "none" if self.tp * self.pp == 1 else "gloo"
        )
        self._layout = "hf" if self._hf is not None else "buckets"
        self.stats.transport, self.stats.layout = self._transport, self._layout

    def _params(self) -> dict[str, torch.Tensor]:
        """This stage's parameters by global name; under expert parallelism with every expert of the stage, gathered
        from the EP group (collective over it), so that each rank streams the whole model as at EP1."""
        params = local_params(self.model, self.spec)
        if self.ep == 1:
            return params
        from megatron.core import parallel_state as ps

        per, group = self.spec.num_experts // self.ep, ps.get_expert_model_parallel_group()
        first = per * ps.get_expert_model_parallel_rank()
        out = {}
        for name, p in params.items():
            m = _GLOBAL_EXPERT_RE.match(name)
            if m is None:
                out[name] = p
                continue
            pieces = [torch.empty_like(p) for _ in range(self.ep)]
            torch.distributed.all_gather(pieces, p.detach().contiguous(), group=group)
            for r, piece in enumerate(pieces):
                out[f"{m.group(1)}{r * per + int(m.group(2)) - first}{m.group(3)}"] = piece
        return out

    # ----------------------------------------------------------------------------------- planning
    def _make_plan(self) -> list[list[_Param]]:
        """Buckets of parameters, identical on every rank: one metadata exchange over the PP group."""
        params = self._params()
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in getattr(params, "unmerged", params).items()]
        stages: list[Any] = [None] * self.pp
        if self.pp > 1:
            torch.distributed.all_gather_object(stages, mine, group=_pp_group())
        else:
            stages[0] = mine
        owner: dict[str, _Param] = {}
        for stage, entries in enumerate(stages):
            for name, shape, dtype in entries:
                if name in owner:
                    raise ReshardError(f"{name} is held by pipeline stages {owner[name].stage} and {stage}")
                owner[name] = _Param(name, stage, shape, getattr(torch, dtype.replace("torch.", "")))
        missing = [n for n in mcore_param_names(self.spec) if n not in owner]
        if missing:
            raise ReshardError(f"no pipeline stage holds {missing[:4]}: model and spec disagree")
        buckets: list[list[_Param]] = []
        size = 0
        for name in mcore_param_names(self.spec):  # HF order; a bucket never spans stages or dtypes
            p = owner[name]
            nbytes = p.local_numel * self.tp * p.dtype.itemsize
            self.stats.largest_param_bytes = max(self.stats.largest_param_bytes, nbytes)
            same = buckets and buckets[-1][-1].stage == p.stage and buckets[-1][-1].dtype == p.dtype
            if not same or size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        return buckets

    # ------------------------------------------------------------------------------ shared memory
    def _setup_shm(self) -> None:
        """Map every model-parallel peer's segment when all of them are CPU ranks on this host (collective
        over the model-parallel group). Segments are unlinked once mapped: nothing stays in /dev/shm, and
        the memory goes when the last rank drops its mapping. MINDRL_RESHARD_SHM=0 keeps gloo."""
        if self.tp * self.pp == 1 or not env_switch("MINDRL_RESHARD_SHM"):
            return
        if not current_platform().is_cpu:  # device tensors: the collectives are the fast path there
            return
        placed, stage_bytes = self._hf_placement()
        if sum(stage_bytes.values()) <= self.bucket_bytes:
            self._setup_hf_layout(placed, stage_bytes)
            return
        self._shm_slot = max(sum(p.local_numel * p.dtype.itemsize for p in b) for b in self._plan)
        with self._shared_files(self._shm_slot) as peers:
            if peers is not None and all(peers.values()):
                self._shm = {key: _map(f, self._shm_slot) for key, f in peers.items()}

    @contextlib.contextmanager
    def _shared_files(self, size: int | None) -> Iterator[dict[tuple[int, int], str] | None]:
        """Collective over the model-parallel group: this rank creates a /dev/shm file of `size` bytes (None: none),
        and gets every peer's path by (pp_rank, tp_rank) ("" for a peer that made none), or None when the ranks are
        not all on this host. The caller maps what it uses inside the block; on leaving it, a barrier (every peer
        has mapped the files) and the unlink: nothing stays in /dev/shm."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        path = _new_segment(size) if size is not None and os.path.isdir("/dev/shm") else ""
        try:
            me = (self.pp_rank, self.tp_rank, _host_id(), path)
            peers: list[Any] = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(peers, me, group=group)
            same_host = all(p[2] == me[2] for p in peers)
            yield {(pp, tp): f for pp, tp, _, f in peers} if same_host else None
            torch.distributed.barrier(group=group)
        finally:
            if path:
                os.unlink(path)

    def _hf_placement(
        self,
    ) -> tuple[list[tuple[int, str, tuple[int, ...], torch.dtype, int, int | None]], dict[int, int]]:
        """Layout "hf"'s plan, the same on every rank: each HF tensor in stream order as (stage, hf_name, full shape,
        dtype, byte offset in its stage's file, the dim TP splits or None), and each stage's file size. Offsets
        are 64-byte aligned."""
        placed, stage_bytes = [], {}
        for bucket in self._plan:
            for p in bucket:
                mapping = param_mapping(self.spec, p.name)
                meta = [torch.empty(p.local_shape, dtype=p.dtype, device="meta")] * self.tp
                dim = _split_dim(mapping, self.tp)
                for name, t in shards_to_hf(self.spec, mapping, meta):
                    at = stage_bytes.get(p.stage, 0)
                    placed.append((p.stage, name, tuple(t.shape), p.dtype, at, dim))
                    stage_bytes[p.stage] = at + -(-_nbytes(tuple(t.shape), p.dtype) // 64) * 64
        return placed, stage_bytes

    def _setup_hf_layout(self, placed, stage_bytes: dict[int, int]) -> None:
        """Layout "hf": one shared file per pipeline stage, created by its TP rank 0, holding that stage's HF
        tensors (`_hf_placement`); every rank of the model-parallel group maps every stage's file (`_shared_files`).
        Falls back to gloo buckets when the ranks are not all on this host or a file could not be made. Also plans
        this rank's writes: (megatron name, mapping, split dim) of each parameter its stage owns that it writes."""
        size = max(stage_bytes.get(self.pp_rank, 0), 1) if self.tp_rank == 0 else None
        with self._shared_files(size) as peers:
            files = {pp: f for (pp, tp), f in (peers or {}).items() if tp == 0}
            if peers is None or not all(files.get(s) for s in range(self.pp)):
                return
            stages = {s: _map(f, max(stage_bytes.get(s, 0), 1)) for s, f in files.items()}
        self._hf = {
            name: stages[s][at : at + _nbytes(shape, dtype)].view(dtype).view(shape)
            for s, name, shape, dtype, at, _ in placed
        }
        self._hf_order = [(name, dim) for _, name, _, _, _, dim in placed]
        self._hf_bytes = sum(stage_bytes.values())
        for bucket in self._plan:
            for p in bucket:
                mapping = param_mapping(self.spec, p.name)
                dim = _split_dim(mapping, self.tp)
                if p.stage == self.pp_rank and (dim is not None or self.tp_rank == 0):  # TP rank 0: replicated ones
                    self._hf_writes.append((p.name, mapping, dim))

    def _hf_pass(self, gather_tp: bool) -> Iterator[tuple[str, torch.Tensor, int | None]]:
        """Layout "hf": a barrier (every rank is done with the last pass's views), this rank writes its shards into
        the HF tensors, a second barrier, then views of the tensors (gather_tp=False: of this rank's chunk of each)."""
        from megatron.core import parallel_state as ps

        assert self._hf is not None
        group = ps.get_model_parallel_group()
        torch.distributed.barrier(group=group)
        params = self._params()
        with torch.no_grad():
            for name, mapping, dim in self._hf_writes:
                for hf_name, piece in shards_to_hf(self._rank_spec, mapping, [params[name].detach()]):
                    full = self._hf[hf_name]
                    (full if dim is None else full.chunk(self.tp, dim)[self.tp_rank]).copy_(piece)
        torch.distributed.barrier(group=group)
        for hf_name, dim in self._hf_order:
            full = self._hf[hf_name]
            if gather_tp or dim is None:
                yield hf_name, full, None
            else:
                yield hf_name, full.chunk(self.tp, dim)[self.tp_rank], dim

    def _shm_bucket(self, bucket: list[_Param], params: dict[str, torch.Tensor], gather_tp: bool) -> list[torch.Tensor]:
        """The owner stage's TP slots of this bucket, read in place from shared memory: one flat view per
        TP rank (gather_tp=False: this rank's only). One buffer, two barriers: the first waits until every
        peer has read the previous bucket (this stream's or the last one's), the second until the owner
        stage has written this one."""
        from megatron.core import parallel_state as ps

        assert self._shm is not None
        group = ps.get_model_parallel_group()
        numel = sum(p.local_numel for p in bucket)
        dtype = bucket[0].dtype

        def slot(pp: int, tp: int) -> torch.Tensor:
            return self._shm[(pp, tp)][: numel * dtype.itemsize].view(dtype)

        owner = bucket[0].stage
        torch.distributed.barrier(group=group)
        if self.pp_rank == owner:
            mine, offset = slot(owner, self.tp_rank), 0
            with torch.no_grad():
                for p in bucket:
                    mine[offset : offset + p.local_numel].copy_(params[p.name].detach().reshape(-1))
                    offset += p.local_numel
        torch.distributed.barrier(group=group)
        return [slot(owner, r) for r in (range(self.tp) if gather_tp else [self.tp_rank])]

    # ---------------------------------------------------------------------------------- streaming
    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, tensor) for the whole model, in HF file order. Collective: every rank must
        exhaust it (see `load_into`). Emitted tensors are views into the current bucket (valid until the
        consumer drops them; copy them to keep them past the next item); at TP1 x PP1 they are views of
        the parameters themselves (copy them before the params are offloaded or updated); in layout "hf"
        (`ReshardStats.layout`) views of the model's HF tensors in shared memory, valid until the next pass."""
        for hf_name, tensor, _ in self._stream(gather_tp=True):
            yield hf_name, tensor

    def stream_shards(self) -> Iterator[tuple[str, torch.Tensor, int | None]]:
        """For an inference engine at the same TP as training (infer rank = train TP rank): yield
        (hf_name, shard, dim) where shard == the HF tensor's `chunk(tp, dim)[tp_rank]` (dim None: the
        whole, replicated tensor), without any TP communication (PP broadcast only). Needs an engine
        that loads pre-sharded weights. Collective over the pipeline group; exhaust it on every rank."""
        return self._stream(gather_tp=False)

    def _stream(self, gather_tp: bool) -> Iterator[tuple[str, torch.Tensor, int | None]]:
        stats = ReshardStats(
            bucket_bytes=self.bucket_bytes,
            largest_param_bytes=self.stats.largest_param_bytes,
            transport=self._transport,
            layout=self._layout,
        )
        live = _LiveBytes()
        t0 = time.perf_counter()
        if self._hf is not None:
            stats.num_buckets, stats.bucket_sizes = 1, [self._hf_bytes]
            for name, tensor, dim in self._hf_pass(gather_tp):
                stats.num_tensors += 1
                stats.bytes_emitted += tensor.nbytes
                yield name, tensor, dim
            stats.seconds = time.perf_counter() - t0
            stats.peak_extra_bytes = self._hf_bytes  # the host's one copy, mapped by every rank
            self.stats = stats
            return
        params = self._params()
        rows = self.tp if gather_tp else 1
        spec = self.spec if gather_tp else self._rank_spec
        direct = self.tp * self.pp == 1  # nothing to exchange: emit views of the parameters themselves
        for bucket in self._plan:
            if direct:
                shards_of, gathered = [], None
            elif self._shm is not None:
                shards_of = self._shm_bucket(bucket, params, gather_tp)
                gathered = None
            else:
                gathered = self._gather_bucket(bucket, params, live, gather_tp)
                shards_of = list(gathered.view(rows, gathered.numel() // rows).unbind(0))
            stats.num_buckets += 1
            stats.bucket_sizes.append(sum(t.nbytes for t in shards_of))
            offset = 0
            for i, p in enumerate(bucket):
                n = p.local_numel
                if direct:  # the parameter itself: a consumer that keeps it past offload must copy it
                    shards = [params[p.name].detach()]
                else:
                    shards = [shards_of[r][offset : offset + n].view(p.local_shape) for r in range(rows)]
                offset += n
                mapping = param_mapping(self.spec, p.name)
                dim = None if gather_tp else _split_dim(mapping, self.tp)
                last = i == len(bucket) - 1 and len(bucket) > 1
                # gather_tp=False: this rank's shard itself. Each HF tensor is written at most once.
                for hf_name, tensor in shards_to_hf(spec, mapping, shards):
                    if not direct:  # direct: the parameter itself, no streamer buffer to pin or count
                        in_bucket = tensor.untyped_storage().data_ptr() == shards[0].untyped_storage().data_ptr()
                        if in_bucket and (gathered is None or last):
                            # Shared memory is rewritten by the next bucket: an emitted view of it must be a
                            # copy. A consumer's for-loop holds the last item while it asks for the next one:
                            # make that item a copy, so it does not pin this whole bucket while the next is
                            # gathered.
                            tensor = tensor.clone()
                            in_bucket = False
                        if not in_bucket:  # a reassembled copy
                            live.track(tensor)
                    stats.num_tensors += 1
                    stats.bytes_emitted += tensor.nbytes
                    yield hf_name, tensor, dim
                    del tensor
                del shards
            del gathered, shards_of
        stats.seconds = time.perf_counter() - t0
        stats.peak_extra_bytes = live.peak + (self._shm_slot if self._shm is not None else 0)  # own segment
        self.stats = stats

    def _gather_bucket(
        self, bucket: list[_Param], params: dict[str, torch.Tensor], live: _LiveBytes, gather_tp: bool = True
    ) -> torch.Tensor:
        """The bucket's TP shards of every rank, concatenated rank-major: [tp, sum(local numel)]
        (gather_tp=False: this rank's shards only, [1, sum(local numel)])."""
        slot = sum(p.local_numel for p in bucket)
        rows = self.tp if gather_tp else 1
        gathered = live.track(torch.empty(rows * slot, dtype=bucket[0].dtype, device=self.device))
        chunks = list(gathered.view(rows, slot).unbind(0))
        mine = chunks[self.tp_rank if gather_tp else 0]
        owner = bucket[0].stage
        if self.pp_rank == owner:
            offset = 0
            with torch.no_grad():
                for p in bucket:
                    mine[offset : offset + p.local_numel].copy_(params[p.name].detach().reshape(-1))
                    offset += p.local_numel
        if self.pp > 1:
            group = _pp_group()
            src = torch.distributed.get_global_rank(group, owner)
            torch.distributed.broadcast(mine, src=src, group=group)
        if gather_tp and self.tp > 1:
            torch.distributed.all_gather(chunks, mine, group=_tp_group())
        return gathered

    def load_into(self, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> ReshardStats:
        """Feed the stream to `load_weights` (e.g. a rollout engine's), then drain whatever it left
        unconsumed so that this rank's collectives stay matched with its peers'."""
        it = self.stream()
        load_weights(it)
        for _ in it:
            pass
        return self.stats


def _new_segment(size: int) -> str:
    """A new /dev/shm file of `size` bytes with its pages reserved, or "" when /dev/shm cannot hold it: the
    stream then falls back to gloo (a warning says so). A file only truncated to its size would fail later, with a
    SIGBUS at the first write past what /dev/shm can hold (e.g. a container's 64 MiB)."""
    path = f"/dev/shm/{shm_prefix()}_reshard_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        with open(path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
        return path
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(path)
        warnings.warn(
            f"weight resharding: /dev/shm cannot hold {size / 2**20:.1f} MiB ({e.strerror or e}); the ranks exchange "
            "the weights through gloo instead (slower). Give /dev/shm more room, e.g. docker run --shm-size.",
            stacklevel=3,
        )
        return ""


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _split_dim(mapping, tp: int) -> int | None:
    """The HF tensor dim a TP split of this parameter cuts; None when it is replicated or TP is 1."""
    return None if tp == 1 else _SHARD_DIM[mapping.tp_split]


def _map(path: str, size: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _host_id() -> str:
    """This machine (same boot): ranks with equal ids can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return socket.gethostname() + ":" + f.read().strip()
    except OSError:
        return socket.gethostname()


def stream_weights(
    model: torch.nn.Module, spec: ModelSpec, bucket_size_mb: float = DEFAULT_BUCKET_MB
) -> Iterator[tuple[str, torch.Tensor]]:
    """One pass of `WeightStreamer(model, spec, bucket_size_mb).stream()` (collective)."""
    return WeightStreamer(model, spec, bucket_size_mb).stream()
