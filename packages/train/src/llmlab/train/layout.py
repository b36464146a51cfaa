"""The parallel layout a config asks for, checked against the world, the batch and the model.

Every number here is in the config, so a layout that cannot work is refused before any process
starts -- not ~40 s later by every rank at once. The model's side comes through the contracts of
``llmlab.parallel.contracts`` (``tensor_parallel_divisors()``, ``pipeline_layers()``), read from
a copy built on the ``meta`` device (no memory, no initialisation).

The strategy keys are read in both spellings: the N-D strategy's ``data``, ``pipeline``,
``tensor``, ``virtual_stages``, ``microbatches``, and today's ``stages`` for the pipeline degree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmlab.parallel.contracts import tensor_parallel_problems


@dataclass(frozen=True)
class Layout:
    """Ranks as data × pipeline × tensor (+ ``servers`` that hold no data, as a parameter
    server's); ``data=None`` takes what the world leaves."""

    world_size: int
    data: int | None = None
    pipeline: int = 1
    tensor: int = 1
    virtual_stages: int = 1
    microbatches: int = 1
    servers: int = 0

    @property
    def model_parallel(self) -> int:
        return self.pipeline * self.tensor

    @property
    def data_parallel(self) -> int:
        """The data degree, given or inferred (0 when the world does not divide)."""
        if self.data is not None:
            return self.data
        workers = self.world_size - self.servers
        return workers // self.model_parallel if workers % self.model_parallel == 0 else 0


def layout_from_config(strategy: Mapping[str, Any], devices: int, num_nodes: int = 1) -> Layout:
    """The layout a strategy config asks for on ``devices × num_nodes`` ranks."""
    both = strategy.get("pipeline"), strategy.get("stages")
    if None not in both and both[0] != both[1]:
        raise ValueError(
            f"strategy.pipeline={both[0]!r} and strategy.stages={both[1]!r} are two spellings "
            "of the pipeline degree; set one"
        )
    pipeline = strategy.get("pipeline", strategy.get("stages"))
    virtual = strategy.get("virtual_stages")
    if virtual is None:  # PipelineStrategy's default: 2 chunks per rank when interleaved
        virtual = 2 if strategy.get("schedule") == "interleaved" else 1
    return Layout(
        world_size=devices * num_nodes,
        data=strategy.get("data"),
        pipeline=1 if pipeline is None else pipeline,
        tensor=strategy.get("tensor") or 1,
        virtual_stages=virtual,
        microbatches=(strategy.get("microbatches") or 1) if pipeline else 1,
        servers=strategy.get("num_servers") or 0,
    )


def spelling_of(strategy: Mapping[str, Any]) -> dict[str, str]:
    """The config names to use in messages: ``strategy.stages`` where the config says so."""
    if "pipeline" not in strategy and "stages" in strategy:
        return {"pipeline": "strategy.stages"}
    return {}


def layout_problems(
    layout: Layout,
    global_batch: int | None = None,
    pipeline_layers: int | None = None,
    tensor_divisors: Mapping[str, int] | None = None,
    spelling: Mapping[str, str] | None = None,
) -> list[str]:
    """Why ``layout`` cannot run, one message per problem (empty when it can).

    ``global_batch``: ``data.batch_size``; ``pipeline_layers``: ``len(model.pipeline_layers())``;
    ``tensor_divisors``: ``model.tensor_parallel_divisors()``; ``spelling``: config names of the
    dimensions for the messages (``{"pipeline": "strategy.stages"}``).
    """
    sizes = {
        "data": layout.data,
        "pipeline": layout.pipeline,
        "tensor": layout.tensor,
        "virtual_stages": layout.virtual_stages,
        "microbatches": layout.microbatches,
    }
    name = {k: f"strategy.{k}" for k in sizes} | dict(spelling or {})
    bad = [
        f"{name[k]}={v!r} must be a positive integer"
        for k, v in sizes.items()
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1)
    ]
    if bad:
        return bad
    problems = []
    world, servers, mp = layout.world_size, layout.servers, layout.model_parallel
    ranks = "trainer.devices × trainer.num_nodes"
    workers = world - servers
    server_note = f" minus {servers} server rank(s)" if servers else ""
    if layout.data is not None and layout.data * mp != workers:
        problems.append(
            f"{name['data']} ({layout.data}) × {name['pipeline']} ({layout.pipeline}) × "
            f"{name['tensor']} ({layout.tensor}) = {layout.data * mp} ranks, but {ranks}"
            f"{server_note} = {workers}"
        )
    elif layout.data is None and (workers < 1 or workers % mp):
        problems.append(
            f"{ranks}{server_note} = {workers} is not divisible by {name['pipeline']} "
            f"({layout.pipeline}) × {name['tensor']} ({layout.tensor}) = {mp}; use a multiple "
            f"of {mp} ranks"
        )
    data = layout.data_parallel
    if global_batch is not None and data:
        split = data * layout.microbatches
        if global_batch % split:
            what = f"{data} data-parallel replica(s)"
            if layout.microbatches > 1:
                what += f" × {layout.microbatches} micro-batches"
            problems.append(
                f"data.batch_size={global_batch} (global) cannot be split into {what} = "
                f"{split} equal parts; use a multiple of {split}"
            )
    stages = layout.pipeline * layout.virtual_stages
    if pipeline_layers is not None and layout.pipeline > 1 and pipeline_layers < stages:
        problems.append(
            f"the model has {pipeline_layers} pipeline layers (model.pipeline_layers()), fewer "
            f"than {name['pipeline']} ({layout.pipeline}) × {name['virtual_stages']} "
            f"({layout.virtual_stages}) = {stages} stages; every stage needs at least one"
        )
    if tensor_divisors is not None and layout.tensor > 1:
        problems += [
            f"model.{p.replace('tensor=', name['tensor'] + '=')}"
            for p in tensor_parallel_problems(dict(tensor_divisors), layout.tensor)
        ]
    return problems
