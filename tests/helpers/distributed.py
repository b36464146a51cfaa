"""Distributed tests run through the package's launcher; this keeps their import path short."""

from llmlab.parallel.launch import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
