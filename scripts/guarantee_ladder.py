"""Issue 36, item 6: a minimal split on the bench stage with ppbackward's guarantees added one at a time, each
rung timed side by side with the full backward and ppbackward in one process (``bench --split``'s harness).

    python scripts/guarantee_ladder.py [CONFIGS] [REPEATS]      e.g. ... 4x16x4,16x64x16,4x128x16 30
    python scripts/guarantee_ladder.py --check                  exactness of every rung (torch.equal)
    python scripts/guarantee_ladder.py --compile [CONFIGS] [REPEATS] [BACKEND]   issue 37's floor (below)
    python scripts/guarantee_ladder.py --check --compile [BACKEND]
    python scripts/guarantee_ladder.py --pieces [CONFIGS] [REPEATS]     ppbackward's contract, piece by piece (below)

Every rung is exact on the bench stage (``--check``: each ``.grad`` and input gradient bit-identical to a
full backward's, grads accumulating over four microbatches, B1 B2 W1 B3 W2 B4 W3 W4). Only the bench
stage: a stack of ``nn.TransformerEncoderLayer``, whose weight matmuls are ``addmm``/``mm`` nodes with a
``TBackward0`` into the weight's ``AccumulateGrad`` and whose other weights (biases, norms) get their
gradients in B; a rung refuses any other graph. The rungs:

* ``r0 floor``: one walk over the graph (node types only); B one engine call, not keeping the graph, whose
  ``inputs`` are the stage input, a ``GradientEdge`` into each weight matmul (the engine captures the
  gradient flowing into it: no Python hook) and the other weights' ``AccumulateGrad`` edges (their gradients
  computed in B); each matmul's ``mat1`` taken out before. W: ``grad.t().mm(mat1)`` per weight (torch's
  ``mm_mat2_backward`` for a column-major ``mat2``, then ``TBackward0``) and ``.grad`` written directly
  (``add_``, or the gradient itself when empty): no engine, no hook of any parameter.
* ``r1 +AccumulateGrad``: W hands every gradient to one engine call into the graph's ``TBackward0`` /
  ``AccumulateGrad`` nodes, so parameter hooks, post-accumulate hooks (DDP, FSDP2, optimizer-in-backward)
  and the grad layout are a full backward's.
* ``r2 +capture after tensor hooks``: B captures by a Python node pre-hook per matmul (the gradient after the
  activation's tensor hooks, with its version for the in-place check), not by ``GradientEdge``.
* ``r3 +general graphs``: B's graph analysis is ppbackward's (any graph: intermediates, param groups, the
  weight gradients B computes itself; ``ppbackward._graph.analyze``) instead of the type walk.
* ``r3p +one plan per structure``: the same analysis the way ppbackward's B runs it, a stored plan reused per
  graph structure (``ppbackward._plan.analyze_planned``: the walk and its key, the probes replayed, the plan
  mapped onto this graph's nodes): this design's cheapest analysis of any graph (the rung itself, like every
  rung, runs only the bench stage).
* ``pp``: ppbackward (torch's B/W contract: output trees and their errors, param groups read and written like
  torch's, version checks at W, saved-tensor hooks, custom Functions, compiled regions, DTensor, W in chunks,
  no collection inside B and W, hooks registered during B, outputs claimed and detached).

``--pieces`` times what ppbackward adds beyond ``r3p``, each piece by the guarantee it keeps: the functions B and W
call, each wrapped with a clock in place (``ppbackward.backward``'s module names and ``ParamGroups``' methods; a
wrapper costs well under a microsecond), in rounds interleaved with the full backward, ``r2`` and ``r3p``, grads
accumulating; medians over the rounds, in µs and as a fraction of the full backward. What no piece names (context
managers: claims, the gc pause, muted hooks; the lines of B and W between calls) is ``the rest``.

Issue 37, item 4 (``--compile``): the same ladder's first rungs on the bench stage with every layer compiled
(``compile_layers``, backend ``inductor`` unless given), ppbackward installed (so each region's backward is
compiled through its splitting compiler, Note [compiled regions split in two] in ``ppbackward._compiled``),
against the compiled full backward (each region's compiled backward run whole). What the rungs keep of
ppbackward is the compiled halves themselves (the cut and its two compiled graphs) and the hook that makes a
region run its input half (``ppbackward._compiled.splitting``); everything else is the script's own:

* ``c0 floor``: a walk by node type finding the regions and their edges into ``AccumulateGrad`` nodes; B one
  engine call, not keeping the graph, naming only the stage input (each region runs its input half); W runs
  each region's weight half and writes ``.grad`` directly (``add_``, or the gradient itself when empty).
* ``c1 +AccumulateGrad``: W hands the weight halves' gradients to one engine call into the graph's
  ``AccumulateGrad`` nodes (parameter hooks, post-accumulate hooks, the grad layout); ``c1 per region``: the
  same, one engine call per region right after its weight half (one region's gradients alive at a time).
* ``c2 +one plan per structure``: ``c1 per region`` with the regions found by ppbackward's analysis as its B runs
  it (``ppbackward._plan.analyze_planned``, Note [one plan per graph structure]) instead of the type walk: an
  analysis of any graph (the rung runs only the bench stage); what ppbackward adds beyond it is torch's B/W contract.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import sys
from collections.abc import Callable, Iterator

import torch
from _usage import exit_if_help
from torch.autograd.graph import GradientEdge, _engine_run_backward

from ppbackward._compiled import is_region, splitting
from ppbackward._graph import analyze, gradient_edge
from ppbackward._plan import analyze_planned
from ppbackward.backward import _deferred


def _types() -> dict[str, type]:
    a = torch.zeros(2, 2, requires_grad=True)
    leaf = torch.zeros(2, requires_grad=True)
    return {
        "addmm": type(torch.addmm(a, a, a.t()).grad_fn),
        "mm": type(torch.mm(a, a.t()).grad_fn),
        "t": type(a.t().grad_fn),
        "acc": type(leaf.view_as(leaf).grad_fn.next_functions[0][0]),  # type: ignore[union-attr]
    }


_T = _types()
_MAT2 = {_T["addmm"]: (2, "_saved_mat1"), _T["mm"]: (1, "_saved_self")}


class _State:
    """What B hands to W: per weight matmul (t node, acc node, mat1, gradient), per other weight (acc node,
    gradient)."""

    __slots__ = ("cheap", "mms")

    def __init__(self, mms: list, cheap: list) -> None:
        self.mms = mms
        self.cheap = cheap


def _walk(root) -> tuple[list, list]:
    """Weight matmuls ``(node, t_node, acc)`` and the other weights' ``AccumulateGrad`` nodes, by node type."""
    seen = {root}
    stack = [root]
    mms, accs, in_mm = [], [], set()
    while stack:
        n = stack.pop()
        nf = n.next_functions
        found = _MAT2.get(type(n))
        if found is not None:
            t = nf[found[0]][0]
            if type(t) is _T["t"]:
                acc = t.next_functions[0][0]
                mms.append((n, t, acc))
                in_mm.add(acc)
        elif type(n) is _T["acc"]:
            accs.append(n)
        for f, _ in nf:
            if f is not None and f not in seen:
                seen.add(f)
                stack.append(f)
    return mms, [a for a in accs if a not in in_mm]


