"""llmlab.parallel: Lightning strategies and the mechanisms under them.

One module or subpackage per mechanism: docs/architecture.md#layout.
"""

from llmlab.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups

__all__ = ["ParallelDims", "ProcessGroups", "build_process_groups"]
