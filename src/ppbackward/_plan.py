"""One analysis per graph structure: B reuses a stage's plan while its microbatches' graphs keep their shape.

Private module, used by ``ppbackward.backward`` (B) in place of ``ppbackward._graph.analyze``.

Note [one plan per graph structure]: every microbatch of a stage builds the same autograd graph again, the
same node types joined the same way, and B's analysis of it (``ppbackward._graph.analyze``: the sweeps, the
union-find of param groups, the classes of Note [cheap weight gradients in B]) depends only on

* that structure: the node types and, per node, its edges (the node each leads to and its input slot);
* which nodes are the stage inputs' (the walk stops there) and which the outputs' (the roots);
* what the analysis reads beyond it, recorded as it reads it (``_graph.Probes``): a bias' rank against its
  matmul's output and the shapes at an edge whose gradient it asks whether the engine reduces (``fresh_edge``),
  and whether a weight has tensor hooks;
* the tables of Note [cheap weight gradients in B] (``CHEAP_EDGES``, ``REDUCED_EDGES``, ...), taken as
  constant: whoever changes them (the bench's measurement switch) calls :func:`forget_plans`.

So the walk every analysis starts with (``ppbackward._graph.walk``, B's one walk over the graph) also writes the
structure down as a key: the roots' node numbers, then per node its type (by ``id``; ``0`` for an input node,
which is not expanded), its number of edges and each edge's node number and input slot (``-1`` for an edge to
nothing, with no slot). The key is self-delimiting, so two graphs with the same key have the same structure and
the same numbering, the one the plan is written in. For a key seen before, B replays the recorded probes
on this graph's nodes; if every result is the same, the stored plan (everything the analysis returns, by node
number) is mapped onto this graph's nodes, which gives exactly what a fresh analysis would, in the same
orders. Otherwise, and for a new key, B analyses afresh and stores the plan. Nothing per microbatch is stored:
sequence numbers (Note [accumulation order] in ``ppbackward._weight_edges``) are read from this graph's
nodes when the plan is mapped. What this saves per microbatch: the sweeps, the union-find and the cheap
classes, i.e. the analysis less its walk (``benchmarks/RESULTS.md``, "One plan per graph structure").

Nothing of a graph is kept alive: a plan holds node numbers, edge indices and flags (read only: tuples and a
read-only mapping, shared by every analysis mapped from it), and its key holds types by ``id``. A type can die
(a custom ``autograd.Function`` defined in a function, a compiled region's backward class) and its ``id`` be
reused, so the plan keeps a weak reference to every node type of its graph and is not replayed once one has
died (a fresh analysis replaces it). At most ``_LIMIT`` plans are kept, the oldest stored dropped first; each
holds about 330 bytes per node of its graph (a 673-node stage: 220 KB). Storing takes a lock; looking up and
replaying do not (a plan is never changed once stored). ``PPBACKWARD_VERIFY_PLANS=1`` (the test suite sets it)
compares every mapped plan with a fresh analysis and raises on the first difference.
"""

from __future__ import annotations

import os
import threading
import types
import weakref
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

from torch.autograd.graph import GradientEdge, Node

from ppbackward._graph import (
    NO_CHEAP_WORK,
    Analysis,
    CheapLeaf,
    CheapWork,
    GroupSpec,
    Intermediate,
    Probes,
    Structure,
    analyze,
    fresh_edge,
    walk,
)

__all__ = ["VERIFY", "analyze_planned", "forget_plans", "plans_held"]  # private module

# Note [one plan per graph structure]: compare each mapped plan with a fresh analysis (the test suite's setting)
VERIFY = os.environ.get("PPBACKWARD_VERIFY_PLANS", "") == "1"
_LIMIT = 16  # plans kept: a rank's stages (virtual stages too) times the shapes its microbatches take


class _Plan(NamedTuple):
    """An :class:`~ppbackward._graph.Analysis` by node number (Note [one plan per graph structure])."""

    probes: Probes
    types: tuple[weakref.ref, ...]  # every node type of the graph: a dead one may have lent its id
    groups: tuple[tuple[tuple[tuple[int, tuple[int, ...]], ...], tuple[int, ...], tuple[int, ...]], ...]
    group_roots: tuple[int, ...]  # the union-find root of each group (the structure's ``groups`` keys)
    used: tuple[int, ...]
    b_only: tuple[int, ...]
    w_only: tuple[int, ...]
    consumers: tuple[int, ...]
    # (intermediate, its edges B computes), (group, leaf, feeders), W-only nodes B runs; None: no cheap work
    cheap: tuple[tuple, tuple, tuple[int, ...]] | None
    parents: tuple[tuple[int, ...], ...]  # the structure's (eager_work and B's error messages read them)
    inter: frozenset[int]
    w_set: frozenset[int]
    union: Mapping[int, int]


