"""Execute one stage's instruction list: a dispatch table over ``Op``.

The engine holds this rank's model chunks and, during a step, small maps keyed by
(chunk, micro-batch): inputs, produced outputs, received output-gradients, the input-gradients to
send, and what a split backward's B left for its W. An entry is dropped as soon as its backward
(or W) has run, so the memory a schedule keeps alive is exactly what the simulator counts.

Transfers go through :class:`~llmlab.parallel.pipeline.transport.Transport` (tags, shape
headers, posted receives). Sends are not waited for until the end of the step (so a stage never
blocks on a send); a receive blocks.

Receives are posted one compute ahead (on gloo): before a forward or backward starts, the
receives that the *next* forward or backward needs are already posted. This matters because
gloo's TCP transport is a rendezvous: a send's payload only leaves once the receiver has posted
the matching receive. A receive posted just before it is needed therefore costs a round trip
between two processes (plus their wake-ups on a busy machine) even when the sender finished long
ago; posted one compute ahead, the data lands while this stage computes, and the wait returns at
once -- which is the free-communication model the simulator assumes. Other backends keep the
plain post-and-wait in program order (``prefetch_receives=None`` turns prefetching on for gloo
only): ProcessGroupNCCL runs a pair of ranks' sends and receives on one stream, where an early
receive would hold back this rank's sends to that peer until it completes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.pipeline.recompute import uses_shared_recompute
from llmlab.parallel.pipeline.schedules import COMPUTE_OPS, Instruction, Op
from llmlab.parallel.pipeline.simulator import TimelineEvent
from llmlab.parallel.pipeline.split_backward import (
    WeightGradients,
    backward_input,
    backward_weight,
)
from llmlab.parallel.pipeline.transport import Tag, Transport
from llmlab.parallel.pipeline.validate import validated_schedules


@dataclass
class StepResult:
    """What one pipelined step produced on this rank."""

    loss: Tensor | None  # mean over micro-batches, on the last stage; None elsewhere
    events: list[TimelineEvent] = field(default_factory=list)
    peak_activation_bytes: int = 0  # bytes saved for backward, at most, during the step
    peak_in_flight: int = 0  # micro-batch activations alive at once, at most
    output: Tensor | None = None  # forward-only without a loss: the last stage's outputs


class ActivationMeter:
    """Counts the bytes autograd saves for backward (parameters excluded) while they are alive.

    A ``saved_tensors_hooks`` pack hook wraps each saved tensor in a small holder whose
    destructor subtracts its size, so the count drops exactly when autograd frees the graph.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.current = 0
        self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        meter = self

        class _Held:
            __slots__ = ("nbytes", "tensor")

            def __init__(self, t: Tensor) -> None:
                self.tensor = t
                self.nbytes = t.numel() * t.element_size()
                meter.current += self.nbytes
                meter.peak = max(meter.peak, meter.current)

            def __del__(self) -> None:
                meter.current -= self.nbytes

        def pack(t: Tensor) -> Any:
            if t.untyped_storage().data_ptr() in meter._param_ptrs:
                return t
            return _Held(t)

        def unpack(x: Any) -> Tensor:
            return x.tensor if isinstance(x, _Held) else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class PipelineEngine:
    """Runs schedules for one pipeline stage.

    ``chunks``: this rank's model chunks (one, or ``v`` for the interleaved schedule), each a
    module mapping one tensor to one tensor. ``ranks``: the global ranks of the pipeline, by stage.
    ``loss_fn(output, target)`` runs on the last virtual stage. ``reduce_grads`` and
    ``optimizer_step`` are what the ``REDUCE_GRADS`` / ``OPTIMIZER_STEP`` instructions call (the
    Lightning strategy lets Lightning step the optimizer and passes None for it).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        stage: int,
        num_stages: int,
        ranks: Sequence[int] | None = None,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        group: dist.ProcessGroup | None = None,
        reduce_grads: Callable[[], None] | None = None,
        optimizer_step: Callable[[], None] | None = None,
        device: torch.device | str | None = None,
        record_timeline: bool = False,
        measure_memory: bool = False,
        prefetch_receives: bool | None = None,
        scale_loss: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        self.chunks = list(chunks)
        self.stage = stage
        self.num_stages = num_stages
        self.ranks = list(ranks) if ranks is not None else list(range(num_stages))
        if len(self.ranks) != num_stages:
            raise ValueError(f"ranks {self.ranks} must list one rank per stage ({num_stages})")
        self.loss_fn = loss_fn
        self.scale_loss = scale_loss
        self.group = group
        self.reduce_grads = reduce_grads
        self.optimizer_step = optimizer_step
        self._chunk_params = [list(c.parameters()) for c in self.chunks]
        params = [p for ps in self._chunk_params for p in ps]
        self.device = (
            torch.device(device)
            if device is not None
            else (params[0].device if params else torch.device("cpu"))
        )
        self.record_timeline = record_timeline
        self.measure_memory = measure_memory
        self._meter = ActivationMeter(params)
        if prefetch_receives is None:
            prefetch_receives = dist.is_initialized() and dist.get_backend(group) == "gloo"
        self.prefetch_receives = prefetch_receives
        _preload_lazy_autograd_imports()
        self.transport = Transport(stage, self.ranks, group, self.device)
        self._dispatch: dict[Op, Callable[[Instruction], None]] = {
            Op.LOAD_MICROBATCH: self._load,
            Op.RECV_ACTIVATION: self._recv_activation,
            Op.FORWARD: self._forward,
            Op.SEND_ACTIVATION: self._send_activation,
            Op.RECV_GRAD: self._recv_grad,
            Op.BACKWARD: self._backward,
            Op.BACKWARD_INPUT: self._backward_input,
            Op.BACKWARD_WEIGHT: self._backward_weight,
            Op.SEND_GRAD: self._send_grad,
            Op.REDUCE_GRADS: self._reduce_grads,
            Op.OPTIMIZER_STEP: self._optimizer_step,
        }

    @property
    def virtual_stages(self) -> int:
        return len(self.chunks)

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    # ------------------------------------------------------------------------ public
    def train_step(
        self, inputs: Tensor, targets: Tensor, num_microbatches: int, schedule_name: str = "1f1b"
    ) -> StepResult:
        """Forward and backward of one batch under ``schedule_name``; gradients accumulate into
        the chunks' ``.grad`` as for ``(mean loss over micro-batches).backward()``.

        Every stage's program is validated (each micro-batch forwarded and backwarded once per
        virtual stage, W after its B, transfers matched, no deadlock) before anything runs."""
        programs = validated_schedules(
            schedule_name, self.num_stages, num_microbatches, self.virtual_stages
        )
        return self.execute(programs[self.stage], inputs, targets, num_microbatches, train=True)

    @torch.no_grad()
    def eval_step(
        self,
        inputs: Tensor,
        targets: Tensor | None,
        num_microbatches: int,
        schedule_name: str = "1f1b",
    ) -> StepResult:
        """Forward only (validation), no graph kept: the mean loss on the last stage, or with
        ``targets=None`` the last stage's outputs concatenated over micro-batches."""
        programs = validated_schedules(
            schedule_name, self.num_stages, num_microbatches, self.virtual_stages, True
        )
        return self.execute(programs[self.stage], inputs, targets, num_microbatches, train=False)

    def execute(
        self,
        program: Sequence[Instruction],
        inputs: Tensor,
        targets: Tensor | None,
        num_microbatches: int,
        train: bool = True,
    ) -> StepResult:
        """Run ``program``. Every stage passes the same ``inputs``/``targets`` (the first stage
        uses the inputs, the last the targets, all use the batch shape to key the shape cache)."""
        m = num_microbatches
        if train and any(ins.op is Op.BACKWARD_INPUT for ins in program):
            self._check_split_backward()
        if inputs.shape[0] % m != 0:
            raise ValueError(
                f"the batch of {inputs.shape[0]} samples cannot be split into {m} equal "
                f"micro-batches; use a batch size that is a multiple of {m}"
            )
        self._m = m
        self._train = train
        self._signature = (tuple(inputs.shape), inputs.dtype)
        self._mb_inputs = inputs.chunk(m)
        self._mb_targets = targets.chunk(m) if targets is not None else None
        self._loaded: dict[tuple[int, int], tuple[Tensor | None, Tensor | None]] = {}
        self._inputs: dict[tuple[int, int], Tensor] = {}
        self._outputs: dict[tuple[int, int], Tensor] = {}
        self._grads_in: dict[tuple[int, int], Tensor] = {}
        self._grads_out: dict[tuple[int, int], Tensor | None] = {}
        self._deferred: dict[tuple[int, int], WeightGradients] = {}  # B done, W not yet
        self._losses: list[Tensor] = []
        self._collected: list[Tensor] = []
        self.transport.begin_step(self._last_vs() + 1, m, self._signature)
        prefetch = self._prefetch_plan(program) if self.prefetch_receives else {}
        if self.prefetch_receives:
            for ins in program:  # a header has a fixed size: it can wait from the start
                if ins.op is Op.RECV_ACTIVATION:
                    self.transport.post_header(ins.peer, ins.virtual_stage, ins.microbatch)
        self._in_flight = 0
        self._peak_in_flight = 0
        self._meter.current = self._meter.peak = 0
        events: list[TimelineEvent] = []
        if self.record_timeline and dist.is_initialized():
            dist.barrier(group=self.group)  # a common start, so stages' clocks line up
        origin = time.perf_counter()
        for index, ins in enumerate(program):
            for receive in prefetch.get(index, ()):  # outside the timed span: not compute
                self._post_receive(receive)
            start = time.perf_counter()
            self._dispatch[ins.op](ins)
            if self.record_timeline:
                end = time.perf_counter()
                events.append(
                    TimelineEvent(
                        self.stage,
                        ins.op.value,
                        ins.microbatch,
                        ins.chunk,
                        start - origin,
                        end - origin,
                    )
                )
        self.transport.end_step()
        leftover = set(self._outputs) | set(self._inputs) | set(self._deferred) if train else set()
        if leftover:
            raise RuntimeError(f"stage {self.stage}: activations never released: {leftover}")
        loss = torch.stack(self._losses).sum() / m if self._losses else None
        output = torch.cat(self._collected) if self._collected else None
        result = StepResult(loss, events, self._meter.peak, self._peak_in_flight, output)
        self._losses, self._collected = [], []
        self._mb_inputs = self._mb_targets = ()  # type: ignore[assignment]
        return result

    # ------------------------------------------------------------------ instructions
    def _last_vs(self) -> int:
        return self.num_stages * self.virtual_stages - 1

    def _load(self, ins: Instruction) -> None:
        mb = ins.microbatch
        x = self._mb_inputs[mb].to(self.device) if ins.virtual_stage == 0 else None
        y = None
        if ins.virtual_stage == self._last_vs() and self._mb_targets is not None:
            y = self._mb_targets[mb].to(self.device)
        self._loaded[(ins.chunk, mb)] = (x, y)

    def _forward(self, ins: Instruction) -> None:
        key = (ins.chunk, ins.microbatch)
        x_loaded, target = self._loaded.pop(key, (None, None))
        x = x_loaded if ins.virtual_stage == 0 else self._inputs[key]
        with torch.set_grad_enabled(self._train):
            if self.measure_memory and self._train:
                with self._meter.hooks():
                    out = self.chunks[ins.chunk](x)
            else:
                out = self.chunks[ins.chunk](x)
            if ins.virtual_stage == self._last_vs() and target is None and not self._train:
                self._collected.append(out)
                return
            if ins.virtual_stage == self._last_vs():
                if self.loss_fn is None:
                    raise RuntimeError("the last stage needs a loss_fn")
                loss = self.loss_fn(out, target)
                self._losses.append(loss.detach())
                out = loss / self._m  # backward of the mean over micro-batches
                if self.scale_loss is not None:  # e.g. fp16's dynamic loss scale
                    out = self.scale_loss(out)
        if not self._train:
            self._inputs.pop(key, None)
            if ins.virtual_stage != self._last_vs():
                self._outputs[key] = out
            return
        self._outputs[key] = out
        if ins.virtual_stage == 0 and x is not None and x.requires_grad:
            self._inputs[key] = x  # a differentiable first input: B computes its gradient
        self._in_flight += 1
        self._peak_in_flight = max(self._peak_in_flight, self._in_flight)

    def _backward(self, ins: Instruction) -> None:
        key = (ins.chunk, ins.microbatch)
        out = self._outputs.pop(key)
        if ins.virtual_stage == self._last_vs():
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, self._grads_in.pop(key))
        x = self._inputs.pop(key, None)
        if ins.virtual_stage > 0:
            self._grads_out[key] = x.grad if x is not None else None
        self._in_flight -= 1

    def _backward_input(self, ins: Instruction) -> None:
        """B: the input's gradient now; the weight gradients wait in ``_deferred`` for W."""
        key = (ins.chunk, ins.microbatch)
        out = self._outputs.pop(key)
        grad = None if ins.virtual_stage == self._last_vs() else self._grads_in.pop(key)
        x = self._inputs.pop(key, None)
        grad_x, self._deferred[key] = backward_input(out, grad, x, self._chunk_params[ins.chunk])
        if ins.virtual_stage > 0:
            self._grads_out[key] = grad_x

    def _backward_weight(self, ins: Instruction) -> None:
        backward_weight(self._deferred.pop((ins.chunk, ins.microbatch)))
        self._in_flight -= 1

    def _check_split_backward(self) -> None:
        """Refuse what a split backward would run wrong or twice, before anything runs."""
        # torch.compile(module) wraps it in an OptimizedModule, module.compile() sets
        # _compiled_call_impl; without torch._dynamo imported (seconds) neither can exist.
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        wrapper = getattr(eval_frame, "OptimizedModule", ())
        for chunk in self.chunks:
            compiled = [
                name
                for name, m in chunk.named_modules()
                if isinstance(m, wrapper) or getattr(m, "_compiled_call_impl", None) is not None
            ]
            if compiled:
                raise ValueError(
                    f"a split-backward schedule (B and W) cannot run compiled modules "
                    f"({compiled[:3]}): a compiled region's backward is one autograd node that "
                    "computes input and weight gradients together, so W would run it again; "
                    "use an unsplit schedule (1f1b, interleaved) with torch.compile"
                )
            if not uses_shared_recompute(chunk):
                raise ValueError(
                    "a split-backward schedule (B and W) needs checkpointed blocks that "
                    "recompute once for both: call llmlab.parallel.pipeline.recompute."
                    "share_recompute(chunk) on this stage's chunks first (PyTorch's "
                    "checkpoint would recompute each block once per weight group)"
                )

    # ------------------------------------------------------------------ transfers
    def _prefetch_plan(self, program: Sequence[Instruction]) -> dict[int, list[Instruction]]:
        """Program index of each forward/backward -> the receives of the compute after it.

        Receives between two computes belong to the second; they are posted when the first one
        starts, so a transfer overlaps one compute. Posting further ahead would only keep more
        receive buffers alive (1F1B's memory bound counts on it not doing so).
        """
        plan: dict[int, list[Instruction]] = {}
        current: int | None = None
        for index, ins in enumerate(program):
            if ins.op in COMPUTE_OPS:
                current = index
            elif (
                ins.op in (Op.RECV_ACTIVATION, Op.RECV_GRAD)
                and current is not None
                and ins.peer != self.stage
            ):
                plan.setdefault(current, []).append(ins)
        return plan

    def _receive_shape(self, ins: Instruction) -> tuple[torch.Size, torch.dtype] | None:
        """What ``ins`` will receive, if this rank knows it yet: an activation's shape once its
        boundary's header has been received, a gradient's once its forward has run."""
        if ins.op is Op.RECV_ACTIVATION:
            return self.transport.known_activation_shape(ins.virtual_stage)
        out = self._outputs.get((ins.chunk, ins.microbatch))
        return (out.shape, out.dtype) if out is not None else None

    def _post_receive(self, ins: Instruction) -> None:
        shape = self._receive_shape(ins)
        if shape is not None:
            kind = Tag.ACTIVATION if ins.op is Op.RECV_ACTIVATION else Tag.GRADIENT
            self.transport.post(kind, ins.peer, ins.virtual_stage, ins.microbatch, shape)

    def _send_activation(self, ins: Instruction) -> None:
        key = (ins.chunk, ins.microbatch)
        out = self._outputs[key] if self._train else self._outputs.pop(key)
        self.transport.send_activation(out, ins.peer, ins.virtual_stage + 1, ins.microbatch)

    def _recv_activation(self, ins: Instruction) -> None:
        vs, mb = ins.virtual_stage, ins.microbatch
        shape = self.transport.activation_shape(ins.peer, vs, mb)
        buf = self.transport.take(Tag.ACTIVATION, ins.peer, vs, mb, shape)
        if self._train and buf.is_floating_point():
            buf.requires_grad_(True)
        self._inputs[(ins.chunk, ins.microbatch)] = buf

    def _send_grad(self, ins: Instruction) -> None:
        grad = self._grads_out.pop((ins.chunk, ins.microbatch))
        if grad is None:
            raise RuntimeError(
                f"stage {self.stage}: no gradient reached the input of virtual stage "
                f"{ins.virtual_stage}; every pipeline layer must use its input differentiably"
            )
        self.transport.send_gradient(grad, ins.peer, ins.virtual_stage - 1, ins.microbatch)

    def _recv_grad(self, ins: Instruction) -> None:
        out = self._outputs[(ins.chunk, ins.microbatch)]
        self._grads_in[(ins.chunk, ins.microbatch)] = self.transport.take(
            Tag.GRADIENT, ins.peer, ins.virtual_stage, ins.microbatch, (out.shape, out.dtype)
        )

    def _reduce_grads(self, ins: Instruction) -> None:
        if self.reduce_grads is not None:
            self.reduce_grads()

    def _optimizer_step(self, ins: Instruction) -> None:
        if self.optimizer_step is not None:
            self.optimizer_step()


def _preload_lazy_autograd_imports() -> None:
    """Import now what ``torch.autograd.backward(out, grad)`` imports on its first call.

    With an explicit gradient, torch's ``_make_grads`` imports
    ``torch.fx.experimental.symbolic_shapes`` (and sympy) lazily: ~0.8 s on these machines,
    which would otherwise land inside the first backward of a middle stage and stall the whole
    pipeline behind it (measured as a 0.4 bubble where theory says 0.2).
    """
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
