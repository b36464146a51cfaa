"""GPT and Llama decode steps as one native call each (``csrc/decode_step.cpp``, built once).

Why: at batch 1 a decode step of a small model is ~70 tiny ops (layer norms, views, adds, GELU,
one SDPA per layer) around its matrix-vector products, each with a fixed cost from Python and
in ATen far above its work at this size. The serving benchmark's notes time it on its GPT-2
(4 x 256, vocab 8192, one CPU thread; benchmarks/results/SUMMARY.md's run): the Python step's
forward 1.51 ms per token, of which the 4 layers' KV writes and SDPA calls 0.20 and the small
ops 0.43; the native step 0.98, with the matrix products alone at 0.84. A Llama of the same
size (GQA 4/2) decodes at 2.40x HF ``generate`` with it, 1.22x without.

Each step follows its model's forward op for op, with paged attention for the one token (write
its key and value at its slot of the KV pool, attend over its sequence's keys through the block
table): ATen's products, GELU / SiLU-gate and adds; on fp32 CPU tensors its own loops for the
norms, RoPE (from the model's own angle tables) and the attention, so its logits equal the
model's to fp32 rounding, not bit for bit (tests/models/test_native_step.py). GPT falls back to
ATen's kernels for other dtypes and devices; Llama's step is fp32 CPU only.

The extension is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ``ninja``) into
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), once per torch version and
source; ``make install`` builds it, later processes load it (timed here: 1.05 s importing
``torch.utils.cpp_extension``, 0.01 s the load itself). Where it cannot be built or loaded (no
compiler, say) :func:`load_extension` returns None after one warning and callers keep their
Python path; ``LLMLAB_NATIVE=0`` turns it off. A build killed half-way leaves a lock file that
torch's loader waits on forever: delete ``TORCH_EXTENSIONS_DIR/<extension_name()>`` then.

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

from llmlab.models.ops import (
    _torch_gelu,
    _torch_layer_norm,
    _torch_rms_norm,
    _torch_rope,
    _torch_swiglu,
)

if TYPE_CHECKING:
    from llmlab.models.gpt import GPT
    from llmlab.models.llama import Llama

SOURCE = Path(__file__).with_name("csrc") / "decode_step.cpp"


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
    return "llmlab_decode_step_" + re.sub(r"\W", "_", torch.__version__)


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


def _extension_for(keys: list[Tensor], values: list[Tensor], layers: int, kv_heads: int,
                   dim: int) -> ModuleType | None:  # fmt: skip
    """The extension, if the pools are one contiguous (num_blocks, block_size, kv_heads, dim)
    pair per layer, all of one shape (the C++ loops index them so), else None."""
    if not keys or len(keys) != layers or len(values) != layers:
        return None
    shape = keys[0].shape
    if len(shape) != 4 or shape[2:] != (kv_heads, dim):
        return None
    if any(p.shape != shape or not p.is_contiguous() for p in (*keys, *values)):
        return None
    return load_extension()


def _linear(module: nn.Linear) -> tuple[Tensor, Tensor | None]:
    return module.weight, module.bias


def _plain(module: nn.Module) -> bool:
    ops = module.ops
    return ops.layer_norm is _torch_layer_norm and ops.gelu is _torch_gelu


def gpt_decode_step(model: GPT, keys: list[Tensor], values: list[Tensor]) -> DecodeStep | None:
    """``model``'s decode step as one native call over the per-layer paged KV pools
    ``keys``/``values`` (each (num_blocks, block_size, H, D), contiguous), or None where it would
    not compute what ``model.inference_forward`` computes: a replaced layer, a non-torch layer
    norm or GELU (``config.kernels``), pools of another shape, or no extension.

    The step computes eval mode's forward (no dropout, no hooks): the caller checks the mode, as
    the serving runner does at every step. It holds the model's weight tensors as they are now:
    parameters replaced later (not updated in place) are not seen; build a new step then."""
    if disabled() or not model.inference_forward_applies():
        return None
    norms = [b.ln_1 for b in model.blocks] + [b.ln_2 for b in model.blocks] + [model.head.ln_f]
    if not all(_plain(n) for n in norms) or not all(_plain(b.mlp) for b in model.blocks):
        return None
    heads, dim = model.blocks[0].attn.local_heads, model.blocks[0].attn.head_dim
    if heads * dim != model.config.n_embd:  # a tensor-parallel shard: its heads are a slice
        return None
    module = _extension_for(keys, values, len(model.blocks), heads, dim)
    if module is None:
        return None

    def norm(ln):
        return ln.weight, ln.bias, ln.eps

    blocks = [
        (norm(b.ln_1), _linear(b.attn.qkv), _linear(b.attn.proj), norm(b.ln_2),
         _linear(b.mlp.fc), _linear(b.mlp.proj), k, v)
        for b, k, v in zip(model.blocks, keys, values)
    ]  # fmt: skip
    embed, head = model.embed, model.head
    return module.GPTDecodeStep(
        embed.wte.weight, embed.wpe.weight, blocks, norm(head.ln_f), _linear(head.lm_head), heads
    )


def llama_decode_step(model: Llama, keys: list[Tensor], values: list[Tensor]) -> DecodeStep | None:
    """``model``'s decode step as one native call over per-layer paged KV pools (each
    (num_blocks, block_size, H_kv, D), contiguous), as :func:`gpt_decode_step`; or None where
    it would not compute what the model's ``forward`` computes, or not here: a layer of another
    class (an adapter), non-torch ops (``config.kernels``), q/k norms (Qwen3), a sliding window
    shorter than the context, a tensor-parallel shard, other than fp32 CPU weights and pools
    (its RMSNorm, RoPE and attention are fp32 loops), or no extension."""
    from llmlab.models.llama_layers import MLP, Attention, Block, Embedding, Head, RMSNorm

    if disabled():
        return None
    # every layer below the model (which ``Llama.native_decode_step`` checks is exactly Llama)
    plain = (Embedding, Block, Attention, MLP, RMSNorm, Head, nn.Linear, nn.Embedding,
             nn.Dropout, nn.ModuleList)  # fmt: skip
    if not all(type(m) in plain for m in list(model.modules())[1:]):
        return None
    config, attns = model.config, [b.attn for b in model.blocks]
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    ops = [n.ops for n in norms] + [a.ops for a in attns] + [b.mlp.ops for b in model.blocks]
    if not all(o.rms_norm is _torch_rms_norm for o in ops) or config.qk_norm:
        return None
    if not all(o.rope is _torch_rope and o.swiglu is _torch_swiglu for o in ops):
        return None
    if any(a.window is not None and a.window < config.block_size for a in attns):
        return None
    angles = {(a.rotary.head_dim, a.rotary.theta, repr(a.rotary.scaling)) for a in attns}
    if len(angles) != 1:  # one table of angles serves every layer
        return None
    if {n.eps for n in norms} != {config.rms_norm_eps}:
        return None
    heads, kv_heads, dim = config.n_head, config.n_kv_head, config.head_size
    if any(a.local_heads != heads or a.local_kv_heads != kv_heads for a in attns):
        return None
    tensors = [*model.parameters(), *keys, *values]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    module = _extension_for(keys, values, len(model.blocks), kv_heads, dim)
    if module is None:
        return None
    # the angles of every position, as the layers compute them (HF's tables, fp32)
    with torch.no_grad():
        cos, sin = attns[0].rotary(torch.arange(config.block_size)[None], torch.float32)
    blocks = [
        (b.attn_norm.weight, _linear(b.attn.q_proj), _linear(b.attn.k_proj),
         _linear(b.attn.v_proj), _linear(b.attn.o_proj), b.mlp_norm.weight,
         _linear(b.mlp.gate_proj), _linear(b.mlp.up_proj), _linear(b.mlp.down_proj), k, v)
        for b, k, v in zip(model.blocks, keys, values)
    ]  # fmt: skip
    head = model.head
    return module.LlamaDecodeStep(
        model.embed.tokens.weight, blocks, head.norm.weight, _linear(head.lm_head),
        cos[0].contiguous(), sin[0].contiguous(), config.rms_norm_eps, heads, kv_heads,
    )  # fmt: skip


if __name__ == "__main__":  # `make install` builds the extension here, once
    ready = load_extension(verbose=False) is not None
    print(f"llmlab.models.native: {extension_name()} {'ready' if ready else 'NOT built (above)'}")
