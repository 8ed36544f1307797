"""The driver: PPO / GRPO loops, timing and throughput metrics, logging sinks, checkpoint cadence and resume."""
