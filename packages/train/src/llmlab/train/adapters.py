"""``task.lora``: fine-tune low-rank adapters on a frozen model (:mod:`llmlab.models.lora`),
e.g. ``make train EXP=llama_finetune ARGS='model.init_from=DIR +task.lora={r: 8, alpha: 16}'``
(a key of ``CausalLMTask`` only, hence the ``+``: other tasks take no adapters).

The task applies the adapters once the model holds its weights (``CausalLMTask.configure_model``,
after ``model.init_from`` is read), so the base's names stay those the folder is read by; the
optimizer then sees only the adapters (the only parameters that require gradients).

Checkpoints hold only what training changes: with ``model.init_from`` the adapters alone (the
base is the folder, read again on resume, by ``make sample`` and by ``make export``); from a
random base (no folder to read it back from) the whole model. :func:`strategy_problem` refuses
the layouts adapters are not wired through yet: Lightning's own single-process and DDP
strategies leave the model as it is; llmlab's strategies shard, split or re-wrap it.

QLoRA is ``+task.lora={r: 8, alpha: 16, quantize: int4}`` (``int8``, ``int4``, ``int4:g64``,
``int4:g128``, ``bf16``): the loaded base is quantized first (every linear layer and embedding,
:func:`llmlab.models.quantize.quantize`), then the adapters wrap it in full precision; the input
gradients run through the packed base (:class:`llmlab.kernels.quantized.QuantizedMatmul`).
A quantized base exists only under adapters: its weights are packed integer buffers that take no
gradient, so full fine-tuning has nothing to train there (``+task.quantize`` is no key of the
task and is refused by name). The weight bytes before and after are logged and shown in the
model summary. The checkpoint still holds the adapters alone (the base is re-read from its
folder and quantized again, the same bytes: quantizing is deterministic).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.models.lora import (
    LoRAConfig,
    apply_lora,
    count_parameters,
    load_lora_state_dict,
    lora_layers,
    lora_state_dict,
)
from llmlab.models.quantize import weight_bytes

log = logging.getLogger(__name__)
# Lightning's strategies that run the task's model unchanged (one process, or replicas)
PLAIN_STRATEGIES = ("auto", "single_device", "ddp", "lightning.pytorch.strategies.DDPStrategy")


def lora_config(spec: Mapping[str, Any] | LoRAConfig | None) -> LoRAConfig | None:
    """``task.lora`` as a :class:`LoRAConfig` (``None``: no adapters); bad values raise
    ``ValueError`` naming the ``lora.`` field, unknown keys ``TypeError``."""
    if spec is None or isinstance(spec, LoRAConfig):
        return spec
    try:
        return LoRAConfig(**dict(spec))
    except TypeError as err:
        raise TypeError(f"task.lora: {err} (fields: r, alpha, dropout, target_modules, "
                        "use_rslora, exclude, quantize)") from err  # fmt: skip


def strategy_problem(strategy: Mapping[str, Any]) -> str | None:
    """Why adapters cannot run under the strategy config ``strategy`` (its ``name`` or
    ``_target_``), or ``None``."""
    which = strategy.get("_target_") or strategy.get("name") or "auto"
    if which in PLAIN_STRATEGIES:
        return None
    return (
        f"task.lora with strategy {which}: adapters run under one process or Lightning's DDP "
        "(strategy=auto or strategy=ddp); tensor-parallel, pipeline, ZeRO and the other llmlab "
        "layouts do not carry LoRA layers yet (issue 39)"
    )


def add_adapters(model: nn.Module, config: LoRAConfig) -> None:
    """Wrap ``model``'s target layers once (a second call finds them there) and log the
    trainable share.

    The adapters' initial values (A random, B zero) are drawn from the run's seed
    (``torch.initial_seed()``, the seed ``seed_everything`` set), not from wherever the random
    stream happens to be: Lightning's DDP re-seeds every rank just before ``configure_model``
    and one process does not, so the stream's position differs while the seed does not -- and
    a DDP run must start from the adapters one process starts from."""
    if lora_layers(model):
        return
    before = weight_bytes(model)
    with torch.random.fork_rng():
        torch.manual_seed(torch.initial_seed())
        apply_lora(model, config)  # with config.quantize: the base quantized first
    trainable, total = count_parameters(model)
    log.info(
        "LoRA r=%d alpha=%g on %d layers: %s trainable of %s parameters (%.2f%%)",
        config.r, config.alpha, len(lora_layers(model)), f"{trainable:,}", f"{total:,}",
        100 * trainable / max(total, 1),
    )  # fmt: skip
    if config.quantize is not None:
        after = weight_bytes(model)
        log.info(
            "QLoRA: base quantized to %s: weights %s -> %s bytes (%.2fx, adapters included)",
            config.quantize, f"{before:,}", f"{after:,}", after / max(before, 1),
        )  # fmt: skip


def keep_adapters_only(state: dict[str, Tensor], model: nn.Module, prefix: str = "model.") -> None:
    """Drop from a checkpoint's ``state`` every entry of ``model`` (under ``prefix``) that is
    not an adapter tensor, in place."""
    adapters = {prefix + k for k in lora_state_dict(model)}
    for key in [k for k in state if k.startswith(prefix) and k not in adapters]:
        del state[key]


def fill_base(state: dict[str, Tensor], model: nn.Module, prefix: str = "model.") -> None:
    """Complete an adapters-only checkpoint ``state`` with ``model``'s own base tensors (read
    from its folder), so that Lightning's strict loading checks the adapters' names and shapes
    and restores them. A checkpoint with any other tensor of the model is left as it is."""
    adapters = {prefix + k for k in lora_state_dict(model)}
    ours = {prefix + k: v for k, v in model.state_dict().items()}
    if set(state) & (set(ours) - adapters):
        return  # a whole-model checkpoint (a random base)
    missing = sorted(adapters - set(state))
    if missing:
        raise KeyError(f"the checkpoint lacks LoRA tensors {missing[:3]} ({len(missing)} in all)")
    for key, value in ours.items():
        state.setdefault(key, value)


def model_from_checkpoint(
    spec: Mapping[str, Any], lora: Mapping[str, Any], state: Mapping[str, Tensor], prefix: str
) -> nn.Module:
    """The trained model of a LoRA run's checkpoint, in eval mode: the base built from ``spec``
    (its ``init_from`` folder read again), the adapters of ``lora`` on it, and the
    checkpoint's tensors -- the adapters alone, or the whole model."""
    from llmlab.models import build_model

    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    model = build_model(dict(spec))  # reads init_from's folder when there is one
    apply_lora(model, lora_config(lora))
    if set(weights) == set(lora_state_dict(model)):
        load_lora_state_dict(model, weights)
    else:
        model.load_state_dict(weights)
    return model.eval()
