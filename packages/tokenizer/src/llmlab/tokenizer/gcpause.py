"""Pausing Python's cyclic garbage collector around allocation-heavy loops.

Training and batch encoding allocate hundreds of thousands of containers (the trainer's sets, one
id list per text, a cache of id lists) that form no reference cycles. Every so many allocations
the collector walks all tracked containers of the older generations, so its cost grows with what
is already alive: it took a quarter of the merge loop and 40 % of a warm-cache batch encode on the
9.6 MB benchmark corpus. Nothing here creates cycles, so pausing it changes nothing but the time;
``gc.collect`` still works, and the collector resumes (if it was on) on the way out.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector for the ``with`` block, then restore its previous state."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
