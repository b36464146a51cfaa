"""Where an op runs: the Triton kernel, the Triton interpreter, or the PyTorch reference.

docs/architecture.md#kernels-three-faces gives every op three faces (reference, Triton kernel,
public op). The public op asks :func:`use_triton` which face to run:

* CUDA tensors and triton installed: the compiled Triton kernel.
* CPU tensors with ``TRITON_INTERPRET=1``: the *same* Triton kernel, run by Triton's interpreter
  (numpy underneath). This is how the kernels are tested on machines without a GPU.
* Anything else (CPU without the interpreter, or triton missing): the PyTorch reference, with
  one warning per op, so that CPU training keeps running.

Why the kernel modules (``llmlab.kernels._jit.*``) are imported lazily, on first use: Triton
decides at *import time of triton itself* whether ``@triton.jit`` builds interpreted functions
(its own standard library, e.g. ``tl.zeros``, is ``@jit``-decorated), so ``TRITON_INTERPRET``
must be set before ``import triton``. Importing ``llmlab.kernels`` therefore never imports
triton; only running a kernel does. If the variable was set too late we fail with a message that
says so, instead of Triton's "Cannot call @triton.jit'd outside of the scope of a kernel".
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from functools import cache
from types import ModuleType

import torch

_TRUTHY = {"1", "true", "yes", "on"}
_warned_ops: set[str] = set()


@cache
def triton_available() -> bool:
    """True when the optional ``triton`` dependency is installed."""
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUTHY


def _interpreter_live() -> bool:
    """True when triton was imported with the interpreter on (so interpreted kernels can run)."""
    import triton.language.standard as standard

    return type(standard.zeros).__name__ == "InterpretedFunction"


def use_triton(op: str, *tensors: torch.Tensor | None) -> bool:
    """Decide whether ``op`` runs its Triton kernel on ``tensors`` (None entries are ignored).

    Returns False (after warning once for ``op``) when the reference must be used instead.
    """
    present = [t for t in tensors if t is not None]
    if any(t.numel() == 0 for t in present):
        return False  # nothing to launch (a grid of zero programs); the reference handles it
    devices = {t.device.type for t in present}
    if triton_available() and interpreter_requested():
        if devices <= {"cpu"}:
            if "triton" in sys.modules and not _interpreter_live():
                raise RuntimeError(
                    f"llmlab.kernels.{op}: TRITON_INTERPRET=1 was set after triton had been "
                    "imported, so Triton built compiled (not interpreted) functions. Set "
                    "TRITON_INTERPRET=1 before anything imports triton (e.g. in the environment "
                    "of the process)."
                )
            return True
    elif triton_available() and devices == {"cuda"}:
        return True
    if op not in _warned_ops:
        _warned_ops.add(op)
        if not triton_available():
            reason = "triton is not installed"
        elif interpreter_requested():
            reason = f"TRITON_INTERPRET=1 runs CPU tensors only, got {sorted(devices)}"
        else:
            reason = f"tensors on {sorted(devices)}, not CUDA, and TRITON_INTERPRET is not set"
        warnings.warn(
            f"llmlab.kernels.{op}: {reason}; running the PyTorch reference instead of the "
            "Triton kernel (warned once per op).",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def reset_fallback_warnings() -> None:
    """Forget which ops have warned (for tests of the warn-once behaviour)."""
    _warned_ops.clear()


def jit_module(name: str) -> ModuleType:
    """Import ``llmlab.kernels._jit.<name>`` (the ``@triton.jit`` code) on first use."""
    return importlib.import_module(f"llmlab.kernels._jit.{name}")


def compute_dtype(dtype: torch.dtype):  # -> tl.dtype
    """fp32 arithmetic for fp32/fp16/bf16 inputs; fp64 for fp64 (gradcheck runs the kernels)."""
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether to upcast tiles to fp32 before ``tl.dot``.

    Triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 storage
    (``InterpreterBuilder.create_dot`` calls ``np.matmul`` on the bits), so under the interpreter
    bf16 tiles are upcast first. Every bf16 product is exact in fp32 and the tensor core
    accumulates in fp32 too, so this matches the GPU's arithmetic up to summation order.
    On the GPU this is False and bf16 goes straight to the tensor cores.
    """
    return dtype == torch.bfloat16 and interpreter_requested()


def dot_precision(t: torch.Tensor) -> str:
    """``input_precision`` for ``tl.dot``. On CUDA, fp32 dots use TF32 only when torch allows it
    for its own matmuls (``torch.backends.cuda.matmul.allow_tf32``) and are exact ("ieee")
    otherwise; fp16/bf16 dots keep Triton's CUDA default ("tf32", which leaves them on the
    tensor cores). The interpreter ignores the setting and computes in numpy."""
    if not t.is_cuda:
        return "ieee"
    if t.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_float(op: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """Fail early, naming the bad dtype and the valid ones."""
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"llmlab.kernels.{op}: {name} has dtype {t.dtype}; supported: {names}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
