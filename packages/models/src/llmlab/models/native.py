"""A GPT decode step in one native call: ``csrc/gpt_decode_step.cpp``, built on first use.

Why: at batch 1 a decode step of a small model is ~70 tiny ops (layer norms, views, adds, GELU,
one SDPA per layer) around its matrix-vector products. Each op costs a few microseconds when
Python calls it and about one when C++ does, and ATen's layer norm and SDPA spend 5 and 30
microseconds setting up work of well under one at this size. On the serving benchmark's GPT-2
(4 x 256, vocab 8192, one CPU thread) the Python step's forward takes 1.41 ms per token and this
one 0.94, with the matrix products alone at 0.81 (benchmarks/results/SUMMARY.md). It follows
``GPT.inference_forward`` op for op with paged attention for the one token (write its key and
value at its slot of the KV pool, attend over its sequence's keys through the block table):
ATen's products, GELU and adds;
on fp32 CPU tensors its own loops for the layer norms and the attention, so its logits equal
the model's to fp32 rounding, not bit for bit (tests/models/test_native_step.py).

The extension is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ``ninja``) into
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), once per torch version and
source; ``make install`` builds it, later processes load it in ~1 s (most of it importing
``torch.utils.cpp_extension``). Where it cannot be built or loaded (no compiler, say)
:func:`load_extension` returns None after one warning and callers keep their Python path;
``LLMLAB_NATIVE=0`` turns it off. A build killed half-way leaves a lock file that torch's loader
waits on forever: delete ``TORCH_EXTENSIONS_DIR/<extension_name()>`` then.

The step object may be called from several threads at once (it releases the GIL; its scratch
is per call), though not on the same pools for the same slots, as any KV cache.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from llmlab.models.ops import _torch_gelu, _torch_layer_norm

if TYPE_CHECKING:
    from llmlab.models.gpt import GPT

SOURCE = Path(__file__).with_name("csrc") / "gpt_decode_step.cpp"


class DecodeStep(Protocol):
    def __call__(self, token: int, position: int, block_table: list[int]) -> Tensor:
        """Logits (1, 1, V) of ``token`` at ``position`` of a sequence whose keys and values
        are in the pool blocks ``block_table`` lists in order (position ``p`` in slot
        ``p % block_size`` of block ``block_table[p // block_size]``): the token's own are
        written there first, in every layer's pool. Refused (RuntimeError, nothing written)
        if the table is too short for ``position`` or names a block outside the pool."""
        ...


def disabled() -> bool:
    return os.environ.get("LLMLAB_NATIVE", "1") == "0"


def extension_name() -> str:
    """One build per torch version: an extension compiled against other headers must not load."""
    return "llmlab_gpt_decode_step_" + re.sub(r"\W", "_", torch.__version__)


@functools.cache
def load_extension(verbose: bool = False) -> ModuleType | None:
    """The compiled module (built here the first time), or None with one warning saying why."""
    if disabled():
        return None
    missing = _missing_tools()
    if missing:
        warnings.warn(
            f"llmlab.models.native: no {' or '.join(missing)} on PATH, so the native decode "
            f"step is not built; decoding keeps its Python path",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    from torch.utils.cpp_extension import load  # imports setuptools: only when needed

    try:
        return load(extension_name(), [str(SOURCE)], extra_cflags=["-O3"], verbose=verbose)
    except Exception as err:  # a failed compile or load (ImportError too): say why, go on
        warnings.warn(
            f"llmlab.models.native: building {SOURCE.name} failed, decoding keeps its Python "
            f"path: {err}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _missing_tools() -> list[str]:
    """What ``torch.utils.cpp_extension`` runs and this PATH lacks. The ``ninja`` wheel's binary
    sits in the environment's bin folder, which is not on PATH when Python is called by its path
    (``.venv/bin/python``): that folder is added."""
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    return [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]


def _plain(module: nn.Module) -> bool:
    ops = module.ops
    return ops.layer_norm is _torch_layer_norm and ops.gelu is _torch_gelu


def gpt_decode_step(model: GPT, keys: list[Tensor], values: list[Tensor]) -> DecodeStep | None:
    """``model``'s decode step as one native call over the per-layer paged KV pools
    ``keys``/``values`` (each (num_blocks, block_size, H, D), contiguous), or None where it would
    not compute what ``model.inference_forward`` computes: a replaced layer, a non-torch layer
    norm or GELU (``config.kernels``), pools of another shape, or no extension.

    The step holds the model's weight tensors as they are now: parameters replaced later (not
    updated in place) are not seen; build a new step then."""
    if disabled() or not model.inference_forward_applies():
        return None
    norms = [b.ln_1 for b in model.blocks] + [b.ln_2 for b in model.blocks] + [model.head.ln_f]
    if not all(_plain(n) for n in norms) or not all(_plain(b.mlp) for b in model.blocks):
        return None
    heads, dim = model.blocks[0].attn.local_heads, model.blocks[0].attn.head_dim
    if heads * dim != model.config.n_embd:  # a tensor-parallel shard: its heads are a slice
        return None
    if not keys or len(keys) != len(model.blocks) or len(values) != len(keys):
        return None
    shape = keys[0].shape
    if len(shape) != 4 or shape[2:] != (heads, dim):
        return None
    if any(p.shape != shape or not p.is_contiguous() for p in (*keys, *values)):
        return None
    module = load_extension()
    if module is None:
        return None

    def norm(ln):
        return ln.weight, ln.bias, ln.eps

    def linear(lin):
        return lin.weight, lin.bias

    blocks = [
        (norm(b.ln_1), linear(b.attn.qkv), linear(b.attn.proj), norm(b.ln_2), linear(b.mlp.fc),
         linear(b.mlp.proj), k, v)
        for b, k, v in zip(model.blocks, keys, values)
    ]  # fmt: skip
    embed, head = model.embed, model.head
    return module.GPTDecodeStep(
        embed.wte.weight, embed.wpe.weight, blocks, norm(head.ln_f), linear(head.lm_head), heads
    )


if __name__ == "__main__":  # `make install` builds the extension here, once
    ready = load_extension(verbose=False) is not None
    print(f"llmlab.models.native: {extension_name()} {'ready' if ready else 'NOT built (above)'}")