def _from_analysis(out: torch.Tensor, x: torch.Tensor, analysis: Callable) -> tuple[list, list]:
    """The same lists from ppbackward's general analysis (``analysis``: ``analyze``, or ``analyze_planned`` as B
    runs it): the deferred intermediates' weight matmuls, and the leaves whose gradients B computes."""
    a = analysis([gradient_edge(out)], {gradient_edge(x).node})
    mms = []
    for spec in a.groups:
        for node, w_edges in spec.intermediates:
            found = _MAT2.get(type(node))
            if found is not None and found[0] in w_edges and found[0] not in a.cheap.edges.get(node, ()):
                t = node.next_functions[found[0]][0]
                mms.append((node, t, t.next_functions[0][0]))
    return mms, [leaf.edge.node for leaf in a.cheap.leaves]


def _capture(box: list, grads: tuple) -> None:
    box.append((grads, [g._version if g is not None else -1 for g in grads]))


def _b(outputs, grads, inputs, weights, *, analysis: Callable | None, hooks: bool):
    out, grad, x = outputs[0], grads[0], inputs[0]
    mms, cheap = _walk(out.grad_fn) if analysis is None else _from_analysis(out, x, analysis)
    taken = [getattr(n, _MAT2[type(n)][1]) for n, _, _ in mms]
    edges = [GradientEdge(a, 0) for a in cheap]
    if hooks:
        boxes: list[list] = [[] for _ in mms]
        handles = [n.register_prehook(functools.partial(_capture, box)) for (n, _, _), box in zip(mms, boxes)]
        try:
            res = _engine_run_backward((out,), (grad,), False, False, (x, *edges), True, False)
        finally:
            for h in handles:
                h.remove()
        dys = [box[0][0][0] for box in boxes]
        cheap_grads = res[1:]
    else:
        res = _engine_run_backward(
            (out,), (grad,), False, False, (x, *[GradientEdge(n, 0) for n, _, _ in mms], *edges), True, False
        )
        dys = list(res[1 : 1 + len(mms)])
        cheap_grads = res[1 + len(mms) :]
    state = _State(
        [(t, acc, x1, dy) for (_, t, acc), x1, dy in zip(mms, taken, dys)], list(zip(cheap, cheap_grads))
    )
    return (res[0],), state