_PLANS: dict[tuple, _Plan] = {}
_STORING = threading.Lock()


def plans_held() -> int:
    """How many plans are kept (at most ``_LIMIT``)."""
    return len(_PLANS)


def forget_plans() -> None:
    """Drop every plan: for whoever changes the analysis' tables (the bench's measurement switches)."""
    with _STORING:
        _PLANS.clear()


def analyze_planned(root_edges: Sequence[GradientEdge], input_nodes: AbstractSet[Node]) -> Analysis:
    """``ppbackward._graph.analyze(root_edges, input_nodes)``, from the stored plan of this graph's structure
    where there is one whose probes give the same results here (Note [one plan per graph structure]).

    Args:
        root_edges: the gradient edge of each differentiable stage output.
        input_nodes: the gradient-edge nodes of the stage inputs that require grad.

    Returns:
        The :class:`~ppbackward._graph.Analysis` a fresh analysis gives, in the same orders.

    Raises:
        AssertionError: with ``PPBACKWARD_VERIFY_PLANS=1`` only, a mapped plan differs from a fresh analysis.
    """
    walked = walk(root_edges, input_nodes)
    plan = _PLANS.get(walked.key)
    if plan is not None and _replays(plan, walked.nodes, walked.nexts):
        analysis = _mapped(plan, walked.nodes, walked.number, walked.nexts)
        if VERIFY:
            _verify(analysis, analyze(root_edges, input_nodes))
        return analysis
    probes = Probes([], [], [])
    analysis = analyze(root_edges, input_nodes, probes, walked)
    plan = _plan_of(analysis, probes)
    with _STORING:  # one thread's eviction must not meet another's store
        _PLANS.pop(walked.key, None)  # stored again: it counts as the newest
        while _PLANS and len(_PLANS) >= _LIMIT:
            del _PLANS[next(iter(_PLANS))]
        if _LIMIT > 0:
            _PLANS[walked.key] = plan
    return analysis


def _replays(plan: _Plan, nodes: list[Node], nexts: list[tuple]) -> bool:
    """Whether every probe of ``plan`` gives the same result on this graph, and its types are alive."""
    for ref in plan.types:
        if ref() is None:
            return False
    for k, rank, result in plan.probes.ranks:  # Note [no frame per node] in ppbackward.backward: inline
        if (nodes[k].variable.dim() < rank) is not result:  # type: ignore[attr-defined]  # an AccumulateGrad
            return False
    for i, j, result in plan.probes.fresh:
        node = nodes[i]
        kid, nr = nexts[i][j]
        if fresh_edge(node, type(node).__name__, j, kid, nr) is not result:
            return False
    for k, result in plan.probes.hooked:
        if (not getattr(nodes[k].variable, "_backward_hooks", None)) is result:  # type: ignore[attr-defined]
            return False
    return True


def _plan_of(analysis: Analysis, probes: Probes) -> _Plan:
    """``analysis`` by node number (its walk's numbering, the key's)."""
    st = analysis.structure
    n = st.number
    groups = tuple(
        (
            tuple([(n[inter.node], inter.w_edges) for inter in spec.intermediates]),
            tuple(spec.root_edges),
            tuple([n[leaf] for leaf in spec.leaves]),
        )
        for spec in analysis.groups
    )
    place = {id(spec): g for g, spec in enumerate(analysis.groups)}
    cheap = analysis.cheap
    cheap_plan = None
    if cheap is not NO_CHEAP_WORK:
        cheap_plan = (
            tuple([(n[node], js) for node, js in cheap.edges.items()]),
            tuple([(place[id(x.group)], n[x.edge.node], tuple([n[f] for f in x.feeders])) for x in cheap.leaves]),
            tuple([n[node] for node in cheap.nodes]),
        )
    return _Plan(
        probes,
        tuple({type(node): weakref.ref(type(node)) for node in st.nodes}.values()),
        groups,
        tuple(st.groups),
        tuple([n[node] for node in analysis.used_nodes]),
        tuple([n[node] for node in analysis.b_only]),
        tuple([n[node] for node in analysis.w_only]),
        tuple([n[node] for node in analysis.output_consumers]),
        cheap_plan,
        tuple([tuple(p) for p in st.parents]),
        frozenset(st.inter),
        frozenset(st.w_only),
        types.MappingProxyType(dict(st.union)),
    )


