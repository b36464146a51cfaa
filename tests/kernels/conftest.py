"""Kernel tests come in two kinds, because Triton reads ``TRITON_INTERPRET`` when *triton itself*
is imported (its own ``tl`` helpers are ``@triton.jit`` functions), not when our kernels run.

* ``tests/kernels/test_*.py`` run in the suite's process: references, formats, validation, the
  CPU fallback, and ``gpu``-marked tests.
* ``tests/kernels/interpreter/`` runs the Triton kernels on CPU. In the normal suite another
  test (e.g. the GPT's) may already have imported triton without the interpreter, so these
  tests are not collected in-process; ``test_interpreter_suite.py`` runs them in a child
  ``python -m pytest`` with ``TRITON_INTERPRET=1`` in its environment from the start. Run them
  directly (per-test output) with ``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpreter``.
"""

from __future__ import annotations

from llmlab.kernels import interpreter_requested

collect_ignore = [] if interpreter_requested() else ["interpreter"]
