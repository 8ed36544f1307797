"""A MindSpeed-RL configs/ folder loads unchanged: its defaults-list forms, model files, key merging rule
(model file < megatron_training < role section) and the keys that mean nothing here."""

from __future__ import annotations

import pytest

from mindrl.config import ConfigError, load_config
from tests.config.conftest import write_configs

# MindSpeed-RL's model-file layout (one top-level key) with its extra megatron keys.
MODEL_7B = """
qwen25_7b:
  use_mcore_models: true
  num_layers: 28
  hidden_size: 3584
  ffn_hidden_size: 18944
  num_attention_heads: 28
  rotary_base: 1000000
  max_position_embeddings: 32768
  make_vocab_size_divisible_by: 1
  padded_vocab_size: 152064
  untie_embeddings_and_output_weights: true
  add_qkv_bias: true
  disable_bias_linear: true
  group_query_attention: true
  num_query_groups: 4
  position_embedding_type: rope
  norm_epsilon: 1e-6
  normalization: RMSNorm
  swiglu: true
  attention_softmax_in_fp32: true
"""

# Written in MindSpeed-RL's style: nested list defaults, fusion flags, TransferDock knobs, their verifier name.
GRPO = """
defaults:
  - model:
      - qwen25_7b

megatron_training:
  model: qwen25_7b
  use_fused_rmsnorm: true
  use_mcore_models: true
  sequence_parallel: true
  use_flash_attn: true
  no_masked_softmax_fusion: true
  attention_softmax_in_fp32: true
  no_gradient_accumulation_fusion: true
  use_fused_swiglu: true
  use_fused_rotary_pos_emb: true
  bf16: true
  use_distributed_optimizer: true
  tokenizer_type: PretrainedFromHF
  tokenizer_name_or_path: ./Qwen2.5-7B
  global_batch_size: 16
  seq_length: 1024
  save_interval: 50
  train_iters: 100
  stage: ray_grpo
  attention_dropout: 0.0
  init_method_std: 0.01
  hidden_dropout: 0.0
  distributed_backend: nccl
  no_shared_storage: true
  dataset_additional_keys: ['labels',]
  data_path: ./dataset/data
  split: 100,0,0
  no_shuffle: false
  full_shuffle_instruction_dataset: false
  seed: 7
  lr: 2e-6

actor_config:
  model: qwen25_7b
  micro_batch_size: 2
  tensor_model_parallel_size: 4
  pipeline_model_parallel_size: 1
  lr_decay_style: constant
  min_lr: 0
  weight_decay: 0.01
  lr_warmup_fraction: 0.0
  clip_grad: 1.0
  adam_beta1: 0.9
  adam_beta2: 0.95
  finetune: true
  load: ./ckpt
  save: ./ckpt
  no_load_optim: true
  no_load_rng: true

rl_config:
  guarantee_order: false
  use_integrated_worker: true
  blocking: true
  gamma: 1.0
  lam: 0.95
  actor_forward_micro_batch_size: 2
  ref_forward_micro_batch_size: 2
  adv_estimator: group_norm
  kl_penalty: low_var_kl
  kl_ctrl_type: fixed
  init_kl_coef: 0.001
  mini_batch_size: 8
  max_prompt_length: 1024
  epochs: 1
  clip_ratio: 0.2
  entropy_coeff: 0.0
  shuffle_mini_batch: false
  n_samples_per_prompt: 4
  rule_reward: true
  verifier_function: ["math_verify_reward", "format"]
  verifier_weight: [1.0, 0.5]
  log_max_throughput: false
  num_cpus_for_local_task: 1.0
  use_tensorboard: true
  actor_resource:
    num_npus: 8

generate_config:
  trust_remote_code: true
  offload_train_optimizer: true
  offload_train_grad: true
  offload_train_param: true
  infer_tensor_parallel_size: 2
  infer_pipeline_parallel_size: 1
  infer_expert_parallel_size: 1
  max_num_seqs: 256
  max_model_len: 3072
  max_num_batched_tokens: 8192
  dtype: "bfloat16"
  gpu_memory_utilization: 0.5
  num_scheduler_steps: 1
  sampling_config:
    logprobs: 1
    max_tokens: 2048
    top_p: 1.0
    top_k: -1
    min_p: 0.0
    temperature: 1.0
    detokenize: false
"""


@pytest.fixture
def ms_dir(tmp_path):
    return write_configs(tmp_path / "configs", {"model/qwen25_7b.yaml": MODEL_7B, "grpo_qwen25_7b_A3.yaml": GRPO})


