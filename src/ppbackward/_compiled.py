"""torch.compile'd regions split in two: B runs a region's input-gradient graph, W its weight-gradient graph.

Private module used by ``ppbackward._install`` (:func:`enable`, :func:`disable`), ``ppbackward.backward``
(:func:`splitting`, B's side) and ``ppbackward._weight_edges`` (:class:`PendingWeightGrads`, W's side).

Note [compiled regions split in two]: a region compiled by ``torch.compile`` (a block given to
``torch.compile``, ``block.compile()``, a compiled ``forward``, a whole compiled stage; each graph break
starts another region) is one autograd node, ``CompiledFunctionBackward``, whose backward is one compiled
graph computing every input's gradient at once: the activations' (B's work) and the parameters' (W's).
Run as a node, all of it lands in B, and W has nothing left to fill the bubble with.

So, while ppbackward is installed, every AOTAutograd backend (``inductor``, ``aot_eager``, ...) compiles
its backward graphs through :func:`_compile_backward`, which keeps a copy of the backward FX graph beside
the compiled one and returns a :class:`SplittableBackward`. Called as usual (a full backward, torch's own
B, anything outside ppbackward's B) it runs the compiled graph it wraps: the same kernels, one dict test
more. Inside ppbackward's B, for a region node B registered (:func:`splitting`: the node, and the indices of
its edges that lead to weights, ``w_edges``), it runs instead the region's *input half*: the FX graph cut
at the weight outputs, every node that is not needed only by the weight gradients, compiled once per
(graph, ``w_edges``) by the same backend compiler. That graph returns the input gradients (``None`` at the
weight edges, which the engine then leaves alone) and the *live-ins*: the values computed there that the
*weight half* reads (e.g. the gradient flowing into a linear layer's matmul). B keeps those and the saved
tensors the weight half reads, nothing else (the node's other saved tensors are freed as in a full
backward), in a :class:`PendingWeightGrads`; W runs the weight half on them and hands its gradients to the
weights' ``AccumulateGrad`` edges like a custom Function's outputs. Every op of the compiled backward runs
exactly once, in B or in W.

Choices, each written down in ``docs/api.md``:

* the split graphs are compiled without donated buffers (a donated saved tensor may be overwritten by the
  input half while the weight half still needs it); and B, which may keep the graph (``retain_graph``),
  runs a region's backward with ``torch._functorch.config.donated_buffer`` off: ppbackward never runs a
  region's backward twice, so the donation check (which refuses ``retain_graph=True``) protects nothing;
* AOTAutograd's cache is bypassed while compiling (a backward loaded from it is not compiled here, so it
  could not be split): compile time as on a cold cache, run time unchanged;
* a region whose backward was compiled before :func:`enable`, or that cannot be split (its graph outputs
  do not line up with the node's edges, or the backend refused a half), runs whole in B, as before: exact,
  not split. The first such region logs one line on the ``ppbackward`` logger.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.fx as fx

__all__ = [
    "SUPPORTED",
    "UNSUPPORTED_WHY",
    "PendingWeightGrads",
    "deliver",
    "disable",
    "enable",
    "is_region",
    "leaves_of",
    "splitting",
]

LOGGER = logging.getLogger("ppbackward")


def _support() -> tuple[bool, str]:
    """Whether this torch has what the split needs, and if not why (one line)."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 13):
        return False, f"torch {torch.__version__} (the split of compiled regions needs torch 2.13 or newer)"
    try:
        from torch._dynamo.backends.common import AotAutograd  # noqa: F401
        from torch._guards import CompileContext, TracingContext, compile_context, tracing  # noqa: F401
    except ImportError as e:  # pragma: no cover - a torch without dynamo
        return False, f"torch {torch.__version__} has no {e.name}"
    if not hasattr(torch._C, "_current_autograd_node"):
        return False, f"torch {torch.__version__} lacks torch._C._current_autograd_node"
    return True, ""


SUPPORTED, UNSUPPORTED_WHY = _support()

_lock = threading.Lock()
_original_call: list[Any] = []  # AotAutograd.__call__ while enabled (zero or one entry)
# B's registered region nodes -> their _Plan (Note [compiled regions split in two]); read from the engine's
# threads, written under _lock by B's thread
_PLANS: dict[Any, _Plan] = {}
_fallback_logged: list[bool] = []
# while any B splits regions: [donated_buffer as found, then one entry per B running]
_DONATION_OFF: list[Any] = []


class _Plan:
    """One region node of one B: the edges W computes, and what B's input half left for W."""

    __slots__ = ("pending", "w_edges")

    def __init__(self, w_edges: tuple[int, ...]) -> None:
        self.w_edges = w_edges
        self.pending: PendingWeightGrads | None = None


