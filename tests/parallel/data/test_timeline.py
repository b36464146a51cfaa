"""Interval arithmetic behind "communication hidden under backward"."""

from llmlab.parallel.data.comm_intervals import CommTimeline, clip, union_length


def test_union_merges_overlaps_and_keeps_gaps() -> None:
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert union_length([]) == 0.0


def test_clip_keeps_only_the_window() -> None:
    assert clip([(0.0, 2.0), (3.0, 4.0), (5.0, 9.0)], 1.0, 6.0) == [
        (1.0, 2.0),
        (3.0, 4.0),
        (5.0, 6.0),
    ]


def test_timeline_drain_empties() -> None:
    t = CommTimeline()
    t.add(0.0, 1.0)
    assert t.drain() == [(0.0, 1.0)] and t.drain() == []