def test_mindspeed_folder_loads_unchanged(ms_dir):
    cfg = load_config("grpo_qwen25_7b_A3", config_path=str(ms_dir))
    assert cfg.source == str(ms_dir / "grpo_qwen25_7b_A3.yaml")
    assert cfg.model.name == "qwen25_7b" and cfg.model.num_kv_heads == 4
    assert cfg.megatron_training.seed == 7 and cfg.megatron_training.dtype == "bfloat16"
    # lr written only in megatron_training reaches the actor (MindSpeed-RL merges it in)
    assert cfg.actor_config.lr == 2e-6
    assert cfg.actor_config.use_distributed_optimizer is True and cfg.actor_config.sequence_parallel is True
    assert cfg.rl_config.verifier_function == ["math_verify", "format"]
    assert cfg.rl_config.actor_dp == 2 and cfg.rl_config.num_mini_batches == 2 and not cfg.rl_config.on_policy
    for key in (
        "megatron_training.use_flash_attn",
        "megatron_training.init_method_std",
        "rl_config.blocking",
        "rl_config.guarantee_order",
        "rl_config.num_cpus_for_local_task",
        "generate_config.num_scheduler_steps",
        "generate_config.trust_remote_code",
        "model.qwen25_7b.use_mcore_models",
        "model.qwen25_7b.attention_softmax_in_fp32",
    ):
        assert key in cfg.ignored_keys, key


def test_flow_list_defaults_and_config_file_path(ms_dir):
    text = (ms_dir / "grpo_qwen25_7b_A3.yaml").read_text()
    flow = text.replace("defaults:\n  - model:\n      - qwen25_7b\n", "defaults: [model: qwen25_7b]\n")
    assert flow != text
    (ms_dir / "flow.yaml").write_text(flow)
    cfg = load_config(str(ms_dir / "flow.yaml"))  # a file path as the config name
    assert cfg.config_name == "flow" and cfg.model.hidden_size == 3584


def test_merge_precedence(ms_dir):
    cfg = load_config(
        "grpo_qwen25_7b_A3",
        config_path=str(ms_dir),
        overrides=[
            "actor_config.global_batch_size=32",  # a global key in the role section overrides megatron_training
            "megatron_training.max_position_embeddings=8192",  # an arch key overrides the model file
            "actor_config.lr=3e-6",
            "actor_config.sequence_parallel=false",
        ],
    )
    assert cfg.megatron_training.global_batch_size == 32
    assert cfg.model.max_position_embeddings == 8192
    assert cfg.actor_config.lr == 3e-6 and cfg.actor_config.sequence_parallel is False
    assert cfg.megatron_training.sequence_parallel is True


def test_model_named_outside_the_defaults_list_is_loaded(ms_dir):
    write_configs(ms_dir, {"model/other.yaml": MODEL_7B.replace("qwen25_7b:", "other:")})
    cfg = load_config("grpo_qwen25_7b_A3", config_path=str(ms_dir),
                      overrides=["actor_config.model=other"])  # fmt: skip
    assert cfg.model.name == "other" and cfg.megatron_training.model == "qwen25_7b"


def test_critic_may_not_disagree_on_global_keys(tmp_path):
    from mindrl.config import default_config_dir

    text = open(f"{default_config_dir()}/ppo_tiny_cpu.yaml").read()
    text = text.replace("critic_config:", "critic_config:\n  global_batch_size: 4\n  seq_length: 128", 1)
    root = write_configs(tmp_path, {"ppo.yaml": text, "model/tiny_qwen2.yaml": open(
        f"{default_config_dir()}/model/tiny_qwen2.yaml").read()})  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_config("ppo", config_path=str(root))
    assert len(e.value.issues) == 1  # seq_length agrees, global_batch_size does not
    assert "critic_config.global_batch_size" in str(e.value) and "megatron_training.global_batch_size=8" in str(e.value)


def test_grpo_with_a_critic_section_ignores_it(tmp_path):
    cfg = load_config("ppo_tiny_cpu",
                      overrides=["rl_config.adv_estimator=group_norm", "rl_config.use_kl_in_reward=false"])  # fmt: skip
    assert cfg.critic_config is None and cfg.critic_model is None and not cfg.rl_config.needs_critic
    assert "critic_config" in cfg.ignored_keys and "rl_config.critic_resource" in cfg.ignored_keys
    assert cfg.rl_config.critic_dp is None
