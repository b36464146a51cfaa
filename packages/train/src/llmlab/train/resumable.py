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
        indices = list(super().__iter__())
        if self._resume is not None and self._resume[0] == self.epoch:
            indices = indices[self._resume[1] :]
            self._resume = None
        return iter(indices)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a ``ResumableSampler`` whose state is the trainer's progress.

    ``progress()`` returns ``(epoch, batches of that epoch finished)``; the loader cannot count
    this itself because Lightning fetches one batch ahead of the one being trained on.
    """

    def __init__(self, *args: Any, progress: Callable[[], tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler):
            raise TypeError(
                f"ResumableDataLoader needs a ResumableSampler, got {type(self.sampler).__name__}"
            )
        self.progress = progress

    def state_dict(self) -> dict[str, int]:
        epoch, batches_done = self.progress()
        return {"epoch": int(epoch), "batches_done": int(batches_done)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        batches_done = int(state["batches_done"])
        if 0 < batches_done < len(self):  # a finished epoch resumes at the next one's start
            assert isinstance(self.sampler, ResumableSampler) and self.batch_size is not None
            self.sampler.resume_at(int(state["epoch"]), batches_done * self.batch_size)