def enable() -> None:
    """Compile AOTAutograd backward graphs through :func:`_compile_backward` from now on. Idempotent."""
    if not SUPPORTED:
        return
    from torch._dynamo.backends.common import AotAutograd

    with _lock:
        if _original_call:
            return
        original = AotAutograd.__call__
        _original_call.append(original)

        def __call__(self: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            inner = self.kwargs.get("bw_compiler") or self.kwargs.get("fw_compiler")
            if inner is not None and not getattr(inner, "_ppbackward_split", False):
                self.kwargs["bw_compiler"] = _splitting_compiler(inner)
            # a backward loaded from AOTAutograd's cache is not compiled here and could not be split
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return original(self, gm, example_inputs, **kwargs)

        AotAutograd.__call__ = __call__  # type: ignore[method-assign]


def disable() -> None:
    """Put ``AotAutograd.__call__`` back. Regions compiled meanwhile stay splittable, but only ppbackward's
    B splits them. Idempotent."""
    if not SUPPORTED:
        return
    from torch._dynamo.backends.common import AotAutograd

    with _lock:
        if _original_call:
            AotAutograd.__call__ = _original_call.pop()  # type: ignore[method-assign]


def _splitting_compiler(inner: Any) -> Any:
    def compile_backward(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return _compile_backward(inner, gm, example_inputs)

    compile_backward._ppbackward_split = True  # type: ignore[attr-defined]
    return compile_backward


def _compile_backward(inner: Any, gm: fx.GraphModule, example_inputs: Any) -> SplittableBackward:
    """The backend's compiled backward, wrapped with a copy of its FX graph (taken before the backend,
    which may change ``gm``) and the contexts to compile its halves in later."""
    from torch._guards import CompileContext, TracingContext

    graph = copy.deepcopy(gm)
    compiled = inner(gm, example_inputs)
    return SplittableBackward(compiled, graph, inner, TracingContext.try_get(), CompileContext.try_get())


def _call(fn: Any, args: list) -> list:
    """Call a compiled graph with AOTAutograd's conventions: boxed (one list, which it empties) or not."""
    if getattr(fn, "_boxed_call", False):
        out = fn(args)
    else:
        out = fn(*args)
        args.clear()
    return list(out) if isinstance(out, (tuple, list)) else [out]


class _Halves(NamedTuple):
    """A backward graph cut at its weight outputs (:func:`split_backward_graph`), compiled."""

    input_half: Any  # same inputs as the whole; returns the input gradients, then the live-ins
    weight_half: Any  # inputs: held placeholders, then live-ins; returns the weight gradients
    held: tuple[int, ...]  # indices of the backward's inputs the weight half reads
    n_live: int  # how many live-ins the input half returns last
    w_positions: tuple[int, ...]  # the outputs (edges) the weight half returns, in order


class SplittableBackward:
    """A compiled region's backward, runnable whole or (in ppbackward's B) as its input half; see Note
    [compiled regions split in two]. Called by AOTAutograd with the backward's flat inputs (saved
    tensors, symbolic sizes, incoming gradients), boxed."""

    def __init__(self, compiled: Any, graph: fx.GraphModule, compiler: Any, tracing: Any, compiling: Any) -> None:
        self._boxed_call = True  # an attribute of the instance: torch's disable() wrapper copies __dict__
        self.compiled = compiled
        self.graph = graph
        self.compiler = compiler
        self.tracing = tracing
        self.compiling = compiling
        self.halves: dict[tuple[int, ...], _Halves | None] = {}

    def __call__(self, args: list) -> list:
        if _PLANS:
            node = torch._C._current_autograd_node()
            plan = _PLANS.get(node)
            if plan is not None:
                positions = _output_positions(node, plan.w_edges)
                halves = None if positions is None else self._halves(positions)
                if halves is not None:
                    held = [args[i] for i in halves.held]
                    outs = _call(halves.input_half, args)
                    live = outs[len(outs) - halves.n_live :]
                    plan.pending = PendingWeightGrads(halves.weight_half, held + live, tuple(sorted(plan.w_edges)))
                    return outs[: len(outs) - halves.n_live]
        return _call(self.compiled, args)

    def _halves(self, w_edges: tuple[int, ...]) -> _Halves | None:
        if w_edges in self.halves:
            return self.halves[w_edges]
        halves = None
        try:
            halves = self._compile_halves(w_edges)
        except _CannotSplit as e:
            _log_fallback(str(e))
        except Exception as e:  # the backend refused a half: run whole, exactly as before
            _log_fallback(f"compiling its halves failed ({type(e).__name__}: {e})")
        self.halves[w_edges] = halves
        return halves

    def _compile_halves(self, w_edges: tuple[int, ...]) -> _Halves:
        from torch._guards import compile_context, tracing

        split = split_backward_graph(self.graph, w_edges)
        meta = getattr(self.tracing, "fw_metadata", None)
        donated = getattr(meta, "bw_donated_idxs", None)
        with tracing(self.tracing), compile_context(self.compiling):
            if meta is not None:
                meta.bw_donated_idxs = []  # the input half must not overwrite what the weight half reads
            try:
                input_half = self.compiler(split.input_graph, _example_inputs(split.input_graph))
                weight_half = self.compiler(split.weight_graph, _example_inputs(split.weight_graph))
            finally:
                if meta is not None:
                    meta.bw_donated_idxs = donated
        return _Halves(input_half, weight_half, split.held, split.n_live, split.w_positions)


def _output_positions(node: Any, w_edges: tuple[int, ...]) -> tuple[int, ...] | None:
    """The backward's output indices (one per forward input, sizes included) of the node's edges ``w_edges``
    (one per tensor input): the inputs that need a gradient map, in order, to the edges that have a node.
    ``None`` (run whole) where they do not line up."""
    wanted = [i for i, needed in enumerate(node.needs_input_grad) if needed]
    valid = [j for j, (nxt, _) in enumerate(node.next_functions) if nxt is not None]
    if len(wanted) != len(valid):
        _log_fallback(f"{len(wanted)} inputs need a gradient but the node has {len(valid)} edges")
        return None
    by_edge = dict(zip(valid, wanted))
    if any(e not in by_edge for e in w_edges):
        return None
    return tuple(sorted(by_edge[e] for e in w_edges))


class _CannotSplit(Exception):
    pass


def _log_fallback(why: str) -> None:
    if not _fallback_logged:
        _fallback_logged.append(True)
        LOGGER.warning("ppbackward: a compiled region runs whole in B (not split into B and W): %s", why)


def _example_inputs(gm: fx.GraphModule) -> list:
    return [node.meta.get("val") for node in gm.graph.nodes if node.op == "placeholder"]


class SplitGraphs(NamedTuple):
    """What :func:`split_backward_graph` returns."""

    input_graph: fx.GraphModule
    weight_graph: fx.GraphModule
    held: tuple[int, ...]
    n_live: int
    w_positions: tuple[int, ...]


def split_backward_graph(gm: fx.GraphModule, w_edges: tuple[int, ...]) -> SplitGraphs:
    """Cut an AOTAutograd backward graph at its weight outputs.

    Args:
        gm: the backward graph: placeholders (saved tensors, sizes, incoming gradients), one output node
            returning one gradient (or ``None``) per forward input, aligned with the node's edges.
        w_edges: the output indices W computes (edges into weights).

    Returns:
        the input graph (every node but those only the weight outputs need; same placeholders; returns
        every output with ``None`` at ``w_edges``, then the live-ins), the weight graph (placeholders: the
        held inputs then the live-ins; returns the outputs at ``w_edges`` in order), the indices of the
        held inputs among ``gm``'s placeholders, and the number of live-ins.

    Raises:
        _CannotSplit: ``w_edges`` names an output the graph does not have.
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    (output,) = [n for n in nodes if n.op == "output"]
    outs = output.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    wanted = sorted(set(w_edges))
    if wanted and wanted[-1] >= len(outs):
        raise _CannotSplit(f"its backward graph has {len(outs)} outputs, edge {wanted[-1]} was asked")
    w_set = set(wanted)
    input_side = _ancestors([o for i, o in enumerate(outs) if i not in w_set])
    weight_side = _ancestors([outs[i] for i in wanted])
    weight_only = [n for n in nodes if n in weight_side and n not in input_side and n.op == "call_function"]
    only = set(weight_only)
    live: list[fx.Node] = []
    for n in weight_only:
        for a in n.all_input_nodes:
            if a not in only and a not in live:
                live.append(a)
    for i in wanted:
        o = outs[i]
        if isinstance(o, fx.Node) and o not in only and o not in live:
            live.append(o)
    held = [n for n in live if n.op == "placeholder"]
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
    graph_w.output(tuple(None if outs[i] is None else env_w[outs[i]] for i in wanted))

    index = {n: k for k, n in enumerate(placeholders)}
    return SplitGraphs(
        fx.GraphModule(gm, graph_i), fx.GraphModule(gm, graph_w), tuple(index[n] for n in held), len(computed),
        tuple(wanted),
    )


def _ancestors(seeds: list) -> set:
    seen: set = set()
    stack = [n for n in seeds if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


class PendingWeightGrads:
    """A split region's weight half, ready for W: the compiled graph and exactly the tensors it reads
    (saved tensors and live-ins of the input half); see Note [compiled regions split in two].
    :meth:`run` empties it."""

    __slots__ = ("graph", "inputs", "positions")

    def __init__(self, graph: Any, inputs: list, positions: tuple[int, ...]) -> None:
        self.graph = graph
        self.inputs = inputs
        self.positions = positions

    def device(self) -> torch.device:
        """The device of the tensors it holds (CPU when it holds none)."""
        return next((t.device for t in self.tensors()), torch.device("cpu"))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for W (their versions are checked at W)."""
        return [t for t in self.inputs if isinstance(t, torch.Tensor)]

    def run(self) -> list:
        """The weight gradients, aligned with :attr:`positions`; the held tensors are dropped first."""
        args, self.inputs = self.inputs, []
        with torch.no_grad(), torch._C._DisableAutocast():
            return _call(self.graph, args)


# Note [weight halves hand their gradients over]: a gradient given to the engine as a root is held by the
# caller and by the call's GraphRoot, so an ``AccumulateGrad`` whose ``.grad`` is empty (the first microbatch
# of a step) copies it instead of taking it (one ``new_empty_strided`` + ``copy_`` per parameter), which a
# full backward does not: there the region's node returns the gradient into the engine, which hands it on
# as its only owner. So where every weight edge of a split region is a leaf's ``AccumulateGrad`` (the
# parameters are the region's inputs: compiled blocks, a compiled stage), W runs the weight half as the
# backward of a node of its own, :class:`_WeightHalf`, whose edges are those leaves' (the graph's own
# ``AccumulateGrad`` nodes, checked) and whose output is a root of W's accumulating call (a view of W's
# one-element anchor: no kernel). Elsewhere (an edge into a weight-only node: a cast, FSDP2's unsharding)
# the weight half runs before that call and its gradients are roots, as a custom Function's outputs are.
class _WeightHalf(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, pendings: list, anchor: torch.Tensor, *leaves: torch.Tensor) -> torch.Tensor:
        ctx.pendings = pendings
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple:
        pendings, ctx.pendings = ctx.pendings, None
        grads: list = [None, None]
        for pending in pendings:
            grads += pending.run()
        return tuple(grads)


def leaves_of(node: Any, pending: PendingWeightGrads) -> list[torch.Tensor] | None:
    """The leaves whose graph ``AccumulateGrad`` nodes are ``node``'s weight edges, in ``pending``'s order;
    ``None`` where an edge is not a leaf's ``AccumulateGrad`` the leaf still points at, or the leaf no longer
    requires grad (Note [weight halves hand their gradients over])."""
    leaves = []
    nf = node.next_functions
    for i in pending.positions:
        acc = nf[i][0]
        if type(acc).__name__ != "AccumulateGrad":
            return None
        leaf = acc.variable
        if not leaf.requires_grad or torch.autograd.graph.get_gradient_edge(leaf).node is not acc:
            return None
        leaves.append(leaf)
    return leaves


def deliver(pendings: list[PendingWeightGrads], leaves: list[torch.Tensor], anchor: torch.Tensor) -> torch.Tensor:
    """A root for W's accumulating call that runs each of ``pendings`` and hands their gradients to
    ``leaves`` (theirs, concatenated: :func:`leaves_of`); its gradient is W's one-element root gradient
    (Note [weight halves hand their gradients over]). One node for all the regions of a chunk."""
    grad_was = torch.is_grad_enabled()
    torch._C._set_grad_enabled(True)
    try:
        return _WeightHalf.apply(pendings, anchor, *leaves)
    finally:
        torch._C._set_grad_enabled(grad_was)


def is_region(node: Any) -> bool:
    """Whether an autograd node is a compiled region (AOTAutograd's ``CompiledFunctionBackward``)."""
    return type(node).__name__ == "CompiledFunctionBackward"


@contextlib.contextmanager
def splitting(regions: list[tuple[Any, tuple[int, ...]]], donation_off: bool) -> Iterator[dict[Any, _Plan]]:
    """Within the block, the region nodes given (with their weight edges) run their input half when the
    engine reaches them; yields node -> plan, whose ``pending`` is set where a region was split. Removed
    from the registry whatever happens. Donation is off meanwhile where regions are split or
    ``donation_off`` (B keeps the graph and runs regions: Note [compiled regions split in two])."""
    if not (regions or donation_off) or not SUPPORTED:
        yield {}
        return
    plans = {node: _Plan(tuple(w_edges)) for node, w_edges in regions}
    config = torch._functorch.config
    with _lock:
        _PLANS.update(plans)
        if not _DONATION_OFF:  # the first of the Bs running at once turns it off, the last puts it back
            _DONATION_OFF.append(config.donated_buffer)
            config.donated_buffer = False
        _DONATION_OFF.append(None)
    try:
        yield plans
    finally:
        with _lock:
            for node in plans:
                _PLANS.pop(node, None)
            _DONATION_OFF.pop()
            if len(_DONATION_OFF) == 1:
                config.donated_buffer = _DONATION_OFF.pop()
