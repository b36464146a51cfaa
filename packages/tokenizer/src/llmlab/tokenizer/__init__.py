"""llmlab.tokenizer."""
