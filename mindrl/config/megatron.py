"""`megatron_training`, `actor_config` and `critic_config`: MindSpeed-RL's one megatron keyspace (any key in any of the
three, the role section winning), split into global, per-role and architecture keys, plus the ones ignored here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mindrl.config.errors import Collector
from mindrl.config.section import Section, ignored_field
from mindrl.config.settings import LR_DECAY_STYLES, LoRASettings, OptimSettings, RecomputeSettings

DATASET_SUFFIX = "_packed_input_ids_document"
TOKENIZER_TYPES = (None, "PretrainedFromHF", "HuggingFaceTokenizer")
STAGES = (None, "ray_ppo", "ray_grpo", "ray_dapo")
CP_ALGORITHMS = ("megatron_cp_algo",)
"""context_parallel_algo values mindrl runs (`mindrl.models.context_parallel`)."""

_FUSION = "a kernel fusion / performance switch; mindrl chooses kernels per platform"
_MEMORY = (
    "a memory or overlap optimisation that leaves the math unchanged; not implemented by mindrl (mindrl-plan "
    "sizes the run without it)"
)
_DATA = "a dataset-building option of MindSpeed-LLM; mindrl reads the packed prompts as mindrl-preprocess wrote them"
_DPO = "a DPO option; not used by PPO/GRPO"
_LOG = "a logging option of megatron's own training loop, which mindrl's trainer replaces (it logs every iteration)"
_UNREAD = "carried by MindSpeed-RL's config class but read by none of its RL trainers"

MEGATRON_IGNORED: dict[str, str] = {
    **dict.fromkeys(
        [
            "use_flash_attn",
            "use_fused_rmsnorm",
            "use_fused_swiglu",
            "use_fused_rotary_pos_emb",
            "no_masked_softmax_fusion",
            "no_bias_dropout_fusion",
            "no_gradient_accumulation_fusion",
            "gemm_gradient_accumulation_fusion",
            "shape_order",
            "use_fused_ring_attention_update",
            "use_cp_send_recv_overlap",
            "use_ascend_coc",
            "coc_mode",
            "coc_parallel_num",
            "coc_fused_kernel",
        ],
        _FUSION,
    ),
    "transformer_impl": "which kernels megatron's layers use (local / Transformer Engine); mindrl builds megatron's "
    "local spec and the platform picks the kernels",
    "spec": "a MindSpeed-LLM layer-spec module; mindrl builds the layers from the model keys (qk_layernorm, add_qkv_bias, "
    "...), which are checked against the checkpoint",
    "distributed_backend": "the platform picks the torch.distributed backend (hccl / nccl / gloo)",
    **dict.fromkeys(
        [
            "swap_attention",
            "reuse_fp32_param",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "ddp_bucket_size",
        ],
        _MEMORY,
    ),
    **dict.fromkeys(["no_shared_storage", "is_instruction_dataset", "num_workers"], _DATA),
    **dict.fromkeys(
        ["no_pad_to_seq_lengths", "pad_to_multiple_of"],
        "how far rows are padded; padding is masked out of every result, and mindrl pads each batch to its own "
        "longest row",
    ),
    **dict.fromkeys(
        ["reset_position_ids", "reset_attention_mask"],
        "what packing needs (positions and attention restarting at each packed row); mindrl's use_remove_padding "
        "does both by itself",
    ),
    "attention_mask_type": "how the causal mask reaches the NPU's fused attention kernel; mindrl's attention is causal "
    "within each row",
    "tokenizer_not_use_fast": "the slow and fast Hugging Face tokenizers of a model give the same ids; mindrl loads the "
    "fast one",
    "tokenizer_padding_side": "mindrl pads prompts and responses itself (prompts on the left for the rollout)",
    **dict.fromkeys(
        ["prompt_type", "prompt_type_path"],
        "the chat template, applied when the prompts are preprocessed (mindrl-preprocess's prompt_type); MindSpeed-RL's "
        "RL trainers do not apply it again either",
    ),
    "dataloader_type": "read by MindSpeed-RL's SFT/DPO loops only; its RL trainers iterate their prompt loader, as "
    "mindrl does",
    **dict.fromkeys(["log_interval", "log_throughput"], _LOG),
    "enable_high_availability": "Ascend MindIO's in-memory checkpoint recovery; mindrl recovers by resuming from its "
    "last checkpoint",
    "load_checkpoint_loosely": "mindrl always loads strictly: a checkpoint that lacks a weight of the model fails the "
    "load instead of leaving it random",
    "use_tp_pp_dp_mapping": "the rank order of megatron's process groups (where each group's ranks sit); the results are "
    "the same",
    "no_check_for_nan_in_loss_and_grad": "mindrl always checks: a non-finite gradient skips the update, and "
    "rl_config.max_consecutive_skipped_updates of them in a row abort the run",
    **dict.fromkeys(["do_sample", "use_kv_cache", "algorithm"], _UNREAD),
    "seq_aux": "MindSpeed-LLM's switch between two forms of DeepSeek's sequence-wise balance loss; mindrl passes "
    "moe_router_load_balancing_type (seq_aux_loss) to megatron, which computes it per sequence either way",
    **dict.fromkeys(
        ["moe_grouped_gemm", "moe_permutation_async_comm", "use_fused_moe_token_permute_and_unpermute"],
        "a MoE kernel switch (grouped expert GEMM, fused or asynchronous token permutation); the same experts and "
        "routing, mindrl runs megatron's per-expert linears (docs/moe.md)",
    ),
    "moe_alltoall_overlap_comm": "overlaps MindSpeed's expert all-to-all with computation; the results are the same, "
    "and mindrl's all-to-all runs unoverlapped",
    "moe_token_dispatcher_type": "how tokens reach their experts (MindSpeed's alltoall_seq, megatron's alltoall); "
    "every dispatcher routes the same tokens to the same experts, and mindrl always uses megatron's alltoall",
    "moe_tp_extend_ep": "MindSpeed's layout of each expert whole on one TP rank, the TP ranks acting as more expert-"
    "parallel ranks, instead of each expert split over TP: the same experts, routing and per-device expert bytes; "
    "mindrl splits every expert over TP (megatron's expert_tensor_parallel_size = TP)",
    "eval_iters": "megatron's batches per evaluation; mindrl's held-out evaluation takes rl_config.val_max_prompts",
    **dict.fromkeys(["dpo_loss_type", "ref_model", "refer_model_iter"], _DPO),
}

MEGATRON_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "attention_bias": ((False,), "biases on every attention projection"),
    "vocab_extra_ids": ((0,), "extra vocabulary ids"),
    "mm_model": ((None,), "multimodal models"),
    "ai_framework": ((None,), "the MindSpore backend"),
    "optimizer": (("adam",), "optimizers other than Adam(W)"),
    "pretrained_checkpoint": ((None,), "a separate pretrained checkpoint; put the start checkpoint in load"),
    "is_pairwise_dataset": ((False,), "pairwise (DPO) datasets"),
    "skip_train": ((False,), "evaluation-only runs"),
    "use_mcore_models": ((True,), "megatron's legacy (non-core) models"),
    "attention_softmax_in_fp32": ((True,), "the attention softmax in 16 bits (mindrl computes it in fp32)"),
    "accumulate_allreduce_grads_in_fp32": (
        (True,),
        "gradient accumulation and all-reduce in 16 bits (mindrl keeps gradients in fp32)",
    ),
    "full_shuffle_instruction_dataset": (
        (False,),
        "a shuffle of the whole dataset across epochs (mindrl shuffles each epoch by the seed, or not at all with "
        "no_shuffle)",
    ),
}


@dataclass
class MegatronTrainingConfig(Section, RecomputeSettings):
    """Global training settings shared by every role: data, batch, iterations, precision, seed.

    A key written in actor_config overrides the one here (MindSpeed-RL's merge); critic_config may not
    disagree with the actor on these, since the critic trains on the actor's batches. The recompute_* keys
    (`RecomputeSettings`) and sequence_parallel / use_distributed_optimizer are each role's default instead:
    actor_config and critic_config may set their own.
    """

    SECTION: ClassVar[str] = "megatron_training"

    model: str | None = None
    """Name of the model (configs/model/NAME.yaml) every role uses unless its section names another."""
    stage: str | None = None
    """MindSpeed-RL's algorithm label ('ray_ppo' / 'ray_grpo' / 'ray_dapo'). The algorithm follows rl_config's keys;
    ray_dapo also turns every KL term off, as MindSpeed-RL's DAPO loss and trainer have none (docs/algorithms.md)."""
    global_batch_size: int | None = None
    """Prompts per iteration (required); each is sampled n_samples_per_prompt times."""
    seq_length: int | None = None
    """MindSpeed-RL's sequence length; the only rule it carries is generate_config.max_model_len >= seq_length.
    Training batches are padded to their own longest prompt + response."""
    train_iters: int | None = None
    """Iterations (rollout + update) to run (required)."""
    save_interval: int | None = None
    """Checkpoint every this many iterations (and at the end); None or 0: only at the end."""
    save_total_limit: int | None = None
    """mindrl addition: keep only the newest this many saved iterations per save dir (None: keep all)."""
    eval_interval: int | None = None
    """Evaluate the policy on rl_config.val_data_path every this many iterations (besides before training and at the
    end); None or 0: only then. Without val_data_path it has no effect (MindSpeed-RL's RL trainers never read it)."""
    seed: int = 1234
    """Seed of the data order, rollout sampling and model initialisation."""
    data_path: str | None = None
    """Prompt dataset prefix written by mindrl-preprocess (its output_prefix, or the ..._packed_input_ids_document
    prefix); required."""
    split: str | None = None
    """MindSpeed-RL's train,valid,test split; mindrl trains on the whole dataset, so only '100,0,0'-like splits
    (no validation/test share) are accepted."""
    tokenizer_name_or_path: str | None = None
    """Directory of the HF tokenizer (the HF checkpoint directory); required."""
    tokenizer_type: str | None = "PretrainedFromHF"
    """Only Hugging Face tokenizers ('PretrainedFromHF' / 'HuggingFaceTokenizer')."""
    dataset_additional_keys: list[str] = field(default_factory=lambda: ["labels"])
    """Packed documents read besides the prompts: 'labels' (the reference answers the verifiers need)."""
    no_shuffle: bool = False
    """Iterate the prompts in dataset order instead of a seeded shuffle per epoch."""
    bf16: bool = True
    """Train in bfloat16 (MindSpeed-RL's default). Set false (and fp16 false) for fp32, e.g. on CPU."""
    fp16: bool = False
    """Train in float16 with loss scaling (mindrl addition; MindSpeed-RL trains in bf16)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (a role section may override)."""
    swap_optimizer: bool = False
    """Keep the actor's optimizer state (Adam moments, fp32 main params) in host memory except during its optimizer
    steps, as MindSpeed's swap_optimizer does: off the device in every phase and through the update's forward and
    backward, on it only around each step (`mindrl.resharding.residency`, docs/plan.md). The RL trainers' actor only;
    the critic keeps its optimizer state on the device while it trains."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism within TP groups (a role section may override)."""
    variable_seq_lengths: bool = ignored_field(
        False, "mindrl always sends each micro-batch's own shape between pipeline stages"
    )
    """Accepted for compatibility; mindrl always handles variable sequence lengths."""
    attention_dropout: float = 0.0
    """Must be 0: rollout logprobs must match the training forward (MindSpeed-RL's configs all set 0)."""
    hidden_dropout: float = 0.0
    """Must be 0, as attention_dropout."""
    init_method_std: float = ignored_field(0.02, "weights always come from a checkpoint (load)")
    """Accepted for compatibility; weights always come from a checkpoint."""
    npu_deterministic: bool = False
    """Deterministic computation (MindSpeed-RL's name, on every platform): every worker process starts with the
    platform's deterministic switches (HCCL_DETERMINISTIC on Ascend; CUBLAS_WORKSPACE_CONFIG and NCCL's ring algorithm
    on CUDA; fixed OpenMP threads on CPU) and turns on torch's deterministic algorithms before its first kernel. With
    the seeded data order and rollout, two runs of one config then give the same metrics and checkpoints bit for bit
    (docs/config.md, Determinism)."""

    def validate(self, col: Collector) -> None:
        for key in ("global_batch_size", "train_iters"):
            v = getattr(self, key)
            if v is None:
                col.add(key, "is required")
            elif v < 1:
                col.add(key, f"must be >= 1, got {v}")
        for key in ("data_path", "tokenizer_name_or_path"):
            if not getattr(self, key):
                col.add(key, "is required (a path)")
        if self.seq_length is not None and self.seq_length < 1:
            col.add("seq_length", f"must be >= 1, got {self.seq_length}")
        if self.save_interval is not None and self.save_interval < 0:
            col.add("save_interval", f"must be >= 0 (0 or null: save at the end only), got {self.save_interval}")
        if self.eval_interval is not None and self.eval_interval < 0:
            col.add("eval_interval", f"must be >= 0 (0 or null: evaluate before training and at the end only), got "
                    f"{self.eval_interval}")  # fmt: skip
        if self.save_total_limit is not None and self.save_total_limit < 1:
            col.add("save_total_limit", f"must be >= 1 (or null: keep every iteration), got {self.save_total_limit}")
        if self.tokenizer_type not in TOKENIZER_TYPES:
            col.add("tokenizer_type", f"{self.tokenizer_type!r} is not supported; use PretrainedFromHF")
        if self.stage not in STAGES:
            col.add("stage", f"{self.stage!r} is not one of {', '.join(map(str, STAGES[1:]))} (or unset)")
        if self.bf16 and self.fp16:
            col.add("fp16", "bf16 and fp16 are both true; choose one (both false: fp32)")
        for key in ("attention_dropout", "hidden_dropout"):
            if getattr(self, key) != 0.0:
                col.add(key, f"must be 0.0 (RL needs a deterministic forward), got {getattr(self, key)}")
        if self.split is not None:
            shares = [s for s in re.split(r"[,/]", str(self.split)) if s.strip()]
            try:
                nums = [float(s) for s in shares]
            except ValueError:
                col.add("split", f"expected comma-separated numbers like '100,0,0', got {self.split!r}")
            else:
                if not nums or nums[0] <= 0 or any(n < 0 for n in nums) or any(n > 0 for n in nums[1:]):
                    col.add("split", f"{self.split!r}: mindrl trains on the whole dataset; use '100,0,0'")

    @property
    def dtype(self) -> str:
        """'bfloat16', 'float16' or 'float32' (bf16 / fp16 / neither)."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


@dataclass
class RoleConfig(Section, OptimSettings, RecomputeSettings, LoRASettings):
    """One trained model's settings (actor_config or critic_config): layout, micro-batch, optimizer, LR
    schedule (the keys of `OptimSettings`, with MindSpeed-RL's defaults), activation recomputation (the keys of
    `RecomputeSettings`), LoRA adapters (`LoRASettings`) and checkpoints. Unset keys come from megatron_training, then
    from the defaults."""

    SECTION: ClassVar[str] = "actor_config"

    model: str | None = None
    """Model name (configs/model/NAME.yaml); None: megatron_training.model."""
    tensor_model_parallel_size: int = 1
    """Training tensor parallelism (TP)."""
    pipeline_model_parallel_size: int = 1
    """Training pipeline parallelism (PP)."""
    context_parallel_size: int = 1
    """Training context parallelism (CP): each row's columns split over CP ranks in 2 x CP load-balanced chunks, the
    attention exact over the whole row (docs/parallelism.md); the world is TP x PP x CP x DP."""
    context_parallel_algo: str = "megatron_cp_algo"
    """How attention spans the CP ranks; only megatron_cp_algo (MindSpeed-RL's ring attention: exact causal
    attention, here over K/V all-gathered from the CP group)."""
    micro_batch_size: int = 1
    """Responses per micro-batch in the update (gradient accumulation over micro-batches)."""
    lr: float | None = None
    """Peak learning rate (required)."""
    lr_decay_style: str = "linear"
    """constant | linear | cosine | inverse-square-root | WSD (MindSpeed-RL's default: linear)."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the run's optimizer steps (exclusive with lr_warmup_iters)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    initial_loss_scale: float = 2.0**32
    """Initial dynamic loss scale (fp16 only)."""
    load: str | None = None
    """Megatron checkpoint to start from (required; a directory with latest_checkpointed_iteration.txt)."""
    save: str | None = None
    """Where checkpoints are written; None: not saved."""
    finetune: bool = False
    """Load only the weights: start at iteration 0 with a fresh optimizer and RNG."""
    no_load_optim: bool = False
    """Do not load the optimizer state from `load`."""
    no_load_rng: bool = False
    """Do not load the RNG state from `load`."""
    no_save_optim: bool = False
    """Do not save the optimizer state."""
    no_save_rng: bool = False
    """Do not save the RNG state."""
    use_distributed_optimizer: bool | None = None
    """None: megatron_training.use_distributed_optimizer (resolved at load)."""
    sequence_parallel: bool | None = None
    """None: megatron_training.sequence_parallel (resolved at load)."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Megatron's interleaved pipeline schedule (VPP), which mindrl does not run: accepted only as one chunk per stage,
    num_layers / PP (or unset)."""
    expert_model_parallel_size: int = 1
    """Expert parallelism (EP) of a MoE model: each EP rank holds num_experts / EP experts of every MoE layer, and
    tokens reach theirs by an all-to-all. EP ranks are carved out of the data-parallel ranks (megatron's layout):
    EP must divide DP x CP, and num_experts."""
    num_layer_list: str | list[int] | None = None
    """MindSpeed-RL's layers per pipeline stage ("16,17,16,15"); its entries must be PP numbers >= 1 summing to
    num_layers. Each stage builds and trains that many layers (megatron's pipeline layout), and mindrl-plan sizes
    each stage's own; needed where PP does not divide num_layers (DeepSeek-V3's 61 layers over PP=8). None: num_layers
    / PP each."""

    def stage_layer_counts(self, num_layers: int) -> list[int] | None:
        """num_layer_list as PP layer counts when it is a valid split of num_layers, else None."""
        given = self.num_layer_list
        if given is None:
            return None
        try:
            counts = [int(x) for x in given.split(",")] if isinstance(given, str) else [int(x) for x in given]
        except (TypeError, ValueError):
            return None
        ok = len(counts) == self.pipeline_model_parallel_size and sum(counts) == num_layers and min(counts) >= 1
        return counts if ok else None

    def validate(self, col: Collector) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                    "context_parallel_size", "expert_model_parallel_size"):  # fmt: skip
            if getattr(self, key) < 1:
                col.add(key, f"must be >= 1, got {getattr(self, key)}")
        if self.context_parallel_algo not in CP_ALGORITHMS:
            col.add("context_parallel_algo", f"{self.context_parallel_algo!r} is not supported; use "
                    f"{' or '.join(CP_ALGORITHMS)} (ulysses and hybrid CP are not implemented)")  # fmt: skip
        if self.lr is None:
            col.add("lr", "is required")
        elif self.lr <= 0:
            col.add("lr", f"must be > 0, got {self.lr}")
        elif not 0.0 <= self.min_lr <= self.lr:
            col.add("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            col.add("lr_decay_style", f"{self.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction <= 1.0:
            col.add("lr_warmup_fraction", f"must be in [0, 1], got {self.lr_warmup_fraction}")
        if self.lr_warmup_iters < 0:
            col.add("lr_warmup_iters", f"must be >= 0, got {self.lr_warmup_iters}")
        elif self.lr_warmup_iters > 0 and self.lr_warmup_fraction:
            col.add("lr_warmup_iters", "lr_warmup_iters and lr_warmup_fraction are both set; choose one")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            col.add("lr_decay_iters", f"must be >= 1 (or null: the whole run), got {self.lr_decay_iters}")
        for key in ("weight_decay", "clip_grad"):
            if getattr(self, key) < 0:
                col.add(key, f"must be >= 0, got {getattr(self, key)}")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                col.add(key, f"must be in [0, 1), got {getattr(self, key)}")
        if self.adam_eps <= 0:
            col.add("adam_eps", f"must be > 0, got {self.adam_eps}")
        if self.initial_loss_scale <= 0:
            col.add("initial_loss_scale", f"must be > 0, got {self.initial_loss_scale}")
        if not self.load:
            col.add("load", "is required (the megatron checkpoint to start from)")
        for key, message in self.recompute_problems():  # the rules on layers per stage: RLConfig._check_role
            col.add(key, message)
        for key, message in self.lora_problems():
            col.add(key, message)
        if self.lora_fusion:
            col.ignore("lora_fusion", "MindSpeed's CCLoRA overlap; the math is the same and mindrl runs it unfused")
        if not self.lora:
            for key, default in (("lora_r", 8), ("lora_alpha", 16.0), ("lora_ckpt_filter", False)):
                if getattr(self, key) != default:
                    col.ignore(key, "has no effect without lora_target_modules")
        if self.recompute_granularity is None:
            for key in ("recompute_method", "recompute_num_layers"):
                if getattr(self, key) is not None:
                    col.ignore(key, "has no effect without recompute_granularity")

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size


def megatron_key_kind(key: str) -> str:
    """Where a key of the megatron keyspace belongs: 'global', 'role', 'shared' (both: megatron_training's value
    is the default of each role's, e.g. model, sequence_parallel), 'arch', 'ignored', 'unsupported' or 'unknown'."""
    from mindrl.config.model import ModelArchConfig

    in_role, in_global = key in RoleConfig.field_names(), key in MegatronTrainingConfig.field_names()
    if in_role and in_global:
        return "shared"
    if in_role:
        return "role"
    if in_global:
        return "global"
    if key in ModelArchConfig.field_names() and key != "name":
        return "arch"
    if key in MEGATRON_IGNORED:
        return "ignored"
    if key in MEGATRON_UNSUPPORTED:
        return "unsupported"
    return "unknown"


def megatron_keys() -> set[str]:
    """Every key megatron_training / actor_config / critic_config / a model file accepts."""
    from mindrl.config.model import ModelArchConfig

    return (
        set(RoleConfig.field_names())
        | set(MegatronTrainingConfig.field_names())
        | (set(ModelArchConfig.field_names()) - {"name"})
        | set(MEGATRON_IGNORED)
        | set(MEGATRON_UNSUPPORTED)
    )


def dataset_output_prefix(data_path: str) -> str:
    """megatron_training.data_path as mindrl-preprocess's output_prefix (it may name the input_ids dataset)."""
    return data_path[: -len(DATASET_SUFFIX)] if data_path.endswith(DATASET_SUFFIX) else data_path
