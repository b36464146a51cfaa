"""What one optimizer step of the N-D strategy moved between ranks, per dimension: ``comm/*``.

* ``comm/tp_bytes`` (and ``tp_wire_bytes``, ``tp_<kind>_bytes``): every tensor-parallel
  collective's payload, recorded into a :class:`~llmlab.parallel.tensor.accounting.CommLedger`
  while the step runs (``recording``);
* ``comm/pp_bytes``: activations and gradients sent to other stages, plus the tied-weight
  all-reduce across stages;
* ``comm/dp_bytes``: the gradient all-reduce over the data group (data × context with context
  parallelism), or ZeRO's reduce-scatters and all-gathers;
* ``comm/cp_bytes``: ring attention's key/value chunks and their gradients
  (:func:`~llmlab.parallel.context.accounting.cp_bytes` per micro-batch);
* ``comm/ep_bytes``: expert parallelism's all-to-alls (rows to other ranks' experts and back,
  their gradients, the counts; the formula is in :mod:`llmlab.parallel.expert`).

Counts are per rank and per optimizer step (payload bytes, not what the wire carries).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from llmlab.parallel.tensor.accounting import CommLedger, record_into


class StepComm:
    """Accumulates one step's byte counts; :meth:`metrics` reports and resets them.

    ``counting``: a data-sharding engine's own counter of the collectives it launches (FSDP2's:
    they run inside torch, not through llmlab's code), entered with :meth:`recording`.
    """

    def __init__(self, counting: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        self.ledger = CommLedger()
        self.pp_bytes = 0
        self.dp_bytes = 0
        self.counting = counting or nullcontext
        self.cp_bytes = 0
        self.ep_bytes = 0

    @contextmanager
    def recording(self) -> Generator[None, None, None]:
        """Tensor-parallel collectives (and the engine's, with ``counting``) inside are counted."""
        with record_into(self.ledger), self.counting():
            yield

    def take_step(self, reducer: Any, strategy: Any) -> None:
        """Add what the gradient ``reducer`` and ``strategy``'s mechanisms (an
        ``NDParallelStrategy``'s ring attention, expert dispatch, pipeline transport,
        data-sharding engine) counted this step, and reset their counters."""
        from llmlab.parallel.context.step import take_cp_bytes

        self.pp_bytes += reducer.tied_bytes
        self.dp_bytes += reducer.data_bytes
        reducer.reset_counts()
        self.cp_bytes += take_cp_bytes(strategy.context)
        parallel = strategy.parallel
        if parallel is not None and parallel.expert is not None:
            self.ep_bytes += parallel.expert.stats.take()
        if strategy.pipeline_step is not None:
            self.pp_bytes += strategy.pipeline_step.take_bytes_sent()
        if strategy.zero_engine is not None:
            self.dp_bytes += strategy.zero_engine.take_comm_bytes()

    def metrics(self) -> dict[str, float]:
        """The step's ``comm/*`` totals; the counts start again from zero."""
        ledger = self.ledger
        out = {
            "comm/tp_bytes": float(ledger.total_bytes),
            "comm/tp_wire_bytes": float(ledger.total_wire_bytes),
            **{f"comm/tp_{kind}_bytes": float(v) for kind, v in ledger.totals().items()},
            "comm/pp_bytes": float(self.pp_bytes),
            "comm/dp_bytes": float(self.dp_bytes),
            "comm/cp_bytes": float(self.cp_bytes),
            "comm/ep_bytes": float(self.ep_bytes),
        }
        ledger.clear()
        self.pp_bytes = self.dp_bytes = self.cp_bytes = self.ep_bytes = 0
        return out
