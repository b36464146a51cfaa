"""``torch.compile`` as a model transform: each repeated block compiled on its own, plus the loss.

Compiling block by block (torchtitan's choice) rather than the whole model keeps every strategy's
view of the model intact: the module tree, parameter names and state-dict keys are unchanged
(``nn.Module.compile`` compiles a module's ``forward`` in place instead of wrapping it in an
``OptimizedModule`` with ``_orig_mod.`` keys), so checkpoints, DDP's gradient hooks and the
model summary see the plain model. All blocks share one ``forward`` code object and dynamo
inlines ``nn.Module`` calls, so the first block's graph serves the others: compile cost is paid
once, not per block.

Compilation is lazy: it happens during the first forward (and the first backward compiles the
backward graph). :class:`CompileMonitor` therefore reads dynamo's own timers after the first
steps, logs ``perf/compile_seconds`` once, and afterwards counts the graphs dynamo adds; a graph
compiled after ``warmup_steps`` is a recompilation (a changed shape, dtype or guard) that costs
seconds each time, so it is logged (``perf/recompiles``) and warned about.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn

from llmlab.parallel.contracts import HasRepeatedBlocks, require


def compile_blocks(model: nn.Module, **options: Any) -> int:
    """Compile each of ``model.repeated_blocks()`` in place; return how many were compiled.

    ``options`` go to ``torch.compile`` (``mode``, ``fullgraph``, ``dynamic``, ``backend``).
    Raises when the model has no repeated blocks: a compile that compiled nothing is an error,
    never a silent no-op.
    """
    blocks = require(model, HasRepeatedBlocks, "compile").repeated_blocks()
    if not blocks:
        raise ValueError(f"{type(model).__name__}.repeated_blocks() is empty: nothing to compile")
    for block in blocks:
        block.compile(**options)
    return len(blocks)


def compile_loss(loss_fn: Callable[..., torch.Tensor], **options: Any) -> Callable:
    """``torch.compile(loss_fn)``: the cross-entropy's log-softmax, gather and mean fuse into one
    pass over the logits, which for a small model are the largest activation."""
    return torch.compile(loss_fn, **options)


def compile_refusal(strategy: str) -> str:
    """Why ``compile=true`` is refused with ``strategy``: each strategy's ``check_config`` says
    whether compile was checked with it (one process, DDP, bucketed and the N-D strategy with
    its presets were, in tests/parallel/test_compile.py and the composition matrix)."""
    return (
        f"compile=true is not supported with strategy {strategy}: only auto (one process), ddp, "
        "bucketed and the N-D strategy (nd, pipeline, tensor) were checked to match eager "
        "training; use one of those, or compile=false"
    )


def log_once(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Send ``metrics`` to the loggers at the current step, once, from rank zero.

    ``LightningModule.log`` would keep re-sending the value at every later step.
    """
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def _compile_seconds() -> float:
    """Wall time dynamo and inductor spent compiling so far (forward and backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileMonitor(L.Callback):
    """Logs ``perf/compile_seconds`` once after ``warmup_steps`` optimizer steps, then counts
    graphs compiled later as recompilations (``perf/recompiles``) and warns at each new one.

    The warm-up covers the first training steps (forward and backward graphs) and the first
    validation run (eval mode and no-grad are separate graphs); compile time is cumulative over
    the process, which is what a user waits for.
    """

    def __init__(self, warmup_steps: int = 3) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be a positive integer, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.compile_seconds: float | None = None
        self.recompiles = 0
        self._expected: int | None = None  # graphs compiled during warm-up (and first validation)
        self._val_start: int | None = None
        self._validated = False
        self._steps = 0  # batches trained in this fit (a resumed run starts at a later step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._validated and not trainer.sanity_checking:
            self._val_start = _graphs()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val_start is not None:  # the first validation's eval graphs are warm-up too
            self._validated = True
            if self._expected is not None:
                self._expected += _graphs() - self._val_start
            self._val_start = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        self._steps += 1
        if self._expected is None:
            if self._steps >= self.warmup_steps:
                self.compile_seconds = _compile_seconds()
                self._expected = _graphs()
                log_once(trainer, {"perf/compile_seconds": self.compile_seconds})
            return
        new = _graphs() - self._expected
        if new > self.recompiles:
            warnings.warn(
                f"torch.compile recompiled {new - self.recompiles} graph(s) at step {step} "
                f"({new} since the first {self.warmup_steps} steps of this run): a shape, dtype "
                "or mode changed; set TORCH_LOGS=recompiles to see which guard failed",
                stacklevel=1,
            )
            self.recompiles = new
            log_once(trainer, {"perf/recompiles": float(new)})
