"""Stepping an engine through a scripted arrival pattern, shared by the exactness tests."""

from __future__ import annotations

from llmlab.serving import LLMEngine


def drive(engine: LLMEngine, arrivals: dict[int, list[tuple]]) -> dict[str, list[list[int]]]:
    """Add ``arrivals[step]`` = [(id, prompt, config), ...] before each step; run to the end."""
    done: dict[str, list[list[int]]] = {}
    step = 0
    while engine.has_unfinished or any(k >= step for k in arrivals):
        for rid, prompt, config in arrivals.get(step, []):
            engine.add_request(rid, prompt, config)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [
                    o.token_ids for o in sorted(out.outputs, key=lambda o: o.index)
                ]
        step += 1
        assert step < 2000
    return done
