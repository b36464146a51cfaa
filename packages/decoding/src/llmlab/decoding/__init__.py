"""llmlab.decoding."""
