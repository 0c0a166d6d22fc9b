"""torch.compile'd regions split in two: B runs a region's input-gradient graph, W its weight-gradient graph.

Private module used by ``ppbackward._install`` (:func:`enable`, :func:`disable`), ``ppbackward.backward``
(:func:`splitting`, B's side) and ``ppbackward._weight_edges`` (:class:`PendingWeightGrads`, W's side). The
graph cut itself is ``ppbackward._graph_halves``.

Note [compiled regions split in two]: a region compiled by ``torch.compile`` (a block given to
``torch.compile``, ``block.compile()``, a compiled ``forward``, a whole compiled stage; each graph break
starts another region) is one autograd node, ``CompiledFunctionBackward``, whose backward is one compiled
graph computing every input's gradient at once: the activations' (B's work) and the parameters' (W's).
Run as a node, all of it lands in B, and W has nothing left to fill the bubble with.

So, while ppbackward is installed, every AOTAutograd backend (``inductor``, ``aot_eager``, ...) compiles
the backward graphs of the forwards it compiles from then on through :func:`_compile_backward`, which keeps
a copy of the backward FX graph and its example inputs beside the compiled graph and returns a
:class:`SplittableBackward`. Called as usual (a full backward, torch's own B, anything outside ppbackward's
B) it runs the compiled graph it wraps: the same kernels, one dict test more. Inside ppbackward's B, for a
region node B registered (:func:`splitting`: the node and its edges into weights, ``w_edges``), it runs
instead the region's *input half*: the graph cut at the weight outputs (``ppbackward._graph_halves``),
compiled once per (graph, weight outputs) by the same backend compiler. That half returns the input
gradients (``None`` at the weight edges, which the engine then leaves alone) and the *live-ins*: the values
computed there that the *weight half* reads (e.g. the gradient flowing into a linear layer's matmul). B
keeps those and the saved tensors the weight half reads, nothing else (the node's other saved tensors are
freed as in a full backward), with their versions at that moment, in a :class:`PendingWeightGrads`; B checks
them at its end and W before it runs (Note [captured gradients are checked at W] in ``ppbackward._handoff``).
W runs the weight half and hands its gradients to the weights' ``AccumulateGrad`` edges (Note [weight halves
hand their gradients over] in ``ppbackward._weight_edges``). Every op of the compiled backward runs exactly
once, in B or in W.

A region runs whole in B, exactly as before and logged once per reason on the ``ppbackward`` logger, where
it cannot be split: its forward was compiled before :func:`enable` (its backward compiler was captured
then), its inputs or gradients are tensor subclasses (DTensor, float8: the compiled backward works on
their inner tensors), inductor's CUDA graphs are on (the input half's outputs would live in the graph's
pool until W), or the backend refused a half.

Donated buffers: a compiled backward may overwrite saved tensors it no longer needs, and torch refuses to
run such a backward where the graph is kept (``retain_graph=True``, which B uses for the C++ intermediates W
calls again). ppbackward runs a region's backward at most once, so while B keeps the graph and runs regions
(split or whole), it clears the donation list of those regions' compiled functions (their
``metadata.bw_donated_idxs``, reference-counted across threads, put back after B's engine call); the halves
are compiled without donation (the input half must not overwrite what the weight half reads), against a
copy of the compile's tracing context. AOTAutograd's cache is bypassed while a forward compiles (a backward
loaded from it is not compiled here, so it could not be split): compile time as on a cold cache, run time
unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from ppbackward._errors import StageBackwardError, nan_output
from ppbackward._graph_halves import CannotSplit, split_backward_graph

__all__ = [
    "PendingWeightGrads",
    "SplittableBackward",
    "Support",
    "disable",
    "enable",
    "is_region",
    "splitting",
    "support",
]

LOGGER = logging.getLogger("ppbackward")


class Support(NamedTuple):
    """Whether this torch can split compiled regions (``ok``), and if not why (``why``, one line; ``""`` if ok)."""

    ok: bool
    why: str


@functools.cache
def support() -> Support:
    """Whether this torch has what the split needs. Asked when first needed, not at import: it imports
    ``torch._dynamo`` (about 1.5 s; Note [lazy package] in ``ppbackward``). Cached: one answer per process.

    Returns:
        :class:`Support`; raises nothing (a torch without dynamo is a ``Support(False, why)``).
    """
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 13):
        return Support(False, f"torch {torch.__version__} (the split of compiled regions needs torch 2.13 or newer)")
    try:
        from torch._dynamo.backends.common import AotAutograd  # noqa: F401
        from torch._guards import CompileContext, TracingContext, compile_context, tracing  # noqa: F401
    except ImportError as e:  # pragma: no cover - a torch without dynamo
        return Support(False, f"torch {torch.__version__} has no {e.name}")
    if not hasattr(torch._C, "_current_autograd_node"):
        return Support(False, f"torch {torch.__version__} lacks torch._C._current_autograd_node")
    return Support(True, "")


_lock = threading.Lock()
_patched: dict[str, Any] = {}  # "call" -> AotAutograd.__call__ while enabled
# B's registered region nodes -> their _Plan; read from the engine's threads, written under _lock
_PLANS: dict[Any, _Plan] = {}
_logged: set[str] = set()  # the fallback reasons logged once each
# compiled functions' metadata whose donation list B cleared: id -> [metadata, list as found, Bs using it]
_UNDONATED: dict[int, list] = {}


class _Plan:
    """One region node of one B: the edges W computes, and what the input half left for W (or why not)."""

    __slots__ = ("declined", "pending", "w_edges")

    def __init__(self, w_edges: tuple[int, ...]) -> None:
        self.w_edges = w_edges
        self.pending: PendingWeightGrads | None = None
        self.declined: str | None = None


def enable() -> None:
    """Compile the backward of every forward AOTAutograd compiles from now on through
    :func:`_compile_backward`. Idempotent; nothing on a torch without the split (:func:`support`)."""
    if not support().ok:
        return
    from torch._dynamo.backends.common import AotAutograd

    with _lock:
        if _patched:
            return
        original = AotAutograd.__call__
        _patched["call"] = original

        def __call__(self: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            kw = self.kwargs
            had = "bw_compiler" in kw
            before = kw.get("bw_compiler")
            inner = before or kw.get("fw_compiler")
            if inner is not None:  # for this compile only: a backend object reused later is left as found
                kw["bw_compiler"] = _splitting_compiler(inner)
            try:
                with torch._functorch.config.patch(enable_autograd_cache=False):
                    return original(self, gm, example_inputs, **kwargs)
            finally:
                if had:
                    kw["bw_compiler"] = before
                else:
                    kw.pop("bw_compiler", None)

        AotAutograd.__call__ = __call__  # type: ignore[method-assign]


def disable() -> None:
    """Put ``AotAutograd.__call__`` back. Regions compiled meanwhile stay splittable, but only ppbackward's
    B splits them. Idempotent."""
    if not support().ok:
        return
    from torch._dynamo.backends.common import AotAutograd

    with _lock:
        if _patched:
            AotAutograd.__call__ = _patched.pop("call")  # type: ignore[method-assign]


def _splitting_compiler(inner: Any) -> Any:
    """The backend's backward compiler, returning a :class:`SplittableBackward`."""

    def compile_backward(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return _compile_backward(inner, gm, example_inputs)

    return compile_backward


def _compile_backward(inner: Any, gm: fx.GraphModule, example_inputs: Any) -> SplittableBackward:
    """The backend's compiled backward, wrapped with a copy of its FX graph (taken first: the backend may
    change ``gm``), its example inputs and the contexts to compile its halves in later."""
    from torch._guards import CompileContext, TracingContext
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # constants lifted into the graph are real tensors
        graph = copy.deepcopy(gm)
    declined = None
    inductor = getattr(torch, "_inductor", None)
    if inductor is not None and getattr(getattr(inductor.config, "triton", None), "cudagraphs", False):
        declined = "inductor's CUDA graphs are on (the input half's outputs would stay in the graph's pool until W)"
    compiled = inner(gm, example_inputs)
    return SplittableBackward(
        compiled, graph, list(example_inputs), inner, TracingContext.try_get(), CompileContext.try_get(), declined
    )


def _call(fn: Any, args: list) -> list:
    """Call a compiled graph with AOTAutograd's conventions (boxed: one list, which it empties; or
    unpacked); ``args`` is emptied either way."""
    try:
        out = fn(args) if getattr(fn, "_boxed_call", False) else fn(*args)
    finally:
        args.clear()
    return list(out) if isinstance(out, (tuple, list)) else [out]


class _Halves:
    """A backward graph cut at its weight outputs (``ppbackward._graph_halves``), compiled."""

    __slots__ = ("held", "input_half", "n_live", "weight_half")

    def __init__(self, input_half: Any, weight_half: Any, held: tuple[int, ...], n_live: int) -> None:
        self.input_half = input_half  # the whole backward's inputs -> input gradients, then the live-ins
        self.weight_half = weight_half  # held inputs, then live-ins -> the weight gradients
        self.held = held
        self.n_live = n_live


class SplittableBackward:
    """A compiled region's backward, runnable whole or (in ppbackward's B) as its input half (Note
    [compiled regions split in two]). AOTAutograd calls it boxed with the backward's flat inputs (saved
    tensors, symbolic sizes, incoming gradients) and reads one output per forward input (then any extra
    outputs: tokens, the RNG offset)."""

    def __init__(
        self, compiled: Any, graph: fx.GraphModule, example_inputs: list, compiler: Any, tracing: Any,
        compiling: Any, declined: str | None,
    ) -> None:
        self._boxed_call = True  # an attribute of the instance: torch's disable() wrapper copies __dict__
        self.compiled = compiled
        self.graph = graph
        self.example_inputs = example_inputs
        self.compiler = compiler
        self.tracing = tracing
        self.compiling = compiling
        self.declined = declined
        self.n_outputs = len(_outputs(graph))
        self.halves: dict[tuple[int, ...], _Halves | str] = {}  # weight outputs -> halves, or why not
        self.halves_lock = threading.Lock()

    def __call__(self, args: list) -> list:
        if _PLANS:
            node = torch._C._current_autograd_node()
            plan = _PLANS.get(node)
            if plan is not None:
                halves = self._halves_for(node, plan)
                if halves is not None:
                    held = [args[i] for i in halves.held]
                    outs = _call(halves.input_half, args)
                    cut = len(outs) - halves.n_live
                    plan.pending = PendingWeightGrads(halves.weight_half, held + outs[cut:], plan.w_edges)
                    return outs[:cut]
        return _call(self.compiled, args)

    def _halves_for(self, node: Any, plan: _Plan) -> _Halves | None:
        """This region's halves for ``plan``'s weight edges (compiled on first use), or ``None`` with the
        reason in ``plan.declined``."""
        outputs = self.declined or _weight_outputs(node, plan.w_edges, self.n_outputs)
        if isinstance(outputs, str):
            plan.declined = outputs
            return None
        with self.halves_lock:
            if outputs not in self.halves:
                self.halves[outputs] = self._compile_halves(outputs)
            halves = self.halves[outputs]
        if isinstance(halves, str):
            plan.declined = halves
            return None
        return halves

    def _compile_halves(self, outputs: tuple[int, ...]) -> _Halves | str:
        """Cut and compile; a string saying why where the graph cannot be cut or the backend refused a half."""
        from torch._guards import compile_context, tracing

        try:
            cut = split_backward_graph(self.graph, outputs)
        except CannotSplit as e:
            return str(e)
        example_w = [self.example_inputs[i] for i in cut.held] + [
            n.meta.get("val") for n in cut.weight_graph.graph.nodes if n.op == "placeholder"
        ][len(cut.held) :]
        context = copy.copy(self.tracing)  # the halves are compiled without donated buffers
        meta = getattr(context, "fw_metadata", None)
        if meta is not None and getattr(meta, "bw_donated_idxs", None):
            context.fw_metadata = dataclasses.replace(meta, bw_donated_idxs=[])
        try:
            with tracing(context), compile_context(self.compiling):
                input_half = self.compiler(cut.input_graph, list(self.example_inputs))
                weight_half = self.compiler(cut.weight_graph, example_w)
        except Exception as e:  # the backend refused a half: the region runs whole, exactly as before
            return f"the backend could not compile its halves ({type(e).__name__}: {str(e)[:200]})"
        return _Halves(input_half, weight_half, cut.held, cut.n_live)


def _outputs(gm: fx.GraphModule) -> list:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    outs = output.args[0]
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def _weight_outputs(node: Any, w_edges: tuple[int, ...], n_outputs: int) -> tuple[int, ...] | str:
    """The backward graph's output indices (one per forward input, sizes included) of the node's edges
    ``w_edges`` (one per tensor input): the inputs that need a gradient map, in order, to the edges that
    have a node. A string saying why where they do not line up, or the region works on tensor subclasses."""
    if getattr(node._forward_cls, "maybe_subclass_metadata", None) is not None:
        return "its inputs or gradients are tensor subclasses (DTensor, float8): it works on their inner tensors"
    needs = node.needs_input_grad
    wanted = [i for i, needed in enumerate(needs) if needed]
    valid = [j for j, (nxt, _) in enumerate(node.next_functions) if nxt is not None]
    if len(wanted) != len(valid) or len(needs) > n_outputs:
        return f"its {n_outputs} backward outputs do not line up with its {len(valid)} edges"
    by_edge = dict(zip(valid, wanted))
    outputs = []
    for e in w_edges:  # a plain loop: B calls this per region, and a generator resumes once per edge
        i = by_edge.get(e)
        if i is None:
            return "a weight edge of it has no forward input"
        outputs.append(i)
    outputs.sort()
    return tuple(outputs)


def _log_once(why: str) -> None:
    if why not in _logged:
        _logged.add(why)
        LOGGER.warning("ppbackward: a compiled region runs whole in B (not split into B and W): %s", why)


class PendingWeightGrads:
    """A split region's weight half, ready for W: the compiled graph and exactly the tensors it reads
    (saved tensors and live-ins of the input half; and the backward's size inputs, ints: Note [weight halves
    bind every size] in ``ppbackward._graph_halves``), with the tensors' versions when the input half returned
    (Note [compiled regions split in two]). :meth:`run` empties it; so does W's release."""

    __slots__ = ("autocast", "graph", "inputs", "positions", "versions")

    def __init__(self, graph: Any, inputs: list, positions: tuple[int, ...]) -> None:
        self.graph = graph
        self.inputs = inputs
        self.positions = tuple(sorted(positions))  # the node's edges the weight half's outputs go to, in order
        self.versions = [(t, t._version) for t in inputs if isinstance(t, torch.Tensor)]
        # Note [weight halves run under the input half's autocast]: made while the input half runs
        self.autocast = _autocast_now() if torch._C._is_any_autocast_enabled() else None

    def device(self) -> torch.device:
        """The device of the tensors it holds (CPU when it holds none)."""
        return next((t.device for t, _ in self.versions), torch.device("cpu"))

    def changed(self) -> torch.Tensor | None:
        """A held tensor modified in place since the input half returned, or ``None``."""
        for t, version in self.versions:
            if t._version != version:
                return t
        return None

    def run(self, node: Any) -> list:
        """The weight gradients, aligned with :attr:`positions`; the held tensors are dropped as the graph
        runs. Under anomaly mode, a NaN is reported as the engine does, naming the region ``node``.

        Raises:
            RuntimeError: anomaly mode found a NaN among them.
        """
        args, self.inputs, self.versions = self.inputs, [], []
        grad_was = torch.is_grad_enabled()  # torch.no_grad() without its Python frames (five a call)
        torch._C._set_grad_enabled(False)
        try:
            if self.autocast is None:
                with torch._C._DisableAutocast():
                    grads = _call(self.graph, args)
            else:
                with contextlib.ExitStack() as stack:
                    stack.enter_context(torch._C._DisableAutocast())
                    for device_type, dtype, cache in self.autocast:
                        stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
                    grads = _call(self.graph, args)
        finally:
            torch._C._set_grad_enabled(grad_was)
        if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
            _check_nan(node, self.positions, grads)
        return grads

    def drop(self) -> None:
        """Let go of everything it holds (W's release, W never called)."""
        self.inputs, self.versions = [], []


# Note [weight halves run under the input half's autocast]: a full backward runs a region's compiled backward
# under the autocast state of the moment (AOTAutograd's wrapper switches it off only where the forward ran under
# autocast: its ``disable_amp``); with a backend that runs aten ops (``aot_eager``), an autocast active during
# the backward changes its kernels' dtypes. B runs the input half inside that same wrapper, so it sees that
# state; W runs the weight half later, under whatever W's caller has. So the state the input half saw is
# recorded when the weight half is made (``None``: none, the common case, one C read) and W runs the weight
# half under exactly it: none, or each device type's autocast dtype as it was (B and W under
# ``torch.autocast`` with a forward outside it gave grads unlike the full backward's, or a dtype error).
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia")


def _autocast_now() -> tuple[tuple[str, torch.dtype, bool], ...]:
    """``(device type, dtype, cache enabled)`` of each device type whose autocast is on now (the cache flag is
    one for all of them)."""
    found = []
    cache = torch.is_autocast_cache_enabled()
    for device_type in (*_AUTOCAST_DEVICES, torch._C._get_privateuse1_backend_name()):
        try:
            if torch.is_autocast_enabled(device_type):
                found.append((device_type, torch.get_autocast_dtype(device_type), cache))
        except (RuntimeError, TypeError):  # a device type this torch has no autocast for
            continue
    return tuple(found)


def _check_nan(node: Any, positions: tuple[int, ...], grads: list) -> None:
    """As the engine does for a node whose output is NaN (Note [anomaly mode names W's nodes] in
    ``ppbackward._weight_edges``), naming the region."""
    for i, g in zip(positions, grads):
        if g is not None and torch.isnan(g).any():
            raise nan_output(node, i)


def is_region(node: Any) -> bool:
    """Whether an autograd node is a compiled region (AOTAutograd's ``CompiledFunctionBackward``)."""
    return type(node).__name__ == "CompiledFunctionBackward"


@contextlib.contextmanager
def splitting(split: list[tuple[Any, tuple[int, ...]]], whole: list[Any]) -> Iterator[dict[Any, _Plan]]:
    """Within the block (B's engine call), the region nodes ``split`` (with their weight edges) run their
    input half when the engine reaches them; yields node -> plan, whose ``pending`` is set where a region was
    split. The regions of ``split`` and ``whole`` (those B runs whole, where B keeps the graph) have their
    donation list cleared meanwhile. Everything is put back whatever happens (Note [compiled regions split
    in two]).

    Raises:
        StageBackwardError: at the end of the block, a tensor a weight half holds was modified in place
            during B (by a hook that ran later: autograd's contract forbids it).
    """
    if not (split or whole):
        yield {}
        return
    plans = {node: _Plan(tuple(w_edges)) for node, w_edges in split} if support().ok else {}
    found = [getattr(node._forward_cls, "metadata", None) for node in [*(n for n, _ in split), *whole]]
    metas: list[Any] = list({id(m): m for m in found if getattr(m, "bw_donated_idxs", None)}.values())
    with _lock:
        _PLANS.update(plans)
        for meta in metas:
            entry = _UNDONATED.setdefault(id(meta), [meta, meta.bw_donated_idxs, 0])
            entry[2] += 1
            meta.bw_donated_idxs = []
    try:
        yield plans
    finally:
        with _lock:
            for node in plans:
                _PLANS.pop(node, None)
            for meta in metas:
                entry = _UNDONATED[id(meta)]
                entry[2] -= 1
                if not entry[2]:
                    meta.bw_donated_idxs = entry[1]
                    del _UNDONATED[id(meta)]
    for node, plan in plans.items():
        if plan.pending is not None:
            changed = plan.pending.changed()
            if changed is not None:
                plan.pending.drop()
                raise StageBackwardError(
                    f"stage_backward_input: a tensor the weight half of compiled region {node.name()} reads, "
                    f"{changed.dtype} {list(changed.shape)}, was modified in place later in B, by a hook that "
                    "received it. autograd's hooks must not change their argument in place (return a new "
                    "tensor instead); W would compute the weight gradients from the changed values. Nothing "
                    "was accumulated"
                )
        elif plan.declined is not None:
            _log_once(plan.declined)


def note_unsplit(node: Any) -> None:
    """Log once that a region B registered ran without its compiled backward seeing the plan: its forward
    was compiled before ``ppbackward.install()``."""
    _log_once(
        "its forward was compiled before ppbackward.install() (call install() before the first call of a "
        "compiled module, or torch._dynamo.reset() after it)"
    )
