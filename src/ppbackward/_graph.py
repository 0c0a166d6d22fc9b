"""One-pass analysis of a stage's autograd graph for the zero-bubble B/W split.

Private module. Vocabulary (the field's terms, see ``docs/how-it-works.md``):

* **input node**: the ``grad_fn`` (or ``AccumulateGrad``) of a stage input that requires grad.
* **weight leaf**: an ``AccumulateGrad`` node reached from the outputs that is not an input node.
* **B-set**: nodes from which an input node is reachable; B (``stage_backward_input``) runs them.
* **W-only**: nodes from which a weight leaf, but no input node, is reachable; only W runs them.
* **intermediate**: a B-set node with at least one edge into a W-only node. B captures the
  gradients flowing *into* it (all its input slots). W calls it once more on that
  gradient, computing only its edges into W-only nodes (the deferred weight-gradient work, e.g.
  ``grad_out^T @ input`` of a linear layer); see Note [W computes only weight edges] in
  ``ppbackward._weight_edges``.
* **param group**: a connected component of intermediates, W-only nodes and weight leaves
  (union-find over the edges into W-only nodes). Every weight leaf and every W-only node belongs
  to exactly one group.

Note [linear analysis]: one BFS over ``next_functions`` (stopping at input nodes) numbers the nodes
and records their edges; parent lists are built from those edges; two sweeps up the parent lists
mark the nodes that reach an input and those that reach a weight; one union-find pass over the edges
into W-only nodes forms the groups. Every pass is O(nodes + edges), with no recursion. The
upstream ``get_param_groups`` walks the reverse graph once per parameter (O(params x graph)).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

from ppbackward._plain import plain_autograd

__all__ = [  # private module: what other modules use
    "CHEAP_EDGES",
    "NO_CHEAP_WORK",
    "REDUCED_EDGES",
    "Analysis",
    "CheapLeaf",
    "CheapWork",
    "EagerWork",
    "FrontierSlot",
    "GroupSpec",
    "Intermediate",
    "Probes",
    "Structure",
    "Walk",
    "analyze",
    "eager_work",
    "fresh_edge",
    "gradient_edge",
    "is_accumulate_grad",
    "walk",
]


def _accumulate_grad_type() -> type:
    with plain_autograd():  # Note [probes run in plain autograd]
        leaf = torch.zeros((), requires_grad=True)
        return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])  # type: ignore[union-attr]


_ACCUMULATE_GRAD: type = _accumulate_grad_type()


def is_accumulate_grad(node: Node | None) -> bool:
    """True when ``node`` is the ``AccumulateGrad`` node of a leaf tensor."""
    return type(node) is _ACCUMULATE_GRAD


def gradient_edge(t: torch.Tensor | GradientEdge) -> GradientEdge:
    """The edge a gradient for ``t`` flows into: ``(grad_fn, output_nr)`` or ``(AccumulateGrad, 0)``;
    an edge given as an output is its own (Note [GradientEdge outputs] in ``ppbackward._tree``).

    A leaf is read with ``__torch_function__`` off (a subclass' override and any ``TorchFunctionMode``): torch finds
    a leaf's ``AccumulateGrad`` through ``t.view_as(t)``, which an override may wrap in a view of its own (an
    ``AliasBackward0`` whose next node is the view, not the leaf's ``AccumulateGrad``: B would not find the stage
    input in its graph and take the input path for a weight's, and W lose the weight gradients)."""
    if isinstance(t, GradientEdge):
        return t
    if t.grad_fn is not None:
        return torch.autograd.graph.get_gradient_edge(t)
    with torch._C.DisableTorchFunction():
        return torch.autograd.graph.get_gradient_edge(t)


class Intermediate(NamedTuple):
    """An intermediate of a param group: a B-set node with edges into W-only nodes.

    Attributes:
        node: the autograd node (``grad_fn``) B runs and W calls again for its weight edges.
        w_edges: the indices of ``node.next_functions`` that lead into W-only nodes or weight leaves.
    """

    node: Node
    w_edges: tuple[int, ...]


class GroupSpec(NamedTuple):
    """One param group as found by the analysis (no gradients yet).

    Attributes:
        intermediates: B-set nodes whose incoming gradient B must capture, each with the indices of
            its ``next_functions`` that lead into W-only nodes.
        root_edges: indices into the flat outputs whose edge leads straight into a W-only node
            (their gradient is known before B runs).
        leaves: the ``AccumulateGrad`` nodes of the group's weights.
    """

    intermediates: list[Intermediate]
    root_edges: list[int]
    leaves: list[Node]


def _find(parent: dict[int, int], x: int) -> int:
    root = x
    while parent[root] != root:
        root = parent[root]
    while parent[x] != root:  # path compression
        parent[x], x = root, parent[x]
    return root


def _union(parent: dict[int, int], a: int, b: int) -> None:
    ra, rb = _find(parent, a), _find(parent, b)
    if ra != rb:
        parent[rb] = ra


class Analysis(NamedTuple):
    """Result of :func:`analyze`.

    Attributes:
        groups: the param groups, first reached from the outputs first.
        used_nodes: the outputs' nodes that some traversed node has an edge into. An output whose
            ``grad_fn`` is in here feeds another op of the stage, which may have saved it: such an
            output must not be detached in place (see ``stage_backward_input``).
        b_only: the nodes B runs that W never runs (on an input path, not an intermediate, not
            an input node: those belong to whoever produced the stage input).
        w_only: the W-only nodes other than the weight leaves (the nodes W runs besides the
            intermediates), in BFS order.
        output_consumers: the intermediates and W-only nodes with an edge into an output's node: they
            may have saved that output (Note [outputs detached after B] in ``ppbackward._saved``).
        structure: what :func:`eager_work` reads.
        cheap: the weight gradients B computes itself (Note [cheap weight gradients in B]).
    """

    groups: list[GroupSpec]
    used_nodes: set[Node]
    b_only: list[Node]
    w_only: list[Node]
    output_consumers: list[Node]
    structure: Structure
    cheap: CheapWork


class Structure(NamedTuple):
    """What :func:`eager_work` needs of the analysis: the numbered nodes, their edges and parents, the
    intermediates and W-only nodes (leaves included) by number, and the union-find of the groups."""

    nodes: list[Node]
    number: dict[Node, int]  # node -> its number in ``nodes``
    nexts: list[tuple]
    parents: Sequence[Sequence[int]]  # read only: a reused plan's are shared (Note [one plan per graph structure])
    inter: AbstractSet[int]
    w_only: AbstractSet[int]
    union: Mapping[int, int]
    groups: dict[int, GroupSpec]


class FrontierSlot(NamedTuple):
    """An input slot of W's work where B's engine call returns a complete gradient (its fields lead
    those of :class:`CheapLeaf`, which is one too).

    Attributes:
        group: the param group the slot's node belongs to.
        edge: ``GradientEdge(node, input slot)``: the engine captures the gradient flowing in there.
        seq: the largest sequence number among the slot's producers (Note [accumulation order] in
            ``ppbackward._weight_edges``).
    """

    group: GroupSpec
    edge: GradientEdge
    seq: int


class EagerWork(NamedTuple):
    """The W work B does itself (Note [hooked saved tensors run once] in ``ppbackward._saved``).

    Attributes:
        nodes: intermediates and W-only nodes that B runs entirely (W never calls them again).
        frontier: a :class:`FrontierSlot` for every edge from those nodes into the rest of W's
            work (W-only nodes, weight leaves): B's engine call returns the gradient at each, complete
            (every producer of that slot is among ``nodes``), and W starts from it.
    """

    nodes: set[Node]
    frontier: list[FrontierSlot]


class CheapLeaf(NamedTuple):
    """A weight leaf whose whole gradient B computes (Note [cheap weight gradients in B]).

    Attributes:
        group: the param group the leaf belongs to.
        edge: ``GradientEdge(leaf AccumulateGrad, 0)``: B's engine call returns the gradient there.
        seq: the largest sequence number among the intermediates feeding it (Note [accumulation order]
            in ``ppbackward._weight_edges``).
        feeders: the intermediates whose weight edges lead into its component.
    """

    group: GroupSpec
    edge: GradientEdge
    seq: int
    feeders: tuple[Node, ...] = ()


class CheapWork(NamedTuple):
    """The weight gradients B computes in its one engine call (Note [cheap weight gradients in B]).

    Attributes:
        edges: intermediate -> the indices of its weight edges B computes (W calls the node again only
            for its other weight edges, if any).
        leaves: the weight leaves whose gradient B returns complete.
        nodes: the W-only nodes (leaves aside) B runs on the way to those leaves; W never runs them.
    """

    edges: dict[Node, tuple[int, ...]]
    leaves: list[CheapLeaf]
    nodes: list[Node]


NO_CHEAP_WORK = CheapWork({}, [], [])

# Note [cheap weight gradients in B]: a zero-bubble split is worth it for the weight-gradient matrix
# products it defers; every other weight gradient (biases, norm affine parameters, elementwise scales)
# costs W more than it saves. Deferring a LayerNorm's weight gradient runs its backward kernel twice
# (once in B for the input, once in W for the weight) and holds its input activation from B to W for a
# ``d``-element result. So B computes these in its one engine call: it adds the edge into each such
# weight's ``AccumulateGrad`` to the gradients it asks the engine for, the engine computes the edges
# that lead there as part of the nodes it runs anyway (``native_layer_norm_backward`` with all three
# outputs, as a full backward does), and B holds the small results until W, which feeds them to the
# ``AccumulateGrad`` nodes with the rest (hooks, ``.grad`` and reductions see them at W, once).
# The nodes whose every weight edge is computed in B never run in W; B releases what they saved.
#
# The rule, per *weight component* (weight leaves and the W-only nodes that connect them, not joined
# through intermediates): B computes a component when
#   * every edge into it from an intermediate is one whose gradient is a fresh, weight-sized result of
#     an elementwise or normalisation kernel: any weight edge of a norm node or of ``Mul``/``Div``; the
#     bias edge of ``addmm``/``baddbmm``/``addmv``/``convolution`` and the edges of ``Add``/``Sub`` only
#     where the engine reduces the gradient to the weight's smaller shape (``sum_to``: a new tensor);
#   * every W-only node in it is a cast, view or elementwise node (``_CHEAP_W_NODES``), so what B
#     holds is weight-sized, never more than the activation a deferred node would hold;
#   * no stage output leads into it, none of its weights has a tensor hook (``register_hook``: capturing
#     at the weight's ``AccumulateGrad`` would run it in B; it runs in W, once), and B has no hooked work
#     to do (Note [hooked saved tensors run once]: where a node W would run holds a saved tensor through
#     a hook, B's hooked work applies unchanged and this does not).
# Everything else stays in W: matrix products (``mm``, ``addmm``'s operands, ``bmm``, convolution
# weights), embeddings and index ops (a vocabulary-sized gradient is never held between B and W),
# custom ``autograd.Function`` nodes, and any node not in the tables (unknown cost: W, as before).
# Freshness matters for exactness: a gradient that merely aliases the one flowing on (``x + b`` with
# ``b`` of the activation's shape) could be changed in place by a hook later in B; a fresh one is seen
# by nobody else. A component is taken whole, so every gradient reaching its leaves comes from B's call
# (complete, summed by the engine in its own order) and W adds nothing to it.
CHEAP_EDGES: dict[str, tuple[int, ...] | None] = {  # node type -> weight edges with a fresh gradient (None: all)
    "NativeLayerNormBackward0": None,
    "NativeGroupNormBackward0": None,
    "NativeBatchNormBackward0": None,
    "CudnnBatchNormBackward0": None,
    "MiopenBatchNormBackward0": None,
    "_FusedRmsNormBackward0": None,
    "MulBackward0": None,
    "DivBackward0": None,
    "ConvolutionBackward0": (2,),
}
REDUCED_EDGES: dict[str, tuple[int, ...] | None] = {  # fresh only where the engine reduces the gradient
    "AddmmBackward0": (0,),
    "BaddbmmBackward0": (0,),
    "AddmvBackward0": (0,),
    "AddBackward0": None,
    "SubBackward0": None,
}
_CHEAP_W_NODES = frozenset(
    {
        "ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
        "ExpandBackward0", "TBackward0", "PermuteBackward0", "TransposeBackward0", "UnsqueezeBackward0",
        "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "AliasBackward0", "CloneBackward0",
        "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "AddBackward0", "AddBackward1",
        "SubBackward0", "SubBackward1", "RsubBackward1", "NegBackward0", "ExpBackward0", "SqrtBackward0",
        "PowBackward0", "SigmoidBackward0", "TanhBackward0", "SoftplusBackward0",
    }
)


_OUTPUT_RANK = {"AddmmBackward0": 2, "BaddbmmBackward0": 3, "AddmvBackward0": 1}


def fresh_edge(node: Node, name: str, j: int, kid: Node, nr: int) -> bool:
    """Whether the gradient ``node`` (of type ``name``) sends along its edge ``j`` (into input ``nr`` of
    ``kid``) is a new tensor of a cheap kernel (Note [cheap weight gradients in B])."""
    edges = CHEAP_EDGES.get(name, ())
    if edges is None or j in edges:
        return True
    edges = REDUCED_EDGES.get(name, ())
    if edges is not None and j not in edges:
        return False
    # reduced by the engine's sum_to (a new tensor) where the slot has fewer dimensions than the gradient
    rank = _OUTPUT_RANK.get(name)
    try:
        if rank is not None and type(kid) is _ACCUMULATE_GRAD:  # a bias straight into its leaf: no metadata read
            return kid.variable.dim() < rank  # type: ignore[attr-defined]  # AccumulateGrad's leaf
        into = kid._input_metadata[nr].shape  # not in every torch's stub
        out = node._input_metadata[0].shape
    except (AttributeError, IndexError, RuntimeError):  # a torch without it: not cheap
        return False
    return len(into) < len(out)


class Probes(NamedTuple):
    """What :func:`analyze` read of the graph beyond its node types and edges (Note [one plan per graph
    structure] in ``ppbackward._plan``): ``ranks``, ``(leaf number, rank, result)`` of each comparison of a
    bias' dimensions with its matmul's output rank (does the engine reduce its gradient); ``fresh``, ``(node
    number, edge, result)`` of each :func:`fresh_edge` call (shapes at that edge); ``hooked``, ``(leaf
    number, result)`` of each read of whether a weight has tensor hooks."""

    ranks: list[tuple[int, int, bool]]
    fresh: list[tuple[int, int, bool]]
    hooked: list[tuple[int, bool]]


def _cheap_work(
    st: Structure, leaf_groups: list, w_numbers: list[int], intermediates: list, comp: dict[int, int],
    roots: set[int], probes: Probes | None = None,
) -> CheapWork:
    """The weight components B computes (Note [cheap weight gradients in B]): ``leaf_groups`` holds each
    weight leaf's number and param group, ``w_numbers`` the other W-only nodes, ``comp`` the component of
    every W-only node, ``intermediates`` ``(number, weight edges)``. Every read of what is not the graph's
    structure (a shape, a weight's hooks) is recorded in ``probes``, if given."""
    nodes, nexts, number = st.nodes, st.nexts, st.number
    bad = {comp[k] for k in roots if k in comp}
    for i in w_numbers:
        if type(nodes[i]).__name__ not in _CHEAP_W_NODES:
            bad.add(comp[i])
    feeding: dict[int, list[tuple[Node, int]]] = {}  # component -> (intermediate, edge) into it
    for i, w_edges in intermediates:
        node = nodes[i]
        name = type(node).__name__
        custom = isinstance(node, BackwardCFunction)
        for j in w_edges:
            kid, nr = nexts[i][j]
            c = comp[number[kid]]
            if c in bad:
                continue
            # fresh_edge's table lookup inline (Note [no frame per node]); the metadata reads only where needed
            cheap_edges = CHEAP_EDGES.get(name, ())
            if custom:
                fresh = False
            elif cheap_edges is None or j in cheap_edges:
                fresh = True
            elif type(kid) is _ACCUMULATE_GRAD and name in _OUTPUT_RANK:  # a bias straight into its leaf
                reduced = REDUCED_EDGES.get(name, ())
                fresh = reduced is None or j in reduced
                if fresh:
                    rank = _OUTPUT_RANK[name]
                    fresh = kid.variable.dim() < rank  # type: ignore[attr-defined]
                    if probes is not None:
                        probes.ranks.append((number[kid], rank, fresh))  # type: ignore[index]
            else:
                fresh = fresh_edge(node, name, j, kid, nr)
                if probes is not None and name in REDUCED_EDGES:  # elsewhere False by the tables alone
                    probes.fresh.append((i, j, fresh))
            if not fresh:
                bad.add(c)
            else:
                feeding.setdefault(c, []).append((node, j))
    for k, _ in leaf_groups:  # a weight with tensor hooks: B's capture at its AccumulateGrad would run them
        c = comp[k]
        if c in feeding and c not in bad:
            hooked = bool(getattr(nodes[k].variable, "_backward_hooks", None))
            if probes is not None:
                probes.hooked.append((k, hooked))
            if hooked:
                bad.add(c)
    edges: dict[Node, list[int]] = {}
    seq: dict[int, int] = {}
    for c, pairs in feeding.items():
        if c in bad:
            continue
        top = -1
        for node, j in pairs:
            top = max(top, node._sequence_nr())
            edges.setdefault(node, []).append(j)
        seq[c] = top
    if not seq:
        return NO_CHEAP_WORK
    cheap_leaves = []
    new = tuple.__new__  # Note [no frame per node] in ppbackward.backward
    for k, spec in leaf_groups:
        c = comp[k]
        if c in seq:
            feeders: dict[Node, None] = {}
            for n, _ in feeding[c]:
                feeders[n] = None
            edge = new(GradientEdge, (nodes[k], 0))
            cheap_leaves.append(new(CheapLeaf, (spec, edge, seq[c], tuple(feeders))))
    w_nodes = [nodes[i] for i in w_numbers if comp[i] in seq]
    return CheapWork({n: tuple(js) for n, js in edges.items()}, cheap_leaves, w_nodes)


def eager_work(analysis: Analysis, seeds: Sequence[Node] | None) -> EagerWork:
    """The smallest set of W's nodes containing ``seeds`` that B can run entirely (``None``: all of them).

    Closed upwards (whatever feeds a node B runs must run in B too) and over every slot it feeds: each
    edge leaving the set lands on a slot all of whose producers are in the set, so that the gradient
    B's engine call returns there is complete. Linear in the edges of W's nodes.
    """
    st = analysis.structure
    number, w_only, parents, union = st.number, st.w_only, st.parents, st.union
    run_by_w = (st.inter | w_only) - {i for i in w_only if type(st.nodes[i]) is _ACCUMULATE_GRAD}
    # Note [no frame per node] in ppbackward.backward: _w_edges, the walk's producers and _group inline
    w_edges: dict[int, list[tuple[Node, int]]] = {}
    producers: dict[tuple[int, int], list[int]] = {}  # (node, input slot) -> W's nodes with an edge into it
    for i in run_by_w:
        edges = w_edges[i] = []
        for kid, nr in st.nexts[i]:
            if kid is not None and number[kid] in w_only:
                edges.append((kid, nr))
                producers.setdefault((number[kid], nr), []).append(i)
    chosen: set[int] = set()
    todo = list(run_by_w) if seeds is None else [number[n] for n in seeds if number.get(n) in run_by_w]
    while todo:
        i = todo.pop()
        if i in chosen:
            continue
        chosen.add(i)
        for p in parents[i]:  # its producers
            if p in run_by_w and p not in chosen:
                todo.append(p)
        for kid, nr in w_edges[i]:
            k = number[kid]
            if k not in chosen:  # every producer of the slot this edge feeds
                for p in producers[k, nr]:
                    if p not in chosen:
                        todo.append(p)
    new = tuple.__new__
    frontier: dict[GradientEdge, tuple[GroupSpec, int]] = {}
    for i in sorted(chosen):
        seq = st.nodes[i]._sequence_nr()
        for kid, nr in w_edges[i]:
            k = number[kid]
            if k not in chosen:
                edge = new(GradientEdge, (kid, nr))
                r = k
                while union[r] != r:
                    r = union[r]
                group = st.groups.get(r)
                if group is None:
                    group = st.groups[r] = new(GroupSpec, ([], [], []))
                frontier[edge] = (group, max(seq, frontier.get(edge, (group, -1))[1]))
    slots = [new(FrontierSlot, (group, edge, seq)) for edge, (group, seq) in frontier.items()]
    return EagerWork({st.nodes[i] for i in chosen}, slots)


def analyze(
    root_edges: Sequence[GradientEdge], input_nodes: AbstractSet[Node], probes: Probes | None = None,
    walked: Walk | None = None,
) -> Analysis:
    """Split the graph below ``root_edges`` into param groups. See the module docstring.

    Args:
        root_edges: the gradient edge of each differentiable stage output (length = #outputs).
        input_nodes: the gradient-edge nodes of the stage inputs that require grad.
        probes: where to record what the analysis read beyond the graph's structure (``ppbackward._plan``).
        walked: :func:`walk`'s result for these arguments, if the caller has it.

    Returns:
        An :class:`Analysis`.
    """
    walked = walk(root_edges, input_nodes) if walked is None else walked
    nodes, index, nexts = walked.nodes, walked.number, walked.nexts
    parents, leaves = _parents_and_leaves(walked, input_nodes)
    reaches_input = _sweep_up(parents, [index[n] for n in input_nodes if n in index])
    w_only, inter = _weight_side(parents, leaves, reaches_input)
    parent, intermediates, comp = _union_groups(nexts, index, w_only, inter)

    groups: dict[int, GroupSpec] = {}
    for i, edge in enumerate(root_edges):
        k = index[edge.node]
        if k in w_only:
            _group(groups, parent, k).root_edges.append(i)
    new = tuple.__new__  # Note [no frame per node] in ppbackward.backward: a NamedTuple's __new__ is a frame
    for i, w_edges in intermediates:  # BFS order: outputs side first
        r = i
        while parent[r] != r:
            r = parent[r]
        spec = groups.get(r)
        if spec is None:
            spec = groups[r] = new(GroupSpec, ([], [], []))
        spec.intermediates.append(new(Intermediate, (nodes[i], w_edges)))
    leaf_groups = []
    for i in leaves:
        r = i
        while parent[r] != r:
            r = parent[r]
        spec = groups.get(r)
        if spec is None:
            spec = groups[r] = new(GroupSpec, ([], [], []))
        spec.leaves.append(nodes[i])
        leaf_groups.append((i, spec))
    roots = {index[edge.node] for edge in root_edges}
    used = {nodes[i] for i in roots if parents[i]}
    # sorted: a set's order follows its insertion history, here the input nodes' (hashed by address)
    b_only = [nodes[i] for i in sorted(reaches_input) if i not in inter and nodes[i] not in input_nodes]
    leaf_set = set(leaves)
    w_numbers = [i for i in sorted(w_only) if i not in leaf_set]
    w_nodes = [nodes[i] for i in w_numbers]
    consumers: dict[int, None] = {}
    for i in roots:
        for p in parents[i]:
            if p in inter or p in w_only:
                consumers[p] = None
    structure = Structure(nodes, index, nexts, parents, inter, w_only, parent, groups)
    cheap = _cheap_work(structure, leaf_groups, w_numbers, intermediates, comp, roots, probes)
    return Analysis(list(groups.values()), used, b_only, w_nodes, [nodes[i] for i in consumers], structure, cheap)


class Walk(NamedTuple):
    """Pass 1 (Note [linear analysis]), :func:`walk`'s result: the graph below the outputs numbered breadth
    first, each node's edges, and its structure written down as a key (Note [one plan per graph structure]
    in ``ppbackward._plan``).

    Attributes:
        nodes: the nodes, the outputs' first, then in BFS order; input nodes are not expanded.
        number: node -> its number in ``nodes``.
        nexts: each node's ``next_functions`` (``()`` for an input node).
        key: the roots' count and node numbers, then per node its type (by ``id``; ``0`` for an input node),
            its number of edges and each edge's node number and input slot (``-1`` and no slot for an edge to
            nothing): self-delimiting, so two graphs with equal keys have the same structure and numbering.
    """

    nodes: list[Node]
    number: dict[Node, int]
    nexts: list[tuple]
    key: tuple


def walk(root_edges: Sequence[GradientEdge], input_nodes: AbstractSet[Node]) -> Walk:
    """Pass 1 (Note [linear analysis]): BFS from the outputs (``next_functions`` is read once per node: each
    read builds a tuple), numbering nodes and writing down the structure as a key. Input nodes are not
    expanded: the stage ends there. Plain loops (Note [no frame per node] in ``ppbackward.backward``)."""
    number: dict[Node, int] = {}
    nodes: list[Node] = []
    key: list[int] = [len(root_edges)]
    for edge in root_edges:
        k = number.get(edge.node)
        if k is None:
            k = number[edge.node] = len(nodes)
            nodes.append(edge.node)
        key.append(k)
    nexts: list[tuple] = []
    append = key.append
    for node in nodes:  # grows while iterated: a BFS queue
        if node in input_nodes:
            nexts.append(())
            append(0)
            continue
        nf = node.next_functions
        nexts.append(nf)
        append(id(type(node)))
        append(len(nf))
        for kid, nr in nf:
            if kid is None:
                append(-1)
                continue
            k = number.get(kid)
            if k is None:
                k = number[kid] = len(nodes)
                nodes.append(kid)
            append(k)
            append(nr)
    return Walk(nodes, number, nexts, tuple(key))


def _parents_and_leaves(walked: Walk, input_nodes: AbstractSet[Node]) -> tuple[list[list[int]], list[int]]:
    """Pass 1, continued: each node's parents (the nodes with an edge into it, in BFS order) and the weight
    leaves (the ``AccumulateGrad`` nodes that are not input nodes)."""
    nodes, number = walked.nodes, walked.number
    parents: list[list[int]] = [[] for _ in nodes]
    leaves: list[int] = []
    acc = _ACCUMULATE_GRAD
    for i, nf in enumerate(walked.nexts):
        node = nodes[i]
        if type(node) is acc and node not in input_nodes:
            leaves.append(i)
        for kid, _ in nf:
            if kid is not None:
                parents[number[kid]].append(i)
    return parents, leaves


def _sweep_up(parents: Sequence[Sequence[int]], start: list[int]) -> set[int]:
    """Pass 2: ``start`` and every node with a path into it (a sweep up the parent lists)."""
    seen = set(start)
    todo = list(start)
    while todo:
        for p in parents[todo.pop()]:
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def _weight_side(
    parents: Sequence[Sequence[int]], leaves: list[int], reaches_input: set[int]
) -> tuple[set[int], set[int]]:
    """Pass 2, continued: the W-only nodes (a sweep up from the weight leaves that stops at nodes
    reaching an input: those parents are the intermediates), and the intermediates."""
    w_only = set(leaves)
    inter: set[int] = set()
    todo = list(leaves)
    while todo:
        for p in parents[todo.pop()]:
            if p in reaches_input:
                inter.add(p)
            elif p not in w_only:
                w_only.add(p)
                todo.append(p)
    return w_only, inter


def _union_groups(nexts: list[tuple], index: dict[Node, int], w_only: set[int], inter: set[int]) -> tuple:
    """Pass 3: union-find over the edges into W-only nodes; each intermediate (by number, sorted)
    with the indices of its ``next_functions`` that lead into W-only nodes; and the weight component of
    each W-only node (its group before intermediates join them, Note [cheap weight gradients in B])."""
    # Note [no frame per node]: find and union are written inline (a call per edge was most of B's Python)
    parent: dict[int, int] = {i: i for i in w_only}
    for i in w_only:
        for kid, _ in nexts[i]:
            if kid is None:
                continue
            k = index[kid]
            if k not in parent:
                continue
            ra = i
            while parent[ra] != ra:
                ra = parent[ra]
            rb = k
            while parent[rb] != rb:
                rb = parent[rb]
            if ra != rb:
                parent[rb] = ra
            parent[i] = parent[k] = ra  # compress the two paths' ends
    comp: dict[int, int] = {}
    for i in w_only:
        r = i
        while parent[r] != r:
            r = parent[r]
        comp[i] = parent[i] = r
    intermediates: list[tuple[int, tuple[int, ...]]] = []
    for i in sorted(inter):
        nf = nexts[i]
        edges = []
        for j, (kid, _) in enumerate(nf):
            if kid is not None and index[kid] in w_only:
                edges.append(j)
        w_edges = tuple(edges)
        parent[i] = i
        intermediates.append((i, w_edges))
        for j in w_edges:
            rb = index[nf[j][0]]
            while parent[rb] != rb:
                rb = parent[rb]
            ra = i
            while parent[ra] != ra:
                ra = parent[ra]
            if ra != rb:
                parent[rb] = ra
    return parent, intermediates, comp


def _group(groups: dict[int, GroupSpec], parent: dict[int, int], i: int) -> GroupSpec:
    rep = _find(parent, i)
    spec = groups.get(rep)
    if spec is None:
        spec = groups[rep] = GroupSpec([], [], [])
    return spec
