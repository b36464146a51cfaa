"""llmlab.parallel."""
