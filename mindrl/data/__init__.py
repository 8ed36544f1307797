"""Data for RL post-training: chat templates, row handlers, preprocessing into Megatron indexed datasets,
and the prompt dataset with its resumable sampler."""