def _mapped(plan: _Plan, nodes: list[Node], number: dict[Node, int], nexts: list[tuple]) -> Analysis:
    """``plan`` on this graph's ``nodes``: the analysis a fresh one would give (Note [one plan per graph
    structure]). Plain loops, tuples made by ``tuple.__new__`` (Note [no frame per node] in
    ``ppbackward.backward``)."""
    new = tuple.__new__
    specs = []
    for inters, roots, leaves in plan.groups:
        found = []
        for i, w_edges in inters:
            found.append(new(Intermediate, (nodes[i], w_edges)))
        found_leaves = []
        for k in leaves:
            found_leaves.append(nodes[k])
        specs.append(new(GroupSpec, (found, list(roots), found_leaves)))
    cheap = NO_CHEAP_WORK
    if plan.cheap is not None:
        edges_plan, leaves_plan, w_plan = plan.cheap
        edges = {}
        for i, js in edges_plan:
            edges[nodes[i]] = js
        cheap_leaves = []
        for g, k, feeder_numbers in leaves_plan:
            feeders = []
            seq = -1
            for i in feeder_numbers:  # the sequence numbers are this graph's (Note [accumulation order])
                node = nodes[i]
                feeders.append(node)
                seq = max(seq, node._sequence_nr())
            cheap_leaves.append(new(CheapLeaf, (specs[g], new(GradientEdge, (nodes[k], 0)), seq, tuple(feeders))))
        cheap = new(CheapWork, (edges, cheap_leaves, [nodes[i] for i in w_plan]))
    structure = new(
        Structure,
        (nodes, number, nexts, plan.parents, plan.inter, plan.w_set, plan.union, dict(zip(plan.group_roots, specs))),
    )
    return new(
        Analysis,
        (
            specs,
            {nodes[i] for i in plan.used},
            [nodes[i] for i in plan.b_only],
            [nodes[i] for i in plan.w_only],
            [nodes[i] for i in plan.consumers],
            structure,
            cheap,
        ),
    )


def _verify(got: Analysis, fresh: Analysis) -> None:
    """Raise ``AssertionError`` naming the first part where a mapped plan differs from a fresh analysis."""
    place = {id(spec): g for g, spec in enumerate(got.groups)}
    fresh_place = {id(spec): g for g, spec in enumerate(fresh.groups)}

    def spec_form(spec: GroupSpec) -> tuple:
        return (
            [(id(inter.node), inter.w_edges) for inter in spec.intermediates], list(spec.root_edges),
            [id(leaf) for leaf in spec.leaves],
        )

    def cheap_form(cheap: CheapWork, where: dict) -> tuple:
        return (
            [(id(node), js) for node, js in cheap.edges.items()],
            [(where[id(leaf.group)], id(leaf.edge.node), leaf.edge.output_nr, leaf.seq, [id(f) for f in leaf.feeders])
             for leaf in cheap.leaves],
            [id(node) for node in cheap.nodes],
        )

    def structure_form(st: Structure, specs: list) -> tuple:
        where = {id(spec): g for g, spec in enumerate(specs)}
        return (
            [id(node) for node in st.nodes], {id(node): i for node, i in st.number.items()},
            [tuple((id(kid), nr) for kid, nr in nf) for nf in st.nexts], [list(p) for p in st.parents],
            set(st.inter), set(st.w_only), dict(st.union), {r: where[id(spec)] for r, spec in st.groups.items()},
        )

    parts = {
        "groups": ([spec_form(s) for s in got.groups], [spec_form(s) for s in fresh.groups]),
        "used_nodes": ({id(n) for n in got.used_nodes}, {id(n) for n in fresh.used_nodes}),
        "b_only": ([id(n) for n in got.b_only], [id(n) for n in fresh.b_only]),
        "w_only": ([id(n) for n in got.w_only], [id(n) for n in fresh.w_only]),
        "output_consumers": ([id(n) for n in got.output_consumers], [id(n) for n in fresh.output_consumers]),
        "cheap": (cheap_form(got.cheap, place), cheap_form(fresh.cheap, fresh_place)),
        "structure": (structure_form(got.structure, got.groups), structure_form(fresh.structure, fresh.groups)),
    }
    for name, (a, b) in parts.items():
        if a != b:
            raise AssertionError(f"ppbackward: a reused analysis plan differs from a fresh analysis in {name}")
