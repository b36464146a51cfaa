"""Mid-epoch resume without replaying data: a sampler and a loader that Lightning checkpoints.

A plain ``DataLoader`` restarts its epoch from the first batch when a run resumes from a
checkpoint taken part-way through the epoch, so the resumed run trains on batches it has
already seen and never sees the rest (Lightning warns about exactly this). Lightning saves the
state of any train loader that has ``state_dict`` / ``load_state_dict`` with the fit loop, so the
loader below records *how many batches of which epoch the trainer has finished*, and on load the
sampler starts that epoch after them. Because the sampler's permutation depends only on the
seed and the epoch, the resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` whose pass over one given epoch can start at a sample offset."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume: tuple[int, int] | None = None  # (epoch, samples of it already used)

    def resume_at(self, epoch: int, samples_done: int) -> None:
        """Make the next pass over ``epoch`` skip its first ``samples_done`` samples."""
        self._resume = (epoch, samples_done)

    def __iter__(self) -> Iterator[int]:
        skip = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            skip, self._resume = self._resume[1], None
        if not self.drop_last:  # padded by repeating indices: DistributedSampler's own list
            return iter(list(super().__iter__())[skip:])
        # DistributedSampler's indices, ``order[:total_size][rank::replicas]``, without a Python
        # list of the whole epoch: unshuffled they are a range, shuffled a slice of a tensor.
        first, step = self.rank + skip * self.num_replicas, self.num_replicas
        if not self.shuffle:
            return iter(range(first, self.total_size, step))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=g)  # type: ignore[arg-type]
        return iter(order[first : self.total_size : step].tolist())


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a ``ResumableSampler`` whose state is the trainer's progress.

    ``progress()`` returns ``(epoch, batches of that epoch finished)``; the loader cannot count
    this itself because Lightning fetches one batch ahead of the one being trained on.
    """

    def __init__(
        self,
        *args: Any,
        progress: Callable[[], tuple[int, int]],
        identity: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler):
            raise TypeError(
                f"ResumableDataLoader needs a ResumableSampler, got {type(self.sampler).__name__}"
            )
        self.progress = progress
        self.identity = identity

    def state_dict(self) -> dict[str, Any]:
        epoch, batches_done = self.progress()
        state: dict[str, Any] = {"epoch": int(epoch), "batches_done": int(batches_done)}
        if self.identity is not None:
            state["identity"] = self.identity
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume after ``state["batches_done"]`` global batches of ``state["epoch"]``.

        ``identity`` (what decides the order of the batches: the data, the seed, the global
        batch size) must match the checkpoint's, or the position would point elsewhere: a
        mismatch is refused, naming what changed. The number of replicas may differ.
        """
        saved = state.get("identity")
        if self.identity is not None and saved is not None and saved != self.identity:
            changed = sorted(
                k for k in {*saved, *self.identity} if saved.get(k) != self.identity.get(k)
            )
            raise ValueError(
                "cannot resume the data position: the checkpoint's data differ in "
                + ", ".join(f"{k} ({saved.get(k)!r} -> {self.identity.get(k)!r})" for k in changed)
                + "; resume with the run's data settings or start a new run"
            )
        batches_done = int(state["batches_done"])
        if 0 < batches_done < len(self):  # a finished epoch resumes at the next one's start
            assert isinstance(self.sampler, ResumableSampler) and self.batch_size is not None
            self.sampler.resume_at(int(state["epoch"]), batches_done * self.batch_size)
