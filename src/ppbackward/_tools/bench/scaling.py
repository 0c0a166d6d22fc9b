"""Graph analysis time against graph size, to show ``ppbackward._graph.analyze`` is linear.

Private module. For stacks of growing depth (d 64, seq 16), builds the graph with one forward and
times exactly the call ``stage_backward_input`` makes: ``analyze(root_edges, input_nodes)``. The
graph size is the nodes and edges that analysis walks (from the output's gradient edge along
``next_functions``, not below the input nodes). Upstream's analysis
(``construct_reverse_graph`` + ``get_param_groups``, one reverse walk per parameter) is timed on the
same graphs for contrast.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from torch.distributed.pipelining import _backward as _upstream

from ppbackward._gc_pause import automatic_gc_paused
from ppbackward._graph import analyze, gradient_edge
from ppbackward._tools.harness.models import Config, build

__all__ = ["DEPTHS", "QUICK_DEPTHS", "measure"]  # private module: what other modules use

DEPTHS = (1, 2, 4, 8, 16, 32)
QUICK_DEPTHS = (1, 2, 4)


def graph_size(roots: list[Any], stop: set[Any]) -> tuple[int, int]:
    """(nodes, edges) reachable from ``roots`` along ``next_functions``, not expanding ``stop``."""
    seen = set(roots)
    stack = list(roots)
    edges = 0
    while stack:
        node = stack.pop()
        if node in stop:
            continue
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            edges += 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return len(seen), edges


def _min_time(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        with automatic_gc_paused(always=True):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def measure(depths: tuple[int, ...] = DEPTHS, repeats: int = 15, upstream: bool = True) -> dict[str, Any]:
    """Time the analysis at each depth; returns the points and a least-squares fit ``t = a + b*size``."""
    points = []
    for layers in depths:
        stage = build(Config(layers, 64, 16))
        out = stage.model(stage.x)
        root_edges = [gradient_edge(out)]
        input_nodes = {gradient_edge(stage.x).node}
        nodes, edges = graph_size([e.node for e in root_edges], input_nodes)
        t = _min_time(functools.partial(analyze, root_edges, input_nodes), repeats)
        point = {
            "layers": layers,
            "nodes": nodes,
            "edges": edges,
            "size": nodes + edges,
            "analyze_us": t * 1e6,
            "us_per_unit": t * 1e6 / (nodes + edges),
        }
        if upstream:
            weight_nodes = [gradient_edge(p).node for p in stage.params]

            up = functools.partial(_upstream_analysis, out.grad_fn, list(input_nodes), weight_nodes)
            point["upstream_us"] = _min_time(up, max(3, repeats // 3)) * 1e6
            del up
        points.append(point)
        del out, root_edges, input_nodes
    return {"points": points, "fit": _fit(points)}


def _upstream_analysis(root: Any, input_nodes: list[Any], weight_nodes: list[Any]) -> None:
    """torch's B-side analysis of one graph: the reverse graph, then the param groups."""
    rev = _upstream.construct_reverse_graph([root])
    _upstream.get_param_groups(input_nodes, weight_nodes, rev)


def _fit(points: list[dict[str, Any]]) -> dict[str, float]:
    xs = [float(p["size"]) for p in points]
    ys = [float(p["analyze_us"]) for p in points]
    n = len(xs)
    if n < 2:
        return {}
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    return {
        "intercept_us": a,
        "us_per_unit": b,
        "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0,
        # per-unit cost of the largest graph over that of the smallest: ~1 when linear
        "per_unit_growth": points[-1]["us_per_unit"] / points[0]["us_per_unit"],
    }
