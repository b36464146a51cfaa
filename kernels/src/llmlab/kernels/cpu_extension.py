"""llmlab's C++ CPU kernels (``cpu/*.cpp``), built into one extension on first use.

What is in it: the weight-only quantized products (``cpu/few_row_matmul.cpp``, used by
:mod:`llmlab.kernels.quantized`) and the fused SwiGLU (``cpu/swiglu.cpp``, used by
:mod:`llmlab.kernels.cpu_swiglu` and the ``kernels="cpu"`` op table of the models). Each kernel
has an AVX-512 and an AVX2 + FMA path; the build targets this CPU's widest.

``make install`` builds it once (``python -m llmlab.kernels.cpu_extension``, ~30-60 s on two
cores); torch caches the build in ``TORCH_EXTENSIONS_DIR`` and rebuilds when a source changes.
Where it cannot be built (no AVX2/FMA, no compiler or ninja) or ``LLMLAB_CPU_KERNELS=0`` is set,
:func:`cpu_kernels` returns None and every caller takes its PyTorch path.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCES = sorted(Path(__file__).with_name("cpu").glob("*.cpp"))


def _missing_tools() -> list[str]:
    """What ``torch.utils.cpp_extension`` runs and this PATH lacks (the ``ninja`` wheel's binary
    sits beside the interpreter, not always on PATH: added)."""
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    return [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]


def _isa_flags() -> list[str] | None:
    """Compiler flags for this CPU's widest vector ISA the kernels have a path for (AVX-512,
    else AVX2 + FMA), or None when it has neither."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    if {"avx512f", "avx512bw"} <= flags:
        vnni = ["-mavx512vnni"] if "avx512_vnni" in flags else []
        return ["-mavx512f", "-mavx512bw", *vnni, "-mavx2", "-mfma"]
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else None


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled extension (built on first use), or None, with one warning saying why, where
    it cannot be: no AVX2/FMA, no compiler or ninja, or ``LLMLAB_CPU_KERNELS=0`` (then
    quietly)."""
    if os.environ.get("LLMLAB_CPU_KERNELS", "1") == "0":
        return None
    isa = _isa_flags()
    why = "the CPU has no AVX2/FMA" if isa is None else ""
    missing = _missing_tools()
    why = why or (f"no {' or '.join(missing)} on PATH" if missing else "")
    if not why:
        from torch.utils.cpp_extension import load  # imports setuptools: only when needed

        # one build per torch version and ISA: one compiled for other headers or another CPU
        # must not load
        tag = f"{torch.__version__}_{isa[0][2:]}"
        name = "llmlab_cpu_kernels_" + "".join(c if c.isalnum() else "_" for c in tag)
        try:
            return load(
                name,
                [str(s) for s in SOURCES],
                # GCC's default FMA contraction, as PyTorch's own CPU kernels are built: the
                # fused SwiGLU then rounds exactly as eager silu / silu_backward (tested)
                extra_cflags=["-O3", "-fopenmp", *isa],
                extra_ldflags=["-fopenmp"],
            )
        except Exception as err:  # a failed compile or load: say why, go on without it
            why = f"building {', '.join(s.name for s in SOURCES)} failed: {err}"
    warnings.warn(
        f"llmlab.kernels: no C++ CPU kernels ({why}); quantized products use torch.compile or "
        "the reference, SwiGLU PyTorch's ops",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


if __name__ == "__main__":  # make install: build once, say whether it is there
    print(f"llmlab.kernels: C++ CPU kernels {'ready' if cpu_kernels() else 'not built'}")
