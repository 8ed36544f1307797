"""The agent loop's parts that are neither Ray nor megatron: the tool-call parser (hermes), the tool interface and
the tools, and the tool YAML (MindSpeed-RL's `tool_config_path`). The loop itself is an episode of the experience
pipeline (`mindrl.trainer.pipeline.agent_loop`)."""
