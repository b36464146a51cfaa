"""The one compiled part of llmlab-tokenizer: the BPE merge loop (``_merge_core.c``).

It is optional: where no C compiler is found the build goes on without it, and
``merge_trainer`` runs the same algorithm in Python (same merges, slower). Everything else is
declared in ``pyproject.toml``.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "llmlab.tokenizer._merge_core",
            ["src/llmlab/tokenizer/_merge_core.c"],
            optional=True,
        )
    ]
)
