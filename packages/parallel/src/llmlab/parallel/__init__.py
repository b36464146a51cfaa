"""llmlab.parallel: Lightning strategies and the mechanisms under them (DESIGN §1)."""

from llmlab.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups

__all__ = ["ParallelDims", "ProcessGroups", "build_process_groups"]
