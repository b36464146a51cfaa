"""``task.lora``: fine-tune low-rank adapters on a frozen model (:mod:`llmlab.models.lora`),
e.g. ``make train EXP=llama_finetune ARGS='model.init_from=DIR +task.lora={r: 8, alpha: 16}'``
(a key of ``CausalLMTask`` only, hence the ``+``: other tasks take no adapters).

The task applies the adapters in ``CausalLMTask.configure_model``: after ``model.init_from`` is
read in one process or DDP; under llmlab's N-D strategy before it (the base is still ``meta``
there, its ranks' parts read by ``parallelize_model``, the base under its layer's name), the
adapters drawn on the CPU from the run's seed either way, so every layout starts from the same
ones. The optimizer then sees only the adapters (the only parameters that require gradients).

Checkpoints hold only what training changes: with ``model.init_from`` the adapters alone (the
base is the folder, read again on resume, by ``make sample`` and by ``make export``: the task's
``state_dict()`` itself drops the base, :func:`adapters_only_state`); from a random base (no
folder to read it back from) the whole model. The adapters-only checkpoint is consolidated by
name like any N-D checkpoint (full ``lora_A`` / ``lora_B`` tensors; sharded: a folder of their
shards), so it resumes in another layout and loads into one process; resuming it, the base is
not asked for (the task checks every adapter is there and loads non-strictly).

Layouts: Lightning's single-process and DDP strategies run the model as it is; llmlab's N-D
strategy (and its ``tensor``, ``tensor_sp``, ``pipeline`` presets) carries the adapters through
``parallelize_model``: sharded with their base under tensor parallelism
(:mod:`llmlab.parallel.tensor.sharding`), on the stage that owns the layer under a pipeline,
sharded by ZeRO (FSDP2: with the frozen base), untouched by context parallelism; the optimizer,
the gradient reduction and the whole-model norm see only the adapters (``ParallelModel.params``
holds what trains). Each was checked to train like one process
(tests/integration/test_lora_layouts.py); :func:`strategy_problem` refuses the rest (expert
ranks, QLoRA, adapter dropout with tensor ranks, other strategies) before any process starts.

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
                        "use_rslora, exclude, quantize, init_lora_weights)") from err  # fmt: skip


# llmlab's N-D strategy and its presets: adapters are wired through its layouts
LAYOUT_STRATEGIES = (
    "llmlab.parallel.strategy.NDParallelStrategy",
    "llmlab.parallel.presets.TensorParallelStrategy",
    "llmlab.parallel.presets.PipelineStrategy",
)
WORKS = (
    "adapters run under one process, Lightning's DDP, or llmlab's N-D strategy (strategy=nd, "
    "tensor, tensor_sp, pipeline) with data, pipeline, context and tensor (+ sequence "
    "parallel) ranks and ZeRO (zero_impl=llmlab, or fsdp2 without a pipeline)"
)


def strategy_problem(
    strategy: Mapping[str, Any], lora: Mapping[str, Any] | LoRAConfig | None = None
) -> str | None:
    """Why adapters ``lora`` cannot run under the strategy config ``strategy`` (its ``name`` or
    ``_target_`` and options), or ``None``: what the layouts were checked to train exactly like
    one process (tests/integration/test_lora_layouts.py) runs, everything else is refused by
    name (``WORKS`` says what runs)."""
    which = strategy.get("_target_") or strategy.get("name") or "auto"
    if which in PLAIN_STRATEGIES:
        return None
    if which not in LAYOUT_STRATEGIES:
        return f"task.lora with strategy {which}: {WORKS}"
    config = lora_config(lora) if lora is not None else None
    refused = []
    if (strategy.get("expert") or 1) > 1:  # LoRA wraps linear layers, not stacked experts
        refused.append(f"strategy.expert={strategy['expert']}")
    if config is not None and config.quantize is not None:
        refused.append(
            f"lora.quantize={config.quantize} (QLoRA quantizes the whole base in one process; "
            "the N-D strategy reads a float base rank by rank)"
        )
    tensor = strategy.get("tensor") or 1
    if config is not None and config.dropout > 0 and tensor > 1:
        refused.append(
            f"lora.dropout={config.dropout} with strategy.tensor={tensor} (the adapters' input "
            "is replicated or sequence-split there: its dropout stream is not verified)"
        )
    if not refused:
        return None
    return f"task.lora with {', '.join(refused)} is not supported: {WORKS}"


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


ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def keep_adapters_only(state: dict[str, Tensor], prefix: str = "model.") -> None:
    """Drop from a checkpoint's ``state`` every entry under ``prefix`` that is not an adapter
    tensor, in place. By name, not by the local model's layers: a layout's consolidated state
    holds every stage's adapters, a pipeline rank's model only its own."""
    for key in [k for k in state if k.startswith(prefix) and not k.endswith(ADAPTER_SUFFIXES)]:
        del state[key]


def adapters_only_state(
    module: nn.Module, state: dict[str, Tensor], prefix: str, metadata: Any
) -> None:
    """A task's state-dict post-hook (``register_state_dict_post_hook``) with adapters on a
    folder's model: its state -- what every strategy saves, and what the N-D strategy gathers
    over the tensor and pipeline ranks -- is the adapters alone, so the frozen base is never
    gathered to be thrown away."""
    keep_adapters_only(state, prefix + "model.")


def adapters_only(state: Mapping[str, Tensor], model: nn.Module, prefix: str = "model.") -> bool:
    """Whether ``state`` is an adapters-only checkpoint for ``model`` (then its base is the
    folder this task read, and loading must not ask for it: the caller loads non-strictly); a
    checkpoint with any other tensor of the model (a random base's) is not. Raises ``KeyError``
    when an adapter ``model`` holds is missing: the strict check, kept for the adapters."""
    ours = {k for k in state if k.startswith(prefix)}
    if not ours or any(not k.endswith(ADAPTER_SUFFIXES) for k in ours):
        return False  # a sharded checkpoint (its folder is read by name), or a whole model's
    missing = sorted({prefix + k for k in lora_state_dict(model)} - ours)
    if missing:
        raise KeyError(f"the checkpoint lacks LoRA tensors {missing[:3]} ({len(missing)} in all)")
    return True


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
