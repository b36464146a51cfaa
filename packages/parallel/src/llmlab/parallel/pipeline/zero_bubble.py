"""The compute order of the split-backward schedules: ZB-H1, ZB-V and DualPipeV.

Each function gives one rank's order of ``(kind, micro-batch, local chunk)`` with torch's letters:
``F`` (forward), ``I`` (the input gradient, the paper's B), ``W`` (weight gradients) and ``B``
(the whole backward in one go); :func:`~llmlab.parallel.pipeline.schedules.schedule` adds
the transfers. The orders are those of ``torch.distributed.pipelining``
(``ScheduleInterleavedZeroBubble`` with one stage per rank, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``), written as plain lists.

* **ZB-H1** (Qi et al., ICLR 2024, "handcrafted 1"): 1F1B's shape and warm-up, with B in place
  of the backward; stage ``s`` holds back its first ``s`` W's and runs them at the end, where
  1F1B's cool-down leaves the upstream stages waiting for gradients. Same activation memory as
  1F1B; bubble ``(p−1)(T_F + T_B − T_W)`` instead of ``(p−1)(T_F + T_B + T_W)``.
* **ZB-V**: two chunks per rank in a V (rank ``r`` holds virtual stages ``r`` and ``2p−1−r``),
  so the first and the last virtual stage share rank 0 and the warm-up of one chunk overlaps the
  cool-down of the other. With ``T_F = T_B = T_W`` it has no bubble beyond the first forward's
  trip down and the last backward's trip up.
* **DualPipeV** (DeepSeek-V3's DualPipe cut in half): the same V, with the steady phase pairing
  the forward of one chunk with the whole backward of the other (on GPUs the two overlap, one
  computing while the other's communication runs); W's are split off only at the ends.
"""

from __future__ import annotations

from collections import deque

Step = tuple[str, int, int]  # (kind, micro-batch, local chunk)


def zb1_order(p: int, m: int, stage: int) -> list[Step]:
    """ZB-H1 on ``stage``: warm-up forwards, then (F) I [W] per micro-batch, the first
    ``stage`` W's deferred to the end."""
    warmup = min(p - 1 - stage, m)
    order: list[Step] = [("F", i, 0) for i in range(warmup)]
    forwards, weights = warmup, 0
    for b in range(m):
        if forwards < m:
            order.append(("F", forwards, 0))
            forwards += 1
        order.append(("I", b, 0))
        if b >= stage:
            order.append(("W", weights, 0))
            weights += 1
    return order + [("W", w, 0) for w in range(weights, m)]


def zbv_order(p: int, m: int, stage: int) -> list[Step]:
    """ZB-V on ``stage`` (chunk 0: virtual stage ``stage``; chunk 1: ``2p−1−stage``).

    Built for at least ``2p−1`` micro-batches (what fills the V), then the steps of micro-batches
    that do not exist are dropped, as torch does.
    """
    n = max(2 * p - 1, m)
    order: list[Step] = []
    f = [0, 0]  # forwards issued per chunk
    b = [0, 0]  # input gradients issued per chunk
    w = [0, 0]  # weight gradients issued per chunk

    def emit(kind: str, chunk: int, counter: list[int]) -> None:
        order.append((kind, counter[chunk], chunk))
        counter[chunk] += 1

    def forward_backward(chunk: int) -> None:  # F, then B and W of the oldest micro-batch
        emit("F", chunk, f)
        emit("I", chunk, b)
        emit("W", chunk, w)

    for _ in range(2 * (p - stage) - 1):
        emit("F", 0, f)
    for _ in range(stage):
        emit("F", 1, f)
        emit("F", 0, f)
    for _ in range(p - stage):
        forward_backward(1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            emit("F", 0, f)
        emit("I", 0, b)
        emit("W", 0, w)
        forward_backward(1)
    for _ in range(stage):
        emit("I", 0, b)
        emit("I", 1, b)
    for _ in range(p - stage):
        emit("I", 0, b)
        emit("W", 0, w)
    while w[1] < b[1]:
        emit("W", 1, w)
    while w[0] < b[0]:
        emit("W", 0, w)
    return [step for step in order if step[1] < m]


def dualpipev_order(p: int, m: int, stage: int) -> list[Step]:
    """DualPipeV on ``stage``; needs ``m ≥ 2p``. An overlapped pair (F of one chunk with the
    whole backward B of the other) is written as the two steps, forward first."""
    order: list[Step] = []
    count: dict[tuple[str, int], int] = {}
    pending_w: deque[tuple[int, int]] = deque()  # (micro-batch, chunk) whose W is deferred

    def emit(kind: str, chunk: int) -> None:
        key = ("I" if kind == "B" else kind, chunk)  # I and B share the backward counter
        mb = count.get(key, 0)
        order.append((kind, mb, chunk))
        count[key] = mb + 1
        if kind == "I":
            pending_w.append((mb, chunk))

    def emit_pending_w() -> None:
        if pending_w:
            mb, chunk = pending_w.popleft()
            order.append(("W", mb, chunk))

    last = p - 1
    for _ in range(2 * (last - stage)):  # 1: F0
        emit("F", 0)
    for _ in range(stage + 1):  # 2: F0 F1
        emit("F", 0)
        emit("F", 1)
    for _ in range(last - stage):  # 3: I1 W1 F1
        emit("I", 1)
        emit_pending_w()
        emit("F", 1)
    for _ in range(m - 2 * p + stage + 1):  # 4: (F0 & B1) (F1 & B0)
        emit("F", 0)  # the last rank's first pair is not overlapped: the same two steps
        emit("B", 1)
        emit("F", 1)
        emit("B", 0)
    for _ in range(last - stage):  # 5: B1 (F1 & B0)
        emit("B", 1)
        emit("F", 1)
        emit("B", 0)
    split = False  # 6: B1 B0, whole backwards until half-way, then I's (their W's deferred)
    for i in range(stage + 1):
        if i == (stage + 1) // 2 and stage % 2 == 1:
            split = True
        emit("I" if split else "B", 1)
        if i == (stage + 1) // 2 and stage % 2 == 0:
            split = True
        emit("I" if split else "B", 0)
    for _ in range(last - stage):  # 7: W I0
        emit_pending_w()
        emit("I" if split else "B", 0)
    for _ in range(stage + 1):  # 8: the remaining W's
        emit_pending_w()
    return order
