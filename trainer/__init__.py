"""An RL post-training trainer (PPO, GRPO, DPO) whose every precision decision is explicit.

It imports nothing from verlaudit: observers plug in through `trainer.events.Observer`.
Entry point: `trainer.train.train(config, observer)`.
"""
