"""Split backward: B (the input gradient, now) and W (the weight gradients, later).

A stage's backward does two jobs with different deadlines. The gradient of its *input* is on
the critical path: the previous stage waits for it. The gradients of its *weights* are needed
only by the optimizer step at the end of the batch. Zero-bubble schedules (Qi et al., "Zero
Bubble Pipeline Parallelism", ICLR 2024) run the first as B and defer the second as W into the
pipeline's idle slots.

Both run on the one autograd graph the forward built, so nothing is computed twice:

* The **input path** is every graph node whose backward contributes to the input's gradient.
  A weight hangs off it at a **branch point**: an input-path node with an edge into the weight's
  own (off-path) subgraph -- e.g. the ``addmm`` of a Linear, whose backward gives both the
  gradient of its input and that of its weight.
* **B** runs ``autograd.grad(output, input)`` with the graph retained. Autograd computes, at
  each node, only the outputs that lead to the input, so a branch point's weight half is not
  computed; a pre-hook records the gradient that reached each branch point.
* **W** restarts autograd *at* the branch points from those recorded gradients, asking for the
  weights only: each branch point's weight half runs now, and nothing of the input path does.

Weights are grouped by the branch points they share (one ``autograd.grad`` per group, so a call
never walks from one layer's branch point down the input path into another layer). A weight
reached from several branch points along one path (a weight used twice) gets one group whose
branch points are pinned to their recorded gradients during W, so the downstream one does not
also receive the upstream one's contribution a second time.

A stage whose input needs no gradient (the first: token ids) has no input path: B has nothing
to do and W is the whole backward, as in ``torch.distributed.pipelining``. Branch points that
are Python autograd Functions compute all their outputs whenever they run, so their backward
runs in B *and* in W (exact, but that layer's work is not split).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _WeightGroup:
    """Weights that share branch points, and the gradients B left at those branch points."""

    params: list[Tensor]
    nodes: list[Node]
    grads: dict[Node, tuple[Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class WeightGradients:
    """What B leaves for W: the graph's branch points with their gradients, or (no input path)
    the output and its gradient for a whole backward."""

    groups: list[_WeightGroup] = field(default_factory=list)
    whole: tuple[Tensor, Tensor | None] | None = None


def _parents(root: Node) -> dict[Node, list[Node]]:
    """For every node reachable from ``root``: the nodes that feed it a gradient."""
    parents: dict[Node, list[Node]] = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _upstream(start: Node, parents: dict[Node, list[Node]]) -> set[Node]:
    """``start`` and every node whose gradient flows into it (towards the output)."""
    seen, stack = {start}, [start]
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _branch_points(
    param: Node, input_path: set[Node], parents: dict[Node, list[Node]]
) -> set[Node]:
    """The input-path nodes from which ``param``'s gradient leaves the input path."""
    found: set[Node] = set()
    seen, stack = {param}, [param]
    while stack:
        for parent in parents[stack.pop()]:
            if parent in input_path:
                found.add(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return found


def _group_weights(
    params: Sequence[Tensor], input_path: set[Node], parents: dict[Node, list[Node]]
) -> list[_WeightGroup]:
    group_of: dict[Node, _WeightGroup] = {}
    for p in params:
        if not p.requires_grad:
            continue
        node = get_gradient_edge(p).node
        if node not in parents:
            continue  # not used by this micro-batch's forward
        points = _branch_points(node, input_path, parents)
        group = _WeightGroup([p], sorted(points, key=id))
        for other in {id(group_of[n]): group_of[n] for n in points if n in group_of}.values():
            group.params += [q for q in other.params if all(q is not r for r in group.params)]
            group.nodes += [n for n in other.nodes if n not in group.nodes]
        for n in group.nodes:
            group_of[n] = group
    return list({id(g): g for g in group_of.values()}.values())


def backward_input(
    output: Tensor, grad_output: Tensor | None, inputs: Tensor | None, params: Sequence[Tensor]
) -> tuple[Tensor | None, WeightGradients]:
    """B: the gradient of ``inputs`` (None without an input path) and what W needs.

    ``output`` is the stage's output (``grad_output`` its gradient) or, on the last stage, the
    loss (``grad_output=None``); ``params`` are the stage's weights. ``.grad`` is not touched.
    """
    root = output.grad_fn
    if root is None or inputs is None or not inputs.requires_grad:
        return None, WeightGradients(whole=(output, grad_output))
    parents = _parents(root)
    input_node = get_gradient_edge(inputs).node
    if input_node not in parents:
        return None, WeightGradients(whole=(output, grad_output))
    groups = _group_weights(params, _upstream(input_node, parents), parents)
    handles = []
    for group in groups:
        for node in group.nodes:

            def record(grads: tuple[Tensor | None, ...], group=group, node=node) -> None:
                group.grads[node] = grads

            handles.append(node.register_prehook(record))
    try:
        (grad_input,) = torch.autograd.grad(output, inputs, grad_output, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return grad_input, WeightGradients(groups)


def backward_weight(pending: WeightGradients) -> None:
    """W: accumulate the weight gradients B deferred into ``.grad`` (as ``backward`` would)."""
    if pending.whole is not None:
        output, grad = pending.whole
        torch.autograd.backward(output, grad)
        return
    for group in pending.groups:
        edges: list[GradientEdge] = []
        grads: list[Tensor] = []
        for node in group.nodes:
            for i, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(group.nodes) > 1:  # pin each branch point to what reached it in B
            for node in group.nodes:
                got = group.grads.get(node)

                def pin(incoming, got=got):  # a branch point B never reached got nothing
                    return got if got is not None else tuple(None for _ in incoming)

                handles.append(node.register_prehook(pin))
        try:
            # Accumulated by autograd itself (``inputs=``: only this group's weights), so every
            # ``.grad`` hook runs as under a plain ``backward``: a parameter's tensor hooks
            # (sequence parallelism's all-reduce) and its post-accumulate hooks (bucketed DP,
            # ZeRO's reduce in backward). retain_graph: another group's call may walk the same
            # input-path nodes; the graph is freed when ``pending`` is dropped, after this W.
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.params)
        finally:
            for handle in handles:
                handle.remove()