def _w_direct(weights, state: _State) -> None:
    with torch.no_grad():
        for _, acc, x1, dy in state.mms:
            _accumulate(acc.variable, dy.t().mm(x1))
        for acc, g in state.cheap:
            if g is not None:
                _accumulate(acc.variable, g)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


def _w_engine(weights, state: _State) -> None:
    roots, grads, inputs = [], [], []
    with torch.no_grad():
        for t, acc, x1, dy in state.mms:
            roots.append(GradientEdge(t, 0))
            grads.append(dy.t().mm(x1).t())
            inputs.append(GradientEdge(acc, 0))
    for acc, g in state.cheap:
        if g is not None:
            roots.append(GradientEdge(acc, 0))
            grads.append(g)
            inputs.append(GradientEdge(acc, 0))
    _engine_run_backward(tuple(roots), tuple(grads), False, False, tuple(inputs), True, True)


RUNGS = {
    "r0 floor": (functools.partial(_b, analysis=None, hooks=False), _w_direct),
    "r1 +AccumulateGrad": (functools.partial(_b, analysis=None, hooks=False), _w_engine),
    "r2 +capture after hooks": (functools.partial(_b, analysis=None, hooks=True), _w_engine),
    "r3 +general graphs": (functools.partial(_b, analysis=analyze, hooks=True), _w_engine),
    "r3p +one plan per structure": (functools.partial(_b, analysis=analyze_planned, hooks=True), _w_engine),
}


def _regions(out: torch.Tensor, stop) -> list:
    """``(region node, its edges into AccumulateGrad nodes other than ``stop``, the stage input's)`` of every
    compiled region below ``out``."""
    root = out.grad_fn
    seen = {root}
    stack = [root]
    found = []
    while stack:
        n = stack.pop()
        nf = n.next_functions
        if is_region(n):
            found.append((n, tuple(i for i, (f, _) in enumerate(nf) if type(f) is _T["acc"] and f is not stop)))
        for f, _ in nf:
            if f is not None and f not in seen:
                seen.add(f)
                stack.append(f)
    return found


def _planned_regions(out: torch.Tensor, stop) -> list:
    """``_regions``' list from ppbackward's analysis as its B runs it (one plan per graph structure): the
    intermediates whose weight work B defers, with their weight edges, chosen by B's own ``_deferred``; on the
    bench stage all compiled regions, and nothing whose weight gradients B computes itself (refused otherwise: this
    rung's B names only the stage input)."""
    a = analyze_planned([gradient_edge(out)], {stop})
    found = list(zip(*_deferred(a.groups, set(), a.cheap.edges)))
    assert all(is_region(node) for node, _ in found), "an intermediate that is not a compiled region"
    assert not a.cheap.leaves, "weight gradients B computes itself: this rung does not return them"
    return found


