"""The backward split in two: B computes the input gradient only, W the weight gradient, later.

Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024): for a layer y = x theta^T the
previous stage waits for dL/dx = dL/dy theta (B) and nobody waits for dL/dtheta = dL/dy^T x (W) until
the optimizer step, so a schedule may run W later, in what would otherwise be a bubble.

How autograd is made to do that (the same facts torch.distributed.pipelining's `stage_backward_input` /
`stage_backward_weight` use; this is our own code):

- B: `torch.autograd.grad(out, [x], grad, retain_graph=True)` runs only the graph nodes on a path from
  `out` to the chunk's input x, and each node computes only the outputs such a path needs: a matmul
  node computes dL/dx but not dL/dtheta. Before it runs, a pre-hook is put on every *boundary* node: a
  node on the input path with an edge leaving it towards a parameter (the matmul of y = x theta^T, the
  multiply of a norm's weight). The hook keeps the gradient arriving at the boundary (dL/dy), which B
  computes anyway. The graph is retained, so the boundary nodes keep what they saved in forward (x).
- W: for each group of parameters sharing boundaries, `torch.autograd.backward` from the boundary edges,
  seeded with the kept gradients, to the parameters: only the parameter branches run (dL/dtheta = dL/dy^T
  x), nothing of B is recomputed. It goes through the parameters' AccumulateGrad nodes, so `.grad`
  accumulates as in a plain backward and every hook on them fires (DDP's bucket all-reduce hooks, the
  tensor-parallel gradient-layout hooks). When one group has several boundaries on one input path, the
  kept gradients also replace what flows between them (a pre-hook returning the kept value), so nothing
  is counted twice.
- The first stage has no input gradient to send (its input is token ids): its B does nothing and its W
  runs the whole backward of the micro-batch.

Between B and W a micro-batch holds its boundary nodes' saved tensors (about what 1F1B holds until its
B), which the schedule validator counts as in flight until W. FSDP2 reduce-scatters in hooks around a
module's backward (pre-backward on its outputs, post-backward on its inputs) that W's partial backward
never crosses, so under a split backward the data-parallel strategy keeps gradient sync off in every B
and W and reduces each chunk once after its last W (`raydist.parallel.data_parallel.fsdp_grad_sync`).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Node:
    """The node a gradient for `t` flows into: its grad_fn, or its AccumulateGrad when it is a leaf."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's accumulator is created lazily


def _parents(root: Node) -> dict[Node, list[Node]]:
    """{node: the nodes that send it gradient} over the graph reachable from `root`."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = {root}, deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _upward(starts: list[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """(nodes reached walking from `starts` towards the output, not entering `stop`; the `stop` nodes met)."""
    reached, met, queue = set(starts), set(), deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


@dataclass(eq=False)  # groups are told apart by identity (`groups.remove`): comparing tensors would fail
class _Group:
    """Parameters whose gradients branch off the input path at the same boundary nodes."""

    leaves: list[torch.Tensor]
    boundaries: list[Node]
    kept: dict[int, tuple] = field(default_factory=dict)  # boundary index -> gradients arriving at it in B


@dataclass
class PendingWeightGradient:
    """What B leaves for W: the parameter groups with their kept gradients, or (the first stage) the output
    and its gradient for a whole backward."""

    groups: list[_Group] = field(default_factory=list)
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _groups(out: torch.Tensor, x: torch.Tensor) -> list[_Group]:
    root, x_node = out.grad_fn, grad_node(x)
    parents = _parents(root)
    input_path, _ = _upward([x_node], parents, set())  # every node whose gradient B computes
    leaves = [n for n in parents if n is not x_node and hasattr(n, "variable") and not n.next_functions]
    by_boundary: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for leaf in leaves:
        _, met = _upward([leaf], parents, input_path)
        if not met:  # cannot happen when out depends on x: every parameter meets the input path at out
            raise RuntimeError(f"parameter {tuple(leaf.variable.shape)} does not meet the input path; "
                               "a split backward needs the output to depend on the chunk's input")
        group = _Group([leaf.variable], list(met))
        for other in {id(by_boundary[b]): by_boundary[b] for b in met if b in by_boundary}.values():
            group.leaves += other.leaves
            group.boundaries += [b for b in other.boundaries if b not in met]
            groups.remove(other)
        groups.append(group)
        for b in group.boundaries:
            by_boundary[b] = group
    return groups


def backward_input(out: torch.Tensor, grad: torch.Tensor | None,
                   x: torch.Tensor) -> tuple[torch.Tensor | None, PendingWeightGradient]:
    """B of one micro-batch through one chunk: (dL/dx, what W needs). `out` is the chunk's output (or the
    loss on the last stage, with `grad` None), `x` its input (a leaf; token ids on the first stage)."""
    if not x.is_floating_point() or not x.requires_grad:
        return None, PendingWeightGradient(whole=(out, grad))
    groups = _groups(out, x)
    handles = []
    for group in groups:
        for i, boundary in enumerate(group.boundaries):
            def keep(grads, group=group, i=i):
                group.kept[i] = grads
            handles.append(boundary.register_prehook(keep))
    try:
        (dx,) = torch.autograd.grad(out, [x], grad_outputs=grad, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return dx, PendingWeightGradient(groups)


def backward_weight(pending: PendingWeightGradient) -> None:
    """W: accumulate the weight gradients B deferred into the parameters' `.grad`."""
    if pending.whole is not None:
        out, grad = pending.whole
        torch.autograd.backward(out, grad_tensors=grad)
        return
    for group in pending.groups:
        edges, seeds, clamps = [], [], []
        for i, boundary in enumerate(group.boundaries):
            kept = group.kept.get(i, ())
            for k, g in enumerate(kept):
                if g is not None:
                    edges.append(GradientEdge(boundary, k))
                    seeds.append(g)
            if len(group.boundaries) > 1:  # flow from one boundary into another must not add to what B kept
                clamps.append(boundary.register_prehook(lambda grads, kept=kept: kept))
        try:
            if edges:
                torch.autograd.backward(edges, grad_tensors=seeds, inputs=group.leaves, retain_graph=True)
        finally:
            for handle in clamps:
                handle.remove()
    pending.groups = []


def wanted(ctx, i: int) -> bool:
    """Whether this backward must compute the gradient of forward input `i`. `ctx.needs_input_grad` is fixed
    at forward time; which gradients a backward asks for is not: a split backward's B
    (`torch.autograd.grad(out, [x])`) runs this node for dX alone, its W (`torch.autograd.backward(...,
    inputs=weights)`) for dW alone (above). So an input's gradient is computed when the autograd engine will
    run the node it flows to, as aten's own matmul backward decides. For custom autograd functions (the
    Triton matmul, the fused loss); `ctx` is the function's backward node."""
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # autograd.grad() with this leaf among its inputs: torch cannot say; compute it
        return True
