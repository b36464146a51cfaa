"""``python -m llmlab.train.sample ckpt=PATH prompt="ROMEO:" [GenerationConfig field=value ...]``.

Loads a Lightning checkpoint written by ``llmlab.train`` (``CausalLMTask``: the model under
``model.``, its config -- ``arch`` included -- and the tokenizer's config in
``hyper_parameters``; a file, or the folder of a sharded N-D checkpoint), rebuilds the same
model class (``llmlab.models.build_model``) and the tokenizer, and prints the prompt's
continuation, streamed as it is generated. Every
``llmlab.decoding.GenerationConfig`` field can be overridden (``max_new_tokens=100
temperature=0.7 top_k=50 num_beams=4 seed=0``); values are parsed as YAML (``true``, ``0.7``,
``[1, 2]``). Defaults: sampling at temperature 0.8 with top-k 50, 256 new tokens, and a sliding
window of the model's block size (``sliding_window=<block_size> window_stride=1``): past the
model's context it keeps going on the last ``block_size`` tokens, as nanoGPT's sampler does
(``sliding_window=null`` stops at the context instead; a larger ``window_stride`` re-encodes the
window less often). ``compile=true`` compiles the decode step (worth it for long generations).
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import yaml

from llmlab.decoding import GenerationConfig, TextStreamer, generate
from llmlab.models import from_state_dict

USAGE = 'usage: python -m llmlab.train.sample ckpt=PATH prompt="TEXT" [field=value ...]'
DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_k": 50, "max_new_tokens": 256}


def parse_args(args: list[str]) -> tuple[str, str, dict[str, Any]]:
    """``key=value`` arguments -> (checkpoint path, prompt, GenerationConfig overrides); the
    overrides may also hold ``compile`` (an argument of ``generate``)."""
    known = {f.name for f in fields(GenerationConfig)} | {"compile"}
    ckpt, prompt, overrides = None, None, {}
    for arg in args:
        if "=" not in arg:
            raise ValueError(f"argument {arg!r} is not key=value\n{USAGE}")
        key, value = arg.split("=", 1)
        if key == "ckpt":
            ckpt = value
        elif key == "prompt":
            prompt = value
        elif key in known:
            overrides[key] = yaml.safe_load(value)
        else:
            raise ValueError(
                f"unknown setting {key!r}: use ckpt=, prompt= or a GenerationConfig field "
                f"({', '.join(sorted(known))})"
            )
    if not ckpt:
        raise ValueError(f"ckpt= is required\n{USAGE}")
    if not Path(ckpt).is_file():
        raise ValueError(f"ckpt={ckpt!r} is not a file")
    return ckpt, prompt if prompt is not None else "\n", overrides


def build_tokenizer(spec: dict[str, Any] | None) -> Any:
    """The tokenizer described by the checkpoint (``_target_`` + options), bytes if none."""
    if not spec:
        from llmlab.tokenizer import ByteTokenizer

        return ByteTokenizer()
    from hydra.utils import instantiate

    return instantiate(spec, _convert_="all")


def load_checkpoint(path: str) -> tuple[torch.nn.Module, Any]:
    """The model and tokenizer of an ``llmlab.train`` checkpoint, on CPU, in eval mode."""
    from llmlab.parallel.checkpoint import consolidate, is_sharded, read_extra

    if is_sharded(path):  # each rank's shards (strategy.sharded_checkpoints): assembled here
        ckpt, state, prefix = read_extra(path) or {}, consolidate(path), ""
    else:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        state, prefix = ckpt.get("state_dict", {}), "model."
    hp = ckpt.get("hyper_parameters", {})
    if "model" not in hp:
        raise ValueError(f"{path} has no hyper_parameters['model']: not an llmlab.train checkpoint")
    if hp.get("lora"):  # a LoRA run: the base (from its folder), the adapters on it
        from llmlab.train.adapters import model_from_checkpoint

        model = model_from_checkpoint(hp["model"], hp["lora"], state, prefix)
        return model, build_tokenizer(hp.get("tokenizer"))
    return from_state_dict(hp["model"], state, prefix), build_tokenizer(hp.get("tokenizer"))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        ckpt, prompt, overrides = parse_args(args)
        model, tokenizer = load_checkpoint(ckpt)
        ids = tokenizer.encode(prompt)
        block = model.config.block_size
        compile_step = bool(overrides.pop("compile", False))
        settings = {**DEFAULTS, "sliding_window": block, **overrides}
        strategy = GenerationConfig(**{**settings, "sliding_window": None}).resolved_strategy()
        if "sliding_window" not in overrides and strategy not in ("greedy", "sample"):
            settings["sliding_window"] = None  # beam search stays within the context
        if not ids:
            raise ValueError("the prompt encodes to no tokens; give at least one character")
        if settings["sliding_window"] is None and len(ids) + settings["max_new_tokens"] > block:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens={settings['max_new_tokens']} "
                f"exceeds the model's block_size={block} (drop sliding_window=null to slide)"
            )
        if settings["sliding_window"] is not None and settings["sliding_window"] > block:
            raise ValueError(
                f"sliding_window={settings['sliding_window']} exceeds the model's "
                f"block_size={block}"
            )
        config = GenerationConfig(**settings)
        config.validate()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    input_ids = torch.tensor([ids])
    one_stream = config.num_return_sequences == 1 and config.num_beams == 1
    if one_stream:
        streamer = TextStreamer(tokenizer, skip_prompt=False, on_text=_print)
        generate(
            model, input_ids, config, streamer=streamer, tokenizer=tokenizer, compile=compile_step
        )
        print(flush=True)
    else:
        out = generate(model, input_ids, config, tokenizer=tokenizer, compile=compile_step)
        for i, row in enumerate(out.tolist()):
            print(f"--- sequence {i + 1}")
            print(tokenizer.decode(row), flush=True)
    return 0


def _print(text: str) -> None:
    print(text, end="", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
