"""The small things many tests build: a tiny GPT, its token batches, a tiny task, quiet Trainers.

Each was copied into several test files before; here each is written once, with the numbers the
tests' tolerances were written for. Everything is overridable by keyword, so a test states only
what differs. Lightning is imported inside the functions: the distributed tests re-import their
module in every spawned rank, and the ranks that never build a ``Trainer`` should not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    import lightning as L

    from llmlab.models import GPT
    from llmlab.train.task import CausalLMTask

#: The tiny GPT of the parallel tests: 2 layers of width 32, 2 heads, a 64-token vocabulary.
TINY_GPT: dict[str, Any] = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def tiny_gpt_config(**overrides: Any) -> dict[str, Any]:
    """``TINY_GPT`` with ``overrides`` applied: a fresh dict, as ``CausalLMTask(model=...)`` and
    ``GPTConfig(**...)`` take it."""
    return {**TINY_GPT, **overrides}


def tiny_gpt(seed: int = 0, **overrides: Any) -> GPT:
    """A ``GPT`` of ``tiny_gpt_config(**overrides)``, its weights drawn after ``manual_seed(seed)``
    so that every rank and the single-process oracle start from the same parameters."""
    from llmlab.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(**tiny_gpt_config(**overrides)))


def token_batch(
    rows: int = 8, seed: int = 1, vocab_size: int = 64, seq: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` random sequences as (inputs, next-token targets), each ``seq`` long."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (rows, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of (B, T, V) logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_task(
    model: dict[str, Any] | None = None, seed: int = 0, seed_all: bool = True, **task: Any
) -> CausalLMTask:
    """The real ``CausalLMTask`` on ``model`` (default ``TINY_GPT``), its weights drawn after
    seeding; ``task`` overrides lr 1e-2, 2 warm-up steps, 20 steps.

    ``seed_all``: ``L.seed_everything(seed)``, which also sets ``PL_GLOBAL_SEED`` so that
    Lightning re-seeds every rank when ``fit`` sets up; ``False``: ``torch.manual_seed`` only.
    """
    import lightning as L

    from llmlab.train.task import CausalLMTask

    if seed_all:
        L.seed_everything(seed)
    else:
        torch.manual_seed(seed)
    settings = dict(lr=1e-2, warmup_steps=2, max_steps=20)
    return CausalLMTask(model=dict(model or TINY_GPT), **{**settings, **task})


def pad_targets(targets: torch.Tensor, batch: int) -> torch.Tensor:
    """``targets`` with row ``j`` of each global batch of ``batch`` rows ending in ``2j mod T``
    ignored targets (``-100``): ranks, micro-batches and context pieces count unequal tokens."""
    targets = targets.clone()
    seq = targets.shape[1]
    for row in range(len(targets)):
        cut = (2 * (row % batch)) % seq
        targets[row, seq - cut :] = -100
    return targets


def tiny_tokens(
    train_batches: int,
    val_batches: int = 2,
    batch: int = 8,
    vocab_size: int = 64,
    seq: int = 16,
    padded: bool = False,
) -> L.LightningDataModule:
    """Fixed random token batches in a fixed order, sharded by the data-parallel rank.

    Every epoch is ``train_batches`` global batches of ``batch`` rows (seed 0; validation: seed
    1); a data-parallel replica reads its contiguous share of each global batch, asking the
    strategy's ``distributed_sampler_kwargs`` which one it is, so any layout sees the same
    global batches as one process does. ``padded``: targets ignored by :func:`pad_targets`.
    """
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class TinyTokens(L.LightningDataModule):
        batch_size = batch  # global, as TextDataModule's (the N-D strategy checks it)

        def _loader(self, steps: int, seed: int) -> DataLoader:
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, vocab_size, (steps * batch, seq + 1), generator=g)
            targets = pad_targets(ids[:, 1:], batch) if padded else ids[:, 1:]
            kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
            replicas, rank = kwargs.get("num_replicas", 1), kwargs.get("rank", 0)
            share = batch // replicas
            rows = [b * batch + rank * share + i for b in range(steps) for i in range(share)]
            inputs, targets = ids[rows, :-1], targets[rows]
            return DataLoader(TensorDataset(inputs, targets), batch_size=share)

        def train_dataloader(self) -> DataLoader:
            return self._loader(train_batches, 0)

        def val_dataloader(self) -> DataLoader:
            return self._loader(val_batches, 1)

    return TinyTokens()


def romeo_loader(batch_size: int = 4) -> torch.utils.data.DataLoader:
    """20 (input, next-byte target) windows of 16 bytes over a repeated line of Romeo and
    Juliet: enough for a byte-level task to train a few steps and save a real checkpoint."""
    text = torch.tensor(list(b"ROMEO: hello there, fair Juliet.\n" * 8))
    x = torch.stack([text[i : i + 16] for i in range(0, 160, 8)])
    y = torch.stack([text[i + 1 : i + 17] for i in range(0, 160, 8)])
    return torch.utils.data.DataLoader(list(zip(x, y)), batch_size=batch_size)


def loss_recorder(losses: list[float]) -> L.Callback:
    """A callback that appends each training step's loss (as a float) to ``losses``."""
    import lightning as L

    class RecordLoss(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    return RecordLoss()


def quiet_trainer(**settings: Any) -> L.Trainer:
    """A one-device CPU ``Trainer`` that writes and prints nothing of its own: no logger, no
    checkpoint callback, no progress bar, no model summary. ``settings`` override any of these
    (``logger=CSVLogger(...)``, ``enable_checkpointing=True`` with a ``ModelCheckpoint``)."""
    import lightning as L

    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **settings})


def rank_trainer(strategy: Any, devices: int, max_steps: int, **settings: Any) -> L.Trainer:
    """``quiet_trainer`` for a strategy test running inside ``run_distributed``'s gloo ranks.

    Lightning would re-launch ``sys.argv`` for a DDP-like strategy (under pytest: the whole test
    session). Each rank already has its process group and ``LOCAL_RANK``/``RANK``/``WORLD_SIZE``,
    so the strategy gets ``LightningEnvironment``, which reports the processes as created
    externally, and Lightning runs in place on that group. The data are sharded by the tests
    themselves (``use_distributed_sampler=False``) so every layout sees the same global batches.
    """
    from lightning.pytorch.plugins.environments import LightningEnvironment

    if getattr(strategy, "cluster_environment", False) is None:
        strategy.cluster_environment = LightningEnvironment()
    return quiet_trainer(
        **{
            "devices": devices,
            "strategy": strategy,
            "max_steps": max_steps,
            "use_distributed_sampler": False,
            **settings,
        }
    )
