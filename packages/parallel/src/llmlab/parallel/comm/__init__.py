"""Collectives from point-to-point messages, their byte counts and their α-β cost model."""

from llmlab.parallel.comm.chunks import chunk_bounds, chunk_sizes
from llmlab.parallel.comm.collectives import (
    ALL_REDUCE_ALGORITHMS,
    all_gather,
    all_reduce,
    broadcast,
    recursive_doubling_all_reduce,
    reduce,
    reduce_broadcast_all_reduce,
    reduce_scatter,
    ring_all_reduce,
)
from llmlab.parallel.comm.cost import (
    bus_bandwidth,
    elements_sent,
    fit_alpha_beta,
    predicted_time,
)
from llmlab.parallel.comm.p2p import CommStats, Peer

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "CommStats",
    "Peer",
    "all_gather",
    "all_reduce",
    "broadcast",
    "bus_bandwidth",
    "chunk_bounds",
    "chunk_sizes",
    "elements_sent",
    "fit_alpha_beta",
    "predicted_time",
    "recursive_doubling_all_reduce",
    "reduce",
    "reduce_broadcast_all_reduce",
    "reduce_scatter",
    "ring_all_reduce",
]
