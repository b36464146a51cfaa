"""``SampleCallback``: every N validation runs, continue a few prompts and log the text.

Loss curves say how well a model fits; a handful of continuations say what it has learned
(spelling, line breaks, speaker names in Shakespeare). On rank zero only, after every
``every_n_val``-th validation run (the sanity check excluded), it decodes ``prompts`` with
``llmlab.decoding.generate`` and logs them as a W&B table (``samples``: step, prompt,
continuation) when the logger is a ``WandbLogger``, and always appends them to
``<run dir>/samples.txt``. A model that does not follow the decoding contract any more (split
into pipeline stages on this rank) is skipped with a one-time warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from llmlab.decoding import GenerationConfig, generate


class SampleCallback(L.Callback):
    def __init__(
        self,
        prompts: list[str] | tuple[str, ...] = ("\n",),
        every_n_val: int = 1,
        max_new_tokens: int = 64,
        do_sample: bool = True,
        temperature: float = 0.8,
        top_k: int = 50,
        seed: int = 0,
    ) -> None:
        if every_n_val < 1:
            raise ValueError(f"every_n_val must be >= 1, got {every_n_val}")
        if not prompts:
            raise ValueError("prompts must hold at least one prompt")
        self.prompts = list(prompts)
        self.every_n_val = every_n_val
        self.config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
        )
        self.config.validate()
        self.val_runs = 0
        self._tokenizer: Any = None
        self._warned = False

    def _get_tokenizer(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        if self._tokenizer is None:
            datamodule = getattr(trainer, "datamodule", None)
            self._tokenizer = getattr(datamodule, "tokenizer", None)
            if self._tokenizer is None:
                from llmlab.train.sample import build_tokenizer

                self._tokenizer = build_tokenizer(pl_module.hparams.get("tokenizer"))
        return self._tokenizer

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.val_runs += 1
        if self.val_runs % self.every_n_val or not trainer.is_global_zero:
            return
        model = pl_module.model
        if not hasattr(model, "new_cache"):
            if not self._warned:
                warnings.warn(
                    "SampleCallback: model has no new_cache(); not sampling", stacklevel=2
                )
                self._warned = True
            return
        rows = self.sample(model, self._get_tokenizer(trainer, pl_module))
        step = trainer.global_step
        self._write(trainer, step, rows)

    def sample(self, model: torch.nn.Module, tokenizer: Any) -> list[tuple[str, str]]:
        """(prompt, continuation) for every prompt, decoded with the callback's config."""
        was_training = model.training
        model.eval()
        block = getattr(getattr(model, "config", None), "block_size", None)
        rows = []
        try:
            for prompt in self.prompts:
                ids = tokenizer.encode(prompt)
                config = self.config
                if block is not None:
                    config = config.replace(
                        max_new_tokens=max(1, min(config.max_new_tokens, block - len(ids)))
                    )
                device = next(model.parameters()).device
                out = generate(model, torch.tensor([ids], device=device), config)
                rows.append((prompt, tokenizer.decode(out[0, len(ids) :].tolist())))
        finally:
            model.train(was_training)
        return rows

    def _write(self, trainer: L.Trainer, step: int, rows: list[tuple[str, str]]) -> None:
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_text(
                    key="samples",
                    columns=["step", "prompt", "continuation"],
                    data=[[step, p, c] for p, c in rows],
                    step=step,
                )
        path = Path(trainer.default_root_dir) / "samples.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for prompt, continuation in rows:
                f.write(f"=== step {step} | prompt {prompt!r}\n{prompt}{continuation}\n")
