"""llmlab.train: the Lightning + Hydra app (tasks, data, configs, W&B tracking)."""
