"""An AOTAutograd backward FX graph cut in two at its weight outputs: the input half and the weight half.

Private module used by ``ppbackward._compiled`` (Note [compiled regions split in two] there); pure FX, no
autograd and no compiler.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx

__all__ = ["CannotSplit", "GraphHalves", "split_backward_graph"]


class CannotSplit(Exception):
    """The graph cannot be cut as asked; the message says why (the region then runs whole in B)."""


class GraphHalves(NamedTuple):
    """What :func:`split_backward_graph` returns.

    Attributes:
        input_graph: the whole graph's placeholders; returns every output (``None`` at the weight
            outputs), then the live-ins.
        weight_graph: placeholders: the held inputs, then the live-ins; returns the weight outputs in order.
        held: indices, among the whole graph's placeholders, of the inputs the weight half takes: every size
            input (a SymInt or int placeholder) first, whether it reads it or not (Note [weight halves bind
            every size]), then the saved tensors and incoming gradients it reads.
        n_live: how many live-ins the input half returns last.
    """

    input_graph: fx.GraphModule
    weight_graph: fx.GraphModule
    held: tuple[int, ...]
    n_live: int


def split_backward_graph(gm: fx.GraphModule, w_outputs: tuple[int, ...]) -> GraphHalves:
    """Cut an AOTAutograd backward graph at its weight outputs.

    Every op only the weight outputs need goes to the weight half, every other op to the input half, so
    each op of the graph runs exactly once. What the weight half reads from the input half's values (the
    *live-ins*, e.g. the gradient flowing into a linear layer's matmul) the input half returns last. A
    multi-output op (``convolution_backward``) stays whole on the input side with its ``getitem``s: a
    tuple is never a live-in, its tensors are.

    Args:
        gm: the backward graph: placeholders (saved tensors, sizes, incoming gradients), one output node
            returning one gradient (or ``None``) per forward input, then any extra outputs (tokens, the RNG
            offset), which stay with the input half.
        w_outputs: the output indices that go to weights, sorted.

    Raises:
        CannotSplit: an index is not an output of the graph.
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    (output,) = [n for n in nodes if n.op == "output"]
    outs = output.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if w_outputs and w_outputs[-1] >= len(outs):
        raise CannotSplit(f"its backward graph has {len(outs)} outputs, output {w_outputs[-1]} was asked")
    w_set = set(w_outputs)
    input_side = _ancestors([o for i, o in enumerate(outs) if i not in w_set])
    weight_side = _ancestors([outs[i] for i in w_outputs])
    only = {n for n in nodes if n in weight_side and n not in input_side and n.op == "call_function"}
    for n in list(only):  # a getitem of a multi-output op that stays on the input side stays there too
        if _is_getitem(n) and n.args[0] not in only:
            only.discard(n)
    weight_only = [n for n in nodes if n in only]
    live: list[fx.Node] = []
    for n in weight_only:
        for a in n.all_input_nodes:
            if a not in only and a not in live:
                live.append(a)
    for i in w_outputs:
        o = outs[i]
        if isinstance(o, fx.Node) and o not in only and o not in live:
            live.append(o)
    # Note [weight halves bind every size]: under dynamic shapes the backward takes its symbolic sizes as
    # placeholders (a SymInt, or an int, ``val`` in their meta); the weight half's tensors may carry only a
    # product of them (a view's ``s0*s1``), from which a compiler cannot recover each symbol (inductor: "expected
    # [s0, s1] to have been codegen-ed"), so the weight half takes every size placeholder, first
    sizes = [n for n in placeholders if isinstance(n.meta.get("val"), (torch.SymInt, int))]
    held = sizes + [n for n in live if n.op == "placeholder" and n not in sizes]
    computed = [n for n in live if n.op != "placeholder"]

    graph_i = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op != "output" and n not in only:
            env[n] = graph_i.node_copy(n, env.__getitem__)
    returned = [None if (i in w_set or o is None) else env[o] for i, o in enumerate(outs)]
    graph_i.output(tuple(returned + [env[n] for n in computed]))

    graph_w = fx.Graph()
    env_w: dict[fx.Node, fx.Node] = {}
    for k, n in enumerate(held + computed):  # names outside "tangents*": inductor counts those as static
        p = graph_w.placeholder(f"weight_half_input_{k}")
        p.meta = dict(n.meta)
        env_w[n] = p
    for n in weight_only:
        env_w[n] = graph_w.node_copy(n, env_w.__getitem__)
    graph_w.output(tuple(None if outs[i] is None else env_w[outs[i]] for i in w_outputs))

    index = {n: k for k, n in enumerate(placeholders)}
    return GraphHalves(
        fx.GraphModule(gm, graph_i), fx.GraphModule(gm, graph_w), tuple(index[n] for n in held), len(computed)
    )


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem"


def _ancestors(seeds: list) -> set:
    seen: set = set()
    stack = [n for n in seeds if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen
