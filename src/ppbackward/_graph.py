"""One-pass analysis of a stage's autograd graph for the zero-bubble B/W split.

Private module. Vocabulary (the field's terms, see ``docs/how-it-works.md``):

* **input node**: the ``grad_fn`` (or ``AccumulateGrad``) of a stage input that requires grad.
* **weight leaf**: an ``AccumulateGrad`` node reached from the outputs that is not an input node.
* **B-set**: nodes from which an input node is reachable; B (``stage_backward_input``) runs them.
* **W-only**: nodes from which a weight leaf, but no input node, is reachable; only W runs them.
* **intermediate**: a B-set node with at least one edge into a W-only node. B captures the
  gradient flowing *into* it (one ``GradientEdge`` per input slot). W calls it once more on that
  gradient, computing only its edges into W-only nodes (the deferred weight-gradient work, e.g.
  ``grad_out^T @ input`` of a linear layer); see Note [W computes only weight edges] in
  ``ppbackward.backward``.
* **param group**: a connected component of intermediates, W-only nodes and weight leaves
  (union-find over the edges into W-only nodes). Every weight leaf and every W-only node belongs
  to exactly one group.

Note [linear analysis]: the graph is walked once (iterative post-order DFS over
``next_functions``, stopping at input nodes), reachability flags are computed bottom-up in the same
pass, and groups come from one union-find pass over the recorded edges: O(nodes + edges). The
upstream ``get_param_groups`` walks the reverse graph once per parameter (O(params x graph)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch.autograd.graph import GradientEdge, Node

__all__: list[str] = []  # private module

_REACHES_INPUT = 1
_REACHES_WEIGHT = 2


def _accumulate_grad_type() -> type:
    leaf = torch.zeros((), requires_grad=True)
    return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])  # type: ignore[union-attr]


_ACCUMULATE_GRAD: type = _accumulate_grad_type()


def is_accumulate_grad(node: Optional[Node]) -> bool:
    """True when ``node`` is the ``AccumulateGrad`` node of a leaf tensor."""
    return type(node) is _ACCUMULATE_GRAD


def gradient_edge(t: torch.Tensor) -> GradientEdge:
    """The edge a gradient for ``t`` flows into: ``(grad_fn, output_nr)`` or ``(AccumulateGrad, 0)``."""
    return torch.autograd.graph.get_gradient_edge(t)


class GroupSpec(NamedTuple):
    """One param group as found by the analysis (no gradients yet).

    Attributes:
        intermediates: B-set nodes whose incoming gradient B must capture, each with the sorted input
            slots that receive gradient and the indices of its ``next_functions`` that lead into
            W-only nodes.
        root_edges: indices into the flat outputs whose edge leads straight into a W-only node
            (their gradient is known before B runs).
        leaves: the ``AccumulateGrad`` nodes of the group's weights.
    """

    intermediates: list[tuple[Node, tuple[int, ...], tuple[int, ...]]]
    root_edges: list[int]
    leaves: list[Node]


def _find(parent: dict[Node, Node], x: Node) -> Node:
    root = x
    while parent[root] is not root:
        root = parent[root]
    while parent[x] is not root:  # path compression
        parent[x], x = root, parent[x]
    return root


def _union(parent: dict[Node, Node], a: Node, b: Node) -> None:
    ra, rb = _find(parent, a), _find(parent, b)
    if ra is not rb:
        parent[rb] = ra


class Analysis(NamedTuple):
    """Result of :func:`analyze`.

    Attributes:
        groups: the param groups, first reached from the outputs first.
        used_nodes: every node that some traversed node has an edge into. An output whose
            ``grad_fn`` is in here feeds another op of the stage, which may have saved it: such an
            output must not be detached in place (see ``stage_backward_input``).
    """

    groups: list[GroupSpec]
    used_nodes: set[Node]


def analyze(root_edges: Sequence[GradientEdge], input_nodes: set[Node]) -> Analysis:
    """Split the graph below ``root_edges`` into param groups. See the module docstring.

    Args:
        root_edges: the gradient edge of each differentiable stage output (length = #outputs).
        input_nodes: the gradient-edge nodes of the stage inputs that require grad.

    Returns:
        An :class:`Analysis`.
    """
    flags: dict[Node, int] = {}
    slots: dict[Node, set[int]] = {}  # input slots of a node that receive gradient
    used: set[Node] = set()
    nexts: dict[Node, tuple] = {}  # node.next_functions, read once (each read builds a tuple)
    order: list[Node] = []  # post-order

    for edge in root_edges:
        slots.setdefault(edge.node, set()).add(edge.output_nr)
    # Note [no closure cycle]: explicit stack, no recursive nested function.
    for edge in root_edges:
        if edge.node in flags:
            continue
        flags[edge.node] = 0
        stack: list[tuple[Node, Any]] = [(edge.node, None)]
        while stack:
            node, it = stack[-1]
            if it is None:
                nf = () if node in input_nodes else node.next_functions
                nexts[node] = nf
                kids = []
                for nxt, nr in nf:
                    if nxt is not None:
                        slots.setdefault(nxt, set()).add(nr)
                        used.add(nxt)
                        kids.append(nxt)
                it = iter(kids)
                stack[-1] = (node, it)
            for nxt in it:
                if nxt not in flags:
                    flags[nxt] = 0
                    stack.append((nxt, None))
                    break
            else:
                stack.pop()
                f = 0
                if node in input_nodes:
                    f = _REACHES_INPUT
                elif is_accumulate_grad(node):
                    f = _REACHES_WEIGHT
                for kid, _ in nexts[node]:
                    if kid is not None:
                        f |= flags[kid]
                flags[node] = f
                order.append(node)

    # Union-find over edges into W-only nodes (Note [linear analysis]).
    parent: dict[Node, Node] = {}
    intermediates: list[tuple[Node, tuple[int, ...]]] = []
    for node in order:
        f = flags[node]
        if f == _REACHES_WEIGHT:  # W-only
            parent.setdefault(node, node)
            for kid, _ in nexts[node]:
                if kid is not None and flags[kid] == _REACHES_WEIGHT:
                    parent.setdefault(kid, kid)
                    _union(parent, node, kid)
        elif f & _REACHES_INPUT:
            nf = nexts[node]
            w_edges = tuple(
                i for i, (kid, _) in enumerate(nf) if kid is not None and flags[kid] == _REACHES_WEIGHT
            )
            if w_edges:
                parent.setdefault(node, node)
                intermediates.append((node, w_edges))
                for i in w_edges:
                    kid = nf[i][0]
                    parent.setdefault(kid, kid)
                    _union(parent, node, kid)

    groups: dict[Node, GroupSpec] = {}

    def group_of(node: Node) -> GroupSpec:
        rep = _find(parent, node)
        spec = groups.get(rep)
        if spec is None:
            spec = groups[rep] = GroupSpec([], [], [])
        return spec

    for i, edge in enumerate(root_edges):
        if flags.get(edge.node) == _REACHES_WEIGHT:
            group_of(edge.node).root_edges.append(i)
    for node, w_edges in reversed(intermediates):  # outputs side first
        group_of(node).intermediates.append((node, tuple(sorted(slots[node])), w_edges))
    for node in reversed(order):
        if is_accumulate_grad(node) and flags[node] == _REACHES_WEIGHT:
            group_of(node).leaves.append(node)
    return Analysis(list(groups.values()), used)
