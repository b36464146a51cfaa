"""llmlab.kernels: Triton kernels, each with a plain-PyTorch reference
(docs/architecture.md#kernels-three-faces).

Every op module has three faces: ``reference`` (plain torch, the oracle), the Triton kernel
(``llmlab.kernels._jit.<op>``, imported only when a kernel actually runs, so this package
imports without triton), and the public op below, which runs the kernel on CUDA tensors, runs
the same kernel through Triton's interpreter on CPU when ``TRITON_INTERPRET=1`` was set before
triton was imported, and otherwise falls back to the reference with one warning per op.
"""

from llmlab.kernels._runtime import interpreter_requested, triton_available
from llmlab.kernels.access_patterns import copy, transpose
from llmlab.kernels.attention import attention
from llmlab.kernels.elementwise import add3
from llmlab.kernels.gelu import bias_gelu, gelu
from llmlab.kernels.layer_norm import add_layer_norm, layer_norm
from llmlab.kernels.matmul import matmul
from llmlab.kernels.naive_matmul import naive_matmul
from llmlab.kernels.paged_attention import PagedLayout, Scratch, paged_attention
from llmlab.kernels.rms_norm import rms_norm
from llmlab.kernels.rope import rope
from llmlab.kernels.softmax import softmax
from llmlab.kernels.sparse import CSRMatrix, ELLMatrix, coo_spmm_reference, spmm, spmv
from llmlab.kernels.swiglu import swiglu

__all__ = [
    "CSRMatrix",
    "ELLMatrix",
    "PagedLayout",
    "Scratch",
    "add3",
    "add_layer_norm",
    "attention",
    "bias_gelu",
    "coo_spmm_reference",
    "copy",
    "gelu",
    "interpreter_requested",
    "layer_norm",
    "matmul",
    "naive_matmul",
    "paged_attention",
    "rms_norm",
    "rope",
    "softmax",
    "spmm",
    "spmv",
    "swiglu",
    "transpose",
    "triton_available",
]
