"""LoRA: low-rank adapters on a frozen base, read and written in peft's format.

A LoRA layer keeps its base linear layer ``W`` frozen and learns a low-rank update beside it
(Hu et al., 2021)::

    y = W x + s · B A x,    A: (r, in), B: (out, r),    s = α / r   (rsLoRA: s = α / √r)

``A`` starts kaiming-uniform and ``B`` at zero (as peft), so a fresh adapter changes nothing.
Only ``A`` and ``B`` train: for ``r ≪ in, out`` they are a small fraction of the weights, and
so are their gradients and optimizer state. The base is any linear module -- an ``nn.Linear``
or a :class:`~llmlab.models.quantize.QuantizedLinear` (QLoRA's idea: a base in int8/int4 bytes,
adapters in full precision) -- and its product goes through its own forward, so input
gradients flow through it as through any frozen layer.

* :func:`apply_lora` wraps the linear layers a :class:`LoRAConfig` names (peft's
  ``target_modules`` rules, or the presets ``"attention"``, ``"mlp"``, ``"all-linear"``) in
  :class:`LoRALinear`, in place, and freezes every other parameter of the model.
* :func:`merge_lora` folds ``s · B A`` into a float base weight (decoding then costs nothing
  extra), :func:`unmerge_lora` takes it out again (both exact to fp32 rounding);
  :func:`merge_and_unload` merges and puts the plain base layers back (what ``save_pretrained``
  exports); :func:`disable_lora` runs the base alone (a reference model for free).
* :func:`lora_state_dict` is the adapter parameters under llmlab's names;
  :func:`save_lora` / :func:`load_lora` write and read peft's folder (``adapter_config.json`` +
  ``adapter_model.safetensors``, keys ``base_model.model.<HF module>.lora_A.weight``), the HF
  module names being those ``save_pretrained`` writes the base under, so
  ``peft.PeftModel.from_pretrained(hf_model, folder)`` reads llmlab's adapters and llmlab reads
  peft's. GPT-2's fused ``c_attn`` orders its outputs ``[q | k | v]`` where llmlab's ``qkv`` goes
  head by head: ``B``'s rows are reordered like the base weight's (``A`` sees the same inputs).

Serving many adapters over one base in one batch (each token its own adapter) is
:mod:`llmlab.models.lora_serving`; :func:`read_lora` reads a peft folder for it without
touching the model.

No peft at run time: peft is the tests' oracle (tests/models/test_lora.py).
"""

from llmlab.models.lora_layer import (
    OUTPUT_LAYER,
    PRESETS,
    LoRAConfig,
    LoRALinear,
    apply_lora,
    count_parameters,
    disable_lora,
    load_lora_state_dict,
    lora_layers,
    lora_state_dict,
    merge_and_unload,
    merge_lora,
    target_names,
    unmerge_lora,
)
from llmlab.models.lora_peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    hf_module_names,
    load_lora,
    read_lora,
    read_lora_config,
    save_lora,
    to_peft_state_dict,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "OUTPUT_LAYER",
    "PEFT_PREFIX",
    "PRESETS",
    "LoRAConfig",
    "LoRALinear",
    "apply_lora",
    "count_parameters",
    "disable_lora",
    "hf_module_names",
    "load_lora",
    "load_lora_state_dict",
    "lora_layers",
    "lora_state_dict",
    "merge_and_unload",
    "merge_lora",
    "read_lora",
    "read_lora_config",
    "save_lora",
    "target_names",
    "to_peft_state_dict",
    "unmerge_lora",
]