def _b_compiled(outputs, grads, inputs, weights, *, regions: Callable):
    out, grad, x = outputs[0], grads[0], inputs[0]
    with splitting(regions(out, gradient_edge(x).node), []) as plans:
        res = _engine_run_backward((out,), (grad,), False, False, (x,), True, False)
    pending = [(node, plan.pending) for node, plan in plans.items()]
    assert all(p is not None for _, p in pending), "a region ran whole (compiled before install?)"
    return (res[0],), pending


def _w_compiled_direct(weights, pending: list) -> None:
    for node, half in pending:
        nf = node.next_functions
        for i, g in zip(half.positions, half.run(node)):
            if g is not None:
                with torch.no_grad():
                    _accumulate(nf[i][0].variable, g)


def _w_compiled_engine(weights, pending: list) -> None:
    roots, grads = [], []
    for node, half in pending:
        nf = node.next_functions
        for i, g in zip(half.positions, half.run(node)):
            if g is not None:
                roots.append(GradientEdge(nf[i][0], 0))
                grads.append(g)
    _engine_run_backward(tuple(roots), tuple(grads), False, False, tuple(roots), True, True)


def _w_compiled_engine_each(weights, pending: list) -> None:
    """``c1``, one accumulating engine call per region, right after its weight half: one region's weight
    gradients alive at a time (the allocator's cost of holding them all, at d 256)."""
    for node, half in pending:
        nf = node.next_functions
        roots, grads = [], []
        for i, g in zip(half.positions, half.run(node)):
            if g is not None:
                roots.append(GradientEdge(nf[i][0], 0))
                grads.append(g)
        _engine_run_backward(tuple(roots), tuple(grads), False, False, tuple(roots), True, True)


COMPILED_RUNGS = {
    "c0 floor": (functools.partial(_b_compiled, regions=_regions), _w_compiled_direct),
    "c1 +AccumulateGrad": (functools.partial(_b_compiled, regions=_regions), _w_compiled_engine),
    "c1 per region": (functools.partial(_b_compiled, regions=_regions), _w_compiled_engine_each),
    "c2 +one plan per structure": (functools.partial(_b_compiled, regions=_planned_regions), _w_compiled_engine_each),
}


def _compiled_stage(cfg, backend: str):
    """``cfg``'s bench stage with every layer compiled by ``backend``, ppbackward installed first. Dynamo is reset
    first: every configuration's layers share their code, so a second one would recompile with its sizes as
    symbols (automatic dynamic shapes), where ``bench --compile`` compiles one configuration, static."""
    import ppbackward
    from ppbackward._tools.harness.models import build
    from ppbackward._tools.harness.schedule_bench import compile_layers

    torch._dynamo.reset()
    ppbackward.install()
    stage = build(cfg)
    compile_layers(stage.model, backend)
    return stage


def check_compiled(backend: str) -> None:
    """Every compiled rung and ppbackward against the compiled full backward over four microbatches in
    :data:`ORDER`: bit-identical with ``aot_eager``, within the bench's tolerance (``bench.compiled.TOLERANCE``)
    with another backend; raises ``AssertionError`` otherwise."""
    import ppbackward.backward as ours
    from ppbackward._tools.bench.compiled import TOLERANCE
    from ppbackward._tools.harness.models import Config

    cfg = Config(4, 16, 4)
    ref = _compiled_stage(cfg, backend)
    xs, gs, ref_dx = _reference(ref)
    rungs = {**COMPILED_RUNGS, "pp": (ours.stage_backward_input, ours.stage_backward_weight)}
    for name, (b, w) in rungs.items():
        st = _compiled_stage(cfg, backend)
        dxs = _interleaved(b, w, st, xs, gs)
        pairs = [*zip(dxs, ref_dx), *((p.grad, q.grad) for p, q in zip(st.params, ref.params))]
        worst = max(float((a - b).abs().max()) for a, b in pairs)
        if backend == "aot_eager":
            assert all(torch.equal(a, b) for a, b in pairs), (name, worst)
        else:
            assert not any(bool(TOLERANCE.outside(a, b).any()) for a, b in pairs), (name, worst)
        print(f"{cfg.name} {backend} {name}: max abs difference to the compiled full backward {worst:.3g}")


