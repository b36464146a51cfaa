"""llmlab.kernels: Triton kernels, each with a plain-PyTorch reference."""
