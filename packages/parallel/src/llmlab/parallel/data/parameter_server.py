"""``ParameterServerStrategy``: server ranks own parameter shards and run the optimizer.

Ranks ``0..W-1`` are workers (rank 0 logs and checkpoints, as usual), ranks ``W..W+S-1`` are
servers. Every rank builds the full LightningModule and its optimizer (so Lightning's optimizer,
LR schedule and gradient clipping are reused unchanged), but only a server ever calls
``optimizer.step()``, and only for the parameters it owns (others have ``grad=None``, which
AdamW skips). Parameters are spread over servers by size (largest first, to the least loaded).

Per optimizer step, a worker runs forward/backward on its shard of the batch, *pushes* each
server's slice of the gradients and *pulls* that server's fresh parameters.

* ``mode="sync"``: a server waits for all W gradients, averages them in worker order, clips, steps
  once and sends the same parameters to everyone: mathematically the same update as data-parallel
  SGD (the test checks it against Lightning DDP to 1e-6).
* ``mode="async"``: a server applies each gradient as it arrives (any-source receive) and replies
  to that worker alone, so fast workers do not wait for slow ones. Staleness is bounded the
  stale-synchronous-parallel way: a worker's push is served only while it is at most
  ``max_staleness`` steps ahead of the slowest unfinished worker; the slowest is always
  eligible, so this cannot deadlock. A gradient's *measured* staleness is the number of server
  updates between the pull its parameters came from and its own application. Arrival order
  depends on timing, so **async runs are not deterministic**.

Servers hold no data: ``distributed_sampler_kwargs`` reports ``W`` replicas and a worker's index
(servers read replica 0's loader only to keep Lightning's loop length; they never run the model
on it). Before validation and at the end of training the owners broadcast their parameters, so
every rank evaluates and checkpoints the current model. A checkpoint holds the servers' current
parameters and their optimizer state (each server's AdamW moments for the parameters it owns,
gathered onto rank 0), so a resumed run continues exactly.

Gradient norm: in sync mode every server takes the norm of its shard of the averaged gradient
and the servers all-reduce the squares among themselves, so clipping by norm uses the whole
model's norm, as one process does, however many servers there are; the replies carry that norm
back and the workers log it as ``train/grad_norm``. In async mode the servers step on their own
schedules, so no whole-model gradient exists: clipping by norm with several async servers is
refused at set-up (one server, ``mode=sync`` or clipping by value work). The master-weight
precision plugins (fp16 with loss scaling, bf16 with fp32 masters) step in ``optimizer_step``,
which servers do not run, so they are rejected at set-up (autocast bf16 and fp8 work).

Where the bytes live: messages are packed on the parameters' device (a ``FlatBuffer`` of the
gradients and the version number, so nothing assumes a device), then staged through host
memory, ``WIRE``: the servers' own group is gloo on every machine, because the async server's
any-source receive exists on gloo and not on NCCL.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel.buffers import FlatBuffer
from llmlab.parallel.compile import compile_refusal
from llmlab.parallel.data.comm_intervals import CommTimeline
from llmlab.parallel.loss_mean import LossReplicas
from llmlab.parallel.mesh import ParallelDims, check_layout
from llmlab.parallel.norm import clip_by_total_norm_, global_grad_norm
from llmlab.parallel.precision.plugins import MasterWeightPrecision
from llmlab.parallel.preflight import RunConfig

WIRE = torch.device("cpu")  # the PS group's device: gloo, see the module docstring

MODES = ("sync", "async")


def async_clip_refusal(
    mode: str, num_servers: int, clip_val: float | None, clip_algorithm: str | None
) -> str | None:
    """Why these settings cannot train exactly, or ``None``: clipping by norm needs the whole
    model's gradient, which several async servers, each on its own schedule, never have.
    Lightning leaves ``gradient_clip_algorithm`` unset (``None``) for its default, norm."""
    if mode != "async" or num_servers < 2 or not _clips_by_norm(clip_val, clip_algorithm):
        return None
    return (
        f"gradient_clip_val={clip_val} with mode=async and num_servers={num_servers}: clipping "
        "by norm needs the whole model's gradient, but async servers step on their own "
        "schedules, so none exists; valid: num_servers=1, mode=sync, or "
        "gradient_clip_algorithm=value"
    )


def _clips_by_norm(clip_val: float | None, clip_algorithm: str | None) -> bool:
    return bool(clip_val) and (clip_algorithm or "norm") == "norm"


def assign_shards(numels: list[int], num_servers: int) -> list[list[int]]:
    """Parameter indices per server: largest first onto the least-loaded server (ties: lowest
    server), so every rank computes the same, roughly balanced, ownership."""
    loads = [0] * num_servers
    shards: list[list[int]] = [[] for _ in range(num_servers)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        s = min(range(num_servers), key=lambda k: (loads[k], k))
        shards[s].append(i)
        loads[s] += numels[i]
    return [sorted(shard) for shard in shards]


class ParameterServerStrategy(DDPStrategy):
    strategy_name = "parameter_server"

    def __init__(
        self,
        num_servers: int = 1,
        mode: str = "sync",
        max_staleness: int = 2,
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown parameter-server mode {mode!r}; valid: {list(MODES)}")
        if not isinstance(num_servers, int) or num_servers < 1:
            raise ValueError(f"num_servers must be a positive integer, got {num_servers!r}")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        super().__init__(**kwargs)
        self.num_servers = num_servers
        self.mode = mode
        self.max_staleness = max_staleness
        self.comm_timeline = CommTimeline()
        self.staleness: list[int] = []  # worker: measured staleness of each of its pushes
        self.clock_gaps: list[int] = []  # server: steps ahead of the slowest, at each apply
        self._params: list[nn.Parameter] = []
        self._shards: list[list[int]] = []
        self._versions: list[int] = []
        self._servers: dist.ProcessGroup | None = None  # the server ranks only
        self._grad_norm = float("nan")  # server: the last averaged gradient's whole norm
        self.last_grad_norm = float("nan")  # worker: that norm, as the last reply carried it

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``"ps_sync"`` and ``"ps_async"``: the README's and ``conf/strategy``'s names, one
        per mode (``L.Trainer(strategy="ps_async")``)."""
        for mode in MODES:
            strategy_registry.register(
                f"ps_{mode}", cls, description=f"llmlab parameter server, {mode}", mode=mode
            )

    @classmethod
    def check_config(cls, options: Mapping[str, Any], run: RunConfig) -> None:
        """The constructor's checks; no fp32-master plugin (servers step the optimizer, the
        plugin's masters never would); no clipping by norm across async servers; no compile
        (not checked); the global batch split over the workers (the servers hold no data)."""
        strategy = cls(**options)
        plugin = run.plugin
        if plugin is not None and issubclass(plugin, MasterWeightPrecision):
            raise ValueError(
                f"precision plugin {plugin.__name__} cannot run on a parameter server (the "
                "servers step the optimizer, the plugin's fp32 masters never would); valid "
                "there: precision=fp32, bf16_mixed or fp8"
            )
        refusal = async_clip_refusal(
            strategy.mode, strategy.num_servers, run.gradient_clip_val, run.gradient_clip_algorithm
        )
        if refusal:
            raise ValueError(f"trainer.{refusal}")
        if run.transforms.compile:
            raise ValueError(compile_refusal(cls.__name__))
        workers = run.world_size - strategy.num_servers
        if workers < 1:
            raise ValueError(
                f"num_servers={strategy.num_servers} leaves no worker among the {run.world_size} "
                "ranks (trainer devices × nodes); use fewer servers or more devices"
            )
        check_layout(ParallelDims(data=workers), global_batch=run.global_batch)

    # ------------------------------------------------------------------ roles
    @property
    def num_workers(self) -> int:
        return self.world_size - self.num_servers

    @property
    def is_server(self) -> bool:
        return self.global_rank >= self.num_workers

    def _server_rank(self, server: int) -> int:
        return self.num_workers + server

    @property
    def loss_replicas(self) -> LossReplicas:
        """Sync mode: the workers (the servers average their gradients), so ``train/loss`` is
        the global batch's token mean. Async: each worker's gradient is applied alone, so each
        worker's loss is its own batch's mean."""
        if self.mode == "async" or self.num_workers == 1:
            return LossReplicas()
        return LossReplicas(self._workers, self.num_workers)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rank = 0 if self.is_server else self.global_rank
        return {"num_replicas": max(self.num_workers, 1), "rank": rank}

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: Any) -> None:
        if isinstance(self.precision_plugin, MasterWeightPrecision):
            # Its optimizer steps fp32 masters (and unscales fp16 grads) in optimizer_step,
            # which a server never runs: training would silently not update anything.
            raise ValueError(
                f"ParameterServerStrategy does not support the master-weight precision plugin "
                f"{type(self.precision_plugin).__name__} ({self.precision_plugin.precision}); "
                "valid: precision=fp32 (32-true), bf16_mixed (autocast) or fp8"
            )
        refusal = async_clip_refusal(
            self.mode, self.num_servers, trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        )
        if refusal:
            raise ValueError(refusal)
        super().setup(trainer)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.num_workers < 1:
            raise ValueError(
                f"world size {self.world_size} leaves no workers with {self.num_servers} "
                f"server(s); launch at least {self.num_servers + 1} processes"
            )
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._shards = assign_shards([p.numel() for p in self._params], self.num_servers)
        if any(not shard for shard in self._shards):
            raise ValueError(
                f"{self.num_servers} servers but only {len(self._params)} parameter tensors: "
                "some servers would own nothing; use fewer servers"
            )
        self._versions = [0] * self.num_servers
        self._group = dist.new_group(backend="gloo")  # keeps PS traffic apart from Lightning's
        servers = list(range(self.num_workers, self.world_size))
        self._servers = dist.new_group(ranks=servers, backend="gloo")  # every rank calls it
        self._workers = dist.new_group(ranks=list(range(self.num_workers)))  # the loss's mean
        self._clocks = [0] * self.num_workers
        return model

    def _shard_numel(self, server: int) -> int:
        return sum(self._params[i].numel() for i in self._shards[server])

    def _my_shard(self) -> int:
        return self.global_rank - self.num_workers

    # ------------------------------------------------------------------ the step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_server:  # a server has no data to learn from: a zero loss with no graph
            return torch.zeros((), requires_grad=True)
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_server:
            return None  # workers evaluate; metric sync still includes the server's empty state
        return super().validation_step(*args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.is_server:
            return closure_loss.detach()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        loss = closure()  # worker: forward + backward; server: the zero-loss no-op
        if self.is_server:
            self._serve(optimizer)
        else:
            self._push_pull()
            # The servers stepped for us. An empty step (gradients held aside, so no parameter
            # and no state changes) tells torch's LR scheduler that the optimizer has stepped,
            # which it otherwise warns about (the worker's schedule only mirrors the servers').
            # The gradients come back after it: as after any step, callbacks may read them.
            held = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
            optimizer.zero_grad(set_to_none=True)
            optimizer.step()
            for p, grad in held:
                p.grad = grad
            if self.mode == "sync":
                self._log_grad_norm()
        return loss

    def _log_grad_norm(self) -> None:
        """``train/grad_norm``: the averaged gradient's whole norm the servers replied with
        (Lightning's own hook, where the telemetry callback logs it, never sees that gradient)."""
        module = self.lightning_module
        try:
            module.log("train/grad_norm", self.last_grad_norm, on_step=True, on_epoch=False)
        except (MisconfigurationException, AttributeError, RuntimeError):  # not where it may log
            trainer = module.trainer
            if trainer.logger is not None and self.global_rank == 0:
                trainer.logger.log_metrics(
                    {"train/grad_norm": self.last_grad_norm}, step=trainer.global_step
                )

    # ------------------------------------------------------------------ worker side
    def _push_pull(self) -> None:
        start = time.perf_counter()
        sends, recvs, msgs = [], [], []
        for s in range(self.num_servers):
            msg = self._push_message(s).data.to(WIRE)
            msgs.append(msg)  # keep alive until the send completes
            sends.append(dist.isend(msg, self._server_rank(s), group=self._group))
            buf = torch.empty(self._shard_numel(s) + 2, device=WIRE)
            recvs.append((s, buf, dist.irecv(buf, self._server_rank(s), group=self._group)))
        stale = 0
        for s, buf, work in recvs:
            work.wait()
            self._unflatten_into(s, buf[:-2])
            self.last_grad_norm = float(buf[-2])  # the same from every server (sync)
            new_version = int(buf[-1].item())
            # the server applied our gradient as update number new_version; every update between
            # our pull (self._versions[s]) and that one was somebody else's: that is staleness
            stale = max(stale, new_version - 1 - self._versions[s])
            self._versions[s] = new_version
        for work in sends:
            work.wait()
        self.staleness.append(stale)
        self.comm_timeline.add(start, time.perf_counter())
        if self.mode == "async" and self.global_rank == 0 and self.lightning_module is not None:
            trainer = self.lightning_module.trainer
            if trainer.logger is not None:
                trainer.logger.log_metrics({"ps/staleness": float(stale)}, trainer.global_step)

    def _push_message(self, server: int) -> FlatBuffer:
        """Server ``server``'s gradients (zeros where none) and the version they were computed
        at, packed in fp32 on the parameters' device."""
        params = [self._params[i] for i in self._shards[server]]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        return _with_version(grads, self._versions[server])

    def _unflatten_into(self, server: int, flat: Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for i in self._shards[server]:
                p = self._params[i]
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    # ------------------------------------------------------------------ server side
    def _serve(self, optimizer: Any) -> None:
        shard = self._my_shard()
        n = self._shard_numel(shard)
        if self.mode == "sync":
            total = torch.zeros(n, device=WIRE)
            buf = torch.empty(n + 1, device=WIRE)
            for w in range(self.num_workers):  # fixed order: the same sum on every run
                dist.recv(buf, w, group=self._group)
                total += buf[:-1]
            self._apply(optimizer, shard, total / self.num_workers)
            reply = self._reply(shard)
            for w in range(self.num_workers):
                dist.send(reply, w, group=self._group)
            return
        self._serve_async(optimizer, shard, n)

    def _serve_async(self, optimizer: Any, shard: int, n: int) -> None:
        """Apply exactly W pushes (from whoever is eligible) per optimizer step of the server,
        so every rank's loop runs the same number of Lightning steps."""
        total_steps = self.lightning_module.trainer.estimated_stepping_batches
        pending: dict[int, Tensor] = {}
        served = 0
        while served < self.num_workers:
            unfinished = [c for c in self._clocks if c < total_steps]
            slowest = min(unfinished) if unfinished else 0
            eligible = [w for w in pending if self._clocks[w] - slowest <= self.max_staleness]
            if eligible:
                w = min(eligible, key=lambda k: (self._clocks[k], k))
                msg = pending.pop(w)
                self.clock_gaps.append(self._clocks[w] - slowest)
                self._apply(optimizer, shard, msg[:-1])
                self._clocks[w] += 1
                dist.send(self._reply(shard), w, group=self._group)
                served += 1
                continue
            buf = torch.empty(n + 1, device=WIRE)
            src = dist.recv(buf, group=self._group)  # any worker: arrival order decides
            pending[src] = buf

    def _apply(self, optimizer: Any, shard: int, flat_grad: Tensor) -> None:
        owned = set(self._shards[shard])
        offset = 0
        for i, p in enumerate(self._params):
            if i in owned:
                piece = flat_grad[offset : offset + p.numel()].view_as(p)
                p.grad = piece.to(device=p.device, dtype=p.dtype, copy=True)
                offset += p.numel()
            else:
                p.grad = None
        trainer = self.lightning_module.trainer
        grads = [p.grad for p in self._params if p.grad is not None]
        if self.mode == "sync":  # every server is here for the same step: one whole norm
            total = global_grad_norm(grads, [1.0] * len(grads), [self._servers])
            self._grad_norm = float(total)
        if self.mode == "sync" and _clips_by_norm(
            trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        ):
            clip_by_total_norm_(grads, total, float(trainer.gradient_clip_val))
        elif trainer.gradient_clip_val:  # by value, or one async server: all it steps is here
            self.lightning_module.clip_gradients(
                optimizer,
                gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            )
        optimizer.step()
        self._versions[shard] += 1

    def _reply(self, shard: int) -> Tensor:
        """The shard's parameters, then the whole gradient norm (sync), then the version."""
        params = [self._params[i].detach() for i in self._shards[shard]]
        norm = torch.full((1,), self._grad_norm, device=params[0].device)
        return _with_version([*params, norm], self._versions[shard]).data.to(WIRE)

    # ------------------------------------------------------------------ consistency points
    def _sync_from_owners(self) -> None:
        """Every rank gets each shard's current parameters and version from its server."""
        if not self._params:
            return
        with torch.no_grad():
            for s, shard in enumerate(self._shards):
                src = self._server_rank(s)
                for i in shard:
                    dist.broadcast(self._params[i].data, src=src)
                device = self._params[shard[0]].device if shard else WIRE
                version = torch.tensor([self._versions[s]], dtype=torch.int64, device=device)
                dist.broadcast(version, src=src)
                self._versions[s] = int(version.item())

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The owners' current parameters: in async mode a worker's copy can be a pull behind.
        Called on every rank when Lightning builds a checkpoint, so the broadcast is safe."""
        self._sync_from_owners()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state on rank 0: only servers step, each for the parameters it
        owns, so their per-parameter states are disjoint and merge into one state dict that
        loads into a single-process run or into this strategy again (each rank loads it all;
        servers use their own part, workers never step)."""
        state = optimizer.state_dict()
        if not self._params:
            return state
        parts: list[Any] | None = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(state["state"] if self.is_server else {}, parts, dst=0)
        if parts is None:
            return state
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(part)
        return {**state, "state": dict(sorted(merged.items()))}

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._sync_from_owners()

    def on_train_end(self) -> None:
        self._sync_from_owners()
        super().on_train_end()


def _with_version(tensors: list[Tensor], version: int) -> FlatBuffer:
    """``tensors`` flattened into one fp32 buffer on their device, the version as last element."""
    tail = torch.full((1,), float(version), device=tensors[0].device)
    buffer = FlatBuffer([*tensors, tail], dtype=torch.float32)
    buffer.pack([*tensors, tail])
    return buffer


if "ps_sync" not in StrategyRegistry:
    ParameterServerStrategy.register_strategies(StrategyRegistry)
