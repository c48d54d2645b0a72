"""Reinforcement learning with verifiable rewards (GRPO): ``meshlm rl``. See loop.py."""