def _load_average() -> list[str]:
    """The 1, 5 and 15-minute load averages, as ``/proc/loadavg`` writes them."""
    return pathlib.Path("/proc/loadavg").read_text().split()[:3]


def main_compiled(argv: list[str]) -> None:
    from ppbackward._tools.bench import split
    from ppbackward._tools.bench.compiled import check_split
    from ppbackward._tools.bench.records import SplitResult
    from ppbackward._tools.harness.models import parse_configs

    torch.set_num_threads(1)
    configs = parse_configs(argv[0]) if argv else parse_configs("4x16x4")
    repeats = int(argv[1]) if len(argv) > 1 else 30
    backend = argv[2] if len(argv) > 2 else "inductor"
    load = _load_average()
    print(f"torch {torch.__version__}; backend {backend}; load average at start {load}", flush=True)
    for cfg in configs:
        stage = _compiled_stage(cfg, backend)
        exact, per_b = check_split(stage)  # ppbackward's B splits every region (else it would time something else)
        if not exact or per_b != cfg.layers:
            raise SystemExit(f"{cfg.name}: ppbackward's split exact {exact}, regions split per B {per_b}/{cfg.layers}")
        c = split.measure_config(cfg, repeats, None, extra=COMPILED_RUNGS, stage=stage, torch_split=False)
        text = split.format_split(SplitResult(device="cpu", configs=[c]))
        print(text.split("\nHost cost")[0].split("\nReplayed")[0].split("\n", 1)[1], flush=True)
        _print_replays(c)
    print(f"load average at end {_load_average()}")


def _print_replays(c) -> None:
    """Each rung's accumulating costs replayed in the zero-bubble steps (Note [replayed step]; 2 ranks, 8
    microbatches), as ratios to Interleaved1F1B's."""
    from ppbackward._tools.bench.records import SplitCosts
    from ppbackward._tools.bench.replay import replay

    t = c.times("accumulating")
    for name, ms in sorted(t.variants.items()):
        rp = replay(SplitCosts(F=t.fwd, full=t.full, B=ms.b, W=ms.w), ranks=2).ratio_to_1f1b
        izb, zbv = rp["ScheduleInterleavedZeroBubble/measured"], rp["ScheduleZBVZeroBubble/measured"]
        print(f"{'':<13} replayed step, 2 ranks, 8 mb, {name}: IZB {izb:.2f}x ZBV {zbv:.2f}x Interleaved1F1B's")


ORDER = ["B0", "B1", "W0", "B2", "W1", "B3", "W2", "W3"]  # B1 B2 W1 B3 W2 B4 W3 W4, grads accumulating


def _reference(ref) -> tuple[list, list, list]:
    """Four microbatches' inputs and output gradients (seeded), each run through a full backward on ``ref``
    (its ``.grad`` accumulating): the inputs, the gradients and the input gradients."""
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(ref.x.shape, generator=gen) for _ in range(4)]
    gs = [torch.randn(ref.x.shape, generator=gen) for _ in range(4)]
    ref_dx = []
    for x, g in zip(xs, gs):
        x = x.clone().requires_grad_()
        torch.autograd.backward(ref.model(x), g)
        ref_dx.append(x.grad)
    return xs, gs, ref_dx


def _interleaved(b, w, stage, xs: list, gs: list) -> list:
    """B and W of a rung over four microbatches in :data:`ORDER` on ``stage``; the input gradients."""
    states, dxs = {}, {}
    for step in ORDER:
        k = int(step[1])
        if step[0] == "B":
            x = xs[k].clone().requires_grad_()
            (dx,), states[k] = b((stage.model(x),), (gs[k],), [x], stage.params)
            dxs[k] = dx
        else:
            w(stage.params, states.pop(k))
    return [dxs[k] for k in range(4)]


def check() -> None:
    """Every rung bit-identical to a full backward, grads accumulating, order B1 B2 W1 B3 W2 B4 W3 W4."""
    from ppbackward._tools.harness.models import Config, build

    for cfg in (Config(4, 16, 4), Config(16, 64, 16), Config(4, 128, 16)):
        ref = build(cfg)
        xs, gs, ref_dx = _reference(ref)
        for name, (b, w) in RUNGS.items():
            st = build(cfg)
            dxs = _interleaved(b, w, st, xs, gs)
            assert all(torch.equal(dxs[k], ref_dx[k]) for k in range(4)), (cfg, name, "input grads")
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(st.params, ref.params)), (cfg, name, "grads")
        print(f"{cfg.name}: every rung bit-identical to the full backward")


