"""The models' linear layer: ``nn.Linear`` whose decoding-sized fp32 CPU products run through
llmlab's few-row kernel (``llmlab.kernels.cpu_linear``).

A decoding step multiplies a few rows (one per sequence, ``k + 1`` when verifying drafts) by
every weight, and MKL's product of 2-16 rows reads the weights at well under its one-row rate;
the kernel reads each weight once per eight of them. Everything else (training, prefill, other
dtypes and devices, tensor-parallel DTensor weights, ``torch.compile``) is ``nn.Linear``'s own
``F.linear``. A subclass, so that whatever finds linear layers by ``isinstance(m, nn.Linear)``
(LoRA, tensor parallelism, FSDP2) treats it as one, and ``plain_linear`` tells converters that
match exact classes (quantization, fp8) to convert it as an ``nn.Linear``; its state dict is
``nn.Linear``'s.
"""

from __future__ import annotations

from torch import Tensor, nn

from llmlab.kernels.cpu_linear import linear


class Linear(nn.Linear):
    """``nn.Linear`` computing through :func:`llmlab.kernels.cpu_linear.linear`."""

    plain_linear = True  # the same function as nn.Linear's: convert it as one

    def forward(self, input: Tensor) -> Tensor:
        return linear(input, self.weight, self.bias)
