"""verlaudit: a precision-auditing harness for RL post-training (PPO, GRPO, DPO)."""

__version__ = "0.1.0"