# the functions ppbackward's B and W call, by the guarantee each keeps (``--pieces``): ``ppbackward.backward``'s names
_PIECES = {
    "_refuse_in_functorch_transform": "refusals (functorch transform, reentrant checkpoint)",
    "_refuse_reentrant_checkpoint": "refusals (functorch transform, reentrant checkpoint)",
    "flatten_outputs_and_grads": "output trees, input values and their errors",
    "_grad_inputs": "output trees, input values and their errors",
    "_weights_list": "weights checked (B and W)",
    "_check_param_groups": "weights checked (B and W)",
    "analyze_planned": "analysis of any graph (one plan per structure)",
    "_deferred": "analysis of any graph (one plan per structure)",
    "candidate_owners": "custom Function nodes kept alive",
    "owners_needed": "custom Function nodes kept alive",
    "hook_kinds": "saved-tensor hook scan",
    "take_saved_inputs": "matmul inputs taken out (B keeps no graph)",
    "_engine_call": "B's engine call (captures after tensor hooks, version records)",
    "_build_groups": "param groups read and written like torch's",
    "cpp_nodes_saving": "held bytes (release, pins)",
    "release_saved_tensors": "held bytes (release, pins)",
    "pin_saved_inputs": "held bytes (release, pins)",
    "_detach_outputs": "outputs detached after B",
    "run_weight_work": "W's engine work (matmuls, accumulating calls)",
}
# ... and methods of ``ppbackward._handoff.ParamGroups`` / functions of ``ppbackward._handoff``
_HANDOFF_PIECES = {
    "ParamGroups.__init__": "param groups read and written like torch's",
    "ParamGroups._claim": "W claims param_groups (once, thread-safe)",
    "ParamGroups._check_unchanged": "version and shape checks at W",
    "ParamGroups._check_versions": "version and shape checks at W",  # a later chunk's, called outside the above
    "ParamGroups._release": "param_groups released (no cycle)",
    "_weight_work": "W in chunks",
    "release_pinned": "held bytes (release, pins)",
}


