"""``BucketedDataParallelStrategy``: data parallelism with our own gradient buckets and overlap.

What ``DistributedDataParallel`` does inside its C++ reducer, written out: parameters are grouped
into buckets of ``bucket_cap_mb`` (in reverse registration order, roughly the order backward
produces their gradients); a ``post_accumulate_grad`` hook marks each gradient ready; when a
bucket is full its gradients are flattened, divided by the world size and all-reduced
*asynchronously*, so the all-reduce of the last layers runs while autograd is still computing the
first layers' gradients. Backward ends by waiting for the outstanding buckets and copying the
averaged gradients back. Buckets are launched strictly in index order on every rank, so all ranks
issue the same collectives in the same order. On gradient-accumulation micro-batches no bucket is
launched (Lightning's ``block_backward_sync``), exactly like ``DDP.no_sync``.

``collective="torch"`` uses ``dist.all_reduce(async_op=True)``; ``"ring"``,
``"recursive_doubling"`` or ``"reduce_broadcast"`` run ``llmlab.parallel.comm`` on a background
thread (one thread, so buckets stay ordered) over a dedicated process group.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import Tensor, nn

from llmlab.parallel.buffers import FlatBuffer
from llmlab.parallel.comm import ALL_REDUCE_ALGORITHMS, CommStats, all_reduce
from llmlab.parallel.data.comm_intervals import CommTimeline
from llmlab.parallel.preflight import RunConfig, check_data_parallel

COLLECTIVES = ("torch", *ALL_REDUCE_ALGORITHMS)


class _Bucket:
    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.params = params
        self.buffer = FlatBuffer(params)
        self.ready: set[int] = set()
        self.future: Future | torch.futures.Future | None = None


class GradientBucketer:
    """Owns the buckets, the hooks, and the asynchronous all-reduces of one model's gradients."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        bucket_cap_mb: float,
        collective: str,
        group: dist.ProcessGroup | None,
        timeline: CommTimeline | None = None,
        stats: CommStats | None = None,
    ) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; valid: {list(COLLECTIVES)}")
        self.collective = collective
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.timeline = timeline if timeline is not None else CommTimeline()
        self.stats = stats
        self.enabled = True
        self.buckets = self._assign(list(params), int(bucket_cap_mb * 1024 * 1024))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch = 0
        self._executor = ThreadPoolExecutor(1, "llmlab-comm") if collective != "torch" else None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for p in self._bucket_of_params()
        ]
        self.launch_times: list[float] = []  # this step's bucket launches (perf_counter)

    def _bucket_of_params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    @staticmethod
    def _assign(params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters to synchronise")
        groups: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(trainable):  # backward produces the last layers' gradients first
            nbytes = p.numel() * p.element_size()
            if groups[-1] and (size + nbytes > cap_bytes or p.dtype != groups[-1][0].dtype):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        return [_Bucket(i, g) for i, g in enumerate(groups)]

    # ---------------------------------------------------------------- backward-time hooks
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        flat = bucket.buffer.pack([p.grad for p in bucket.params])
        flat.div_(self.world_size)  # average, as DDP does (divide before summing)
        start = time.perf_counter()
        self.launch_times.append(start)

        def done(_: Any, start: float = start) -> None:
            self.timeline.add(start, time.perf_counter())

        if self._executor is None:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            fut = work.get_future()
            fut.add_done_callback(done)
            bucket.future = fut
        else:
            fut = self._executor.submit(
                all_reduce, flat, self.collective, "sum", self.group, self.stats
            )
            fut.add_done_callback(done)
            bucket.future = fut

    # ---------------------------------------------------------------- end of backward
    def finish(self) -> None:
        """Wait for every bucket and write the averaged gradients back into ``param.grad``."""
        if self._next_launch != len(self.buckets):
            stuck = self.buckets[self._next_launch]
            missing = [i for i, p in enumerate(stuck.params) if id(p) not in stuck.ready]
            raise RuntimeError(
                f"bucket {stuck.index} never became ready: {len(missing)} of its parameters got "
                "no gradient this step. Bucketed data parallelism needs every trainable "
                "parameter to take part in the loss (freeze unused ones with requires_grad=False)"
            )
        for bucket in self.buckets:
            if isinstance(bucket.future, Future):
                bucket.future.result()  # our collective on the comm thread (re-raises its error)
            else:
                bucket.future.wait()  # torch's async all-reduce
            bucket.buffer.unpack_into([p.grad for p in bucket.params])
            bucket.ready.clear()
            bucket.future = None
        self._next_launch = 0

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
        self._next_launch = 0
        self.launch_times = []

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._executor is not None:
            self._executor.shutdown(wait=True)


class BucketedDataParallelStrategy(DDPStrategy):
    """Lightning DDP without the ``DistributedDataParallel`` wrapper: our buckets do the sync.

    Everything else (process-group set-up, launch, sampler kwargs, checkpoints) is Lightning's
    ``DDPStrategy``. ``comm_timeline``, ``bucketer.launch_times``, ``backward_start`` and
    ``backward_compute_end`` expose the measured overlap.
    """

    strategy_name = "bucketed"  # L.Trainer(strategy="bucketed"), the README's and conf's name

    def __init__(self, bucket_cap_mb: float = 25.0, collective: str = "torch", **kwargs: Any):
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; valid: {list(COLLECTIVES)}")
        super().__init__(**kwargs)
        self.bucket_cap_mb = bucket_cap_mb
        self.collective = collective
        self.comm_timeline = CommTimeline()
        self.comm_stats = CommStats()
        self.bucketer: GradientBucketer | None = None
        self.backward_start: float | None = None
        self.backward_compute_end: float | None = None
        self._sync_grads = True

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="llmlab bucketed data parallelism (overlapped)"
        )

    @classmethod
    def check_config(cls, options: Mapping[str, Any], run: RunConfig) -> None:
        """The constructor's checks and the global batch split over every rank (compile=true
        was checked with it: tests/parallel/test_compile.py)."""
        cls(**options)
        check_data_parallel(run)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        # Replicas must start equal: DDP broadcasts rank 0's parameters and buffers in its
        # constructor; we do the same, then hook the gradients.
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
        group = dist.new_group(backend="gloo") if self.collective != "torch" else None
        self.bucketer = GradientBucketer(
            model.parameters(),
            self.bucket_cap_mb,
            self.collective,
            group,
            timeline=self.comm_timeline,
            stats=self.comm_stats,
        )
        return model

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient-accumulation micro-batches: accumulate locally, launch nothing."""
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = True

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        bucketer = self.bucketer
        self.backward_start = time.perf_counter()
        if bucketer is not None:
            bucketer.enabled = self._sync_grads
            bucketer.reset()
        self.precision_plugin.backward(
            closure_loss, self.lightning_module, optimizer, *args, **kwargs
        )
        self.backward_compute_end = time.perf_counter()
        if bucketer is not None and self._sync_grads:
            bucketer.finish()  # the only place a rank waits on communication
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def teardown(self) -> None:
        if self.bucketer is not None:
            self.bucketer.close()
            self.bucketer = None
        super().teardown()


if BucketedDataParallelStrategy.strategy_name not in StrategyRegistry:
    BucketedDataParallelStrategy.register_strategies(StrategyRegistry)