@contextlib.contextmanager
def _wrapped_pieces(spent: dict[str, int]) -> Iterator[None]:
    """Within the block, every piece wrapped with a clock adding its nanoseconds to ``spent[label]``; a piece called
    inside another counts for the outer one only (no time counted twice). Everything wrapped is restored on leaving,
    on an error too (one raised while wrapping included)."""
    import time

    import ppbackward._handoff as handoff
    import ppbackward.backward as ours

    undo = []
    depth = [0]

    def wrap(owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        def timed(*a, **k):
            depth[0] += 1
            t = time.perf_counter_ns()
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[label] = spent.get(label, 0) + time.perf_counter_ns() - t

        setattr(owner, name, timed)
        undo.append((owner, name, f))

    try:
        for name, label in _PIECES.items():
            wrap(ours, name, label)
        for name, label in _HANDOFF_PIECES.items():
            cls, _, meth = name.rpartition(".")
            wrap(getattr(handoff, cls) if cls else handoff, meth, label)
        yield
    finally:
        for owner, name, f in reversed(undo):
            setattr(owner, name, f)


def main_pieces(argv: list[str]) -> None:
    """``--pieces``: ppbackward's B and W piece by piece beside the full backward, r2 and r3p (module docstring)."""
    import statistics
    import time

    import ppbackward.backward as ours
    from ppbackward._tools.bench.timing import gc_paused, prepare_regime
    from ppbackward._tools.harness.models import build, parse_configs
    from ppbackward._tools.repeats import rotations

    torch.set_num_threads(1)
    configs = parse_configs(argv[0]) if argv else parse_configs("4x16x4,16x64x16")
    repeats = int(argv[1]) if len(argv) > 1 else 30
    load = _load_average()
    print(f"torch {torch.__version__}; grads accumulating; medians of {repeats} rounds; load average at start {load}")
    pairs = {k: RUNGS[k] for k in ("r2 +capture after hooks", "r3p +one plan per structure")}
    pairs["pp"] = (ours.stage_backward_input, ours.stage_backward_weight)
    for cfg in configs:
        stage = build(cfg)
        spent: dict[str, int] = {}
        rounds: list[dict[str, float]] = []
        with _wrapped_pieces(spent):
            for r, order in enumerate(rotations(("full", *pairs), repeats + 3)):
                got: dict[str, float] = {}
                with gc_paused():
                    for name in order:
                        prepare_regime(stage, "accumulating")
                        out = stage.model(stage.x)
                        if name == "full":
                            t0 = time.perf_counter_ns()
                            ours.stage_backward((out,), (stage.grad,), [stage.x])
                            got["full"] = time.perf_counter_ns() - t0
                            continue
                        b, w = pairs[name]
                        spent.clear()
                        t0 = time.perf_counter_ns()
                        _, groups = b((out,), (stage.grad,), [stage.x], iter(stage.params))
                        t1 = time.perf_counter_ns()
                        in_b = sum(spent.values())
                        w(iter(stage.params), groups)
                        t2 = time.perf_counter_ns()
                        got[name + " B"], got[name + " W"] = t1 - t0, t2 - t1
                        if name == "pp":
                            got.update({"piece " + k: v for k, v in spent.items()})
                            got["rest B"] = t1 - t0 - in_b
                            got["rest W"] = t2 - t1 - (sum(spent.values()) - in_b)
                if r >= 3:  # the first rounds warm up (the plan stored, the allocator's pools)
                    rounds.append(got)
        med = {k: statistics.median(g[k] for g in rounds if k in g) / 1e3 for k in rounds[-1]}
        full = med["full"]
        print(f"\n{cfg.name} ({cfg.layers}x{cfg.d_model}x{cfg.seq}): full backward {full:.0f} us")
        for name in pairs:
            bw = med[name + " B"] + med[name + " W"]
            print(f"  {name:32s} B {med[name + ' B']:7.0f}  W {med[name + ' W']:7.0f}  B+W {bw / full:.2f}x")
        pieces = sorted(((k[6:], v) for k, v in med.items() if k.startswith("piece ")), key=lambda kv: -kv[1])
        rest = [("the rest of B (context managers, lines between calls, B's temporaries freed)", med["rest B"]),
                ("the rest of W (the same for W)", med["rest W"])]
        for label, v in [*pieces, *rest]:
            print(f"  pp: {label:80s} {v:7.0f} us  {v / full:.3f}x")
    print(f"load average at end {_load_average()}")


def main(argv: list[str]) -> None:
    flags = {a for a in argv if a.startswith("--")}
    argv = [a for a in argv if not a.startswith("--")]
    unknown = flags - {"--check", "--compile", "--pieces"}
    if unknown:
        raise SystemExit(f"unknown option(s) {sorted(unknown)}; see the module docstring")
    if "--pieces" in flags:
        if flags != {"--pieces"}:
            raise SystemExit("--pieces takes no other option (it times eager ppbackward; see the module docstring)")
        main_pieces(argv)
        return
    if flags == {"--check", "--compile"}:
        check_compiled(argv[0] if argv else "inductor")
        return
    if flags == {"--check"}:
        check()
        return
    if flags == {"--compile"}:
        main_compiled(argv)
        return
    from ppbackward._tools.bench import split
    from ppbackward._tools.harness.models import parse_configs

    torch.set_num_threads(1)
    configs = parse_configs(argv[0]) if argv else parse_configs("4x16x4,16x64x16,4x128x16")
    repeats = int(argv[1]) if len(argv) > 1 else 30
    load = _load_average()
    print(f"torch {torch.__version__}; load average at start {load}", flush=True)
    for cfg in configs:
        result = split.measure([cfg], repeats, None, extra=RUNGS)
        print(split.format_split(result).split("\nHost cost")[0].split("\n", 1)[1], flush=True)
        _print_replays(result.configs[0])
    print(f"load average at end {_load_average()}")


if __name__ == "__main__":
    exit_if_help(__doc__)
    main(sys.argv[1:])
