"""W's engine work: the intermediates' weight edges, then one accumulating call.

Private module used by ``ppbackward.backward.stage_backward_weight``, which hands it one chunk of W's
work at a time (:func:`run_weight_work`); see Note [W computes only weight edges] below and Note
[accumulation order].
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from ppbackward._errors import nan_output
from ppbackward._graph import _ACCUMULATE_GRAD
from ppbackward._handoff import WeightWork, unreadable_saved_error
from ppbackward._matmul_weights import weight_contributions
from ppbackward._param_groups import Contribution, NodeCall
from ppbackward._plain import kept_tensors
from ppbackward._saved import release_saved_tensors

# private module: what other modules use
__all__ = ["ENGINE_RUN_BACKWARD", "accumulate", "run_weight_work", "weight_edge_grads"]

# The engine entry point torch.autograd.backward and .grad end in (torch >= 2.3); see accumulate, and Note [B
# enters the engine directly] in ppbackward.backward.
ENGINE_RUN_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)


class _Job:
    """The intermediates W must call, and what they returned; called as the pre-hook of the one-element
    anchor's ``ViewBackward0`` node, from inside W's first engine call (Note [W computes only weight
    edges]). Referenced only by that node's hook dict, for the duration of one engine call, and by
    :func:`weight_edge_grads` (Note [no closure cycle]: it holds no node that references it)."""

    __slots__ = ("calls", "results")

    def __init__(self, calls: list[NodeCall]) -> None:
        self.calls = calls
        self.results: list[list] = []

    def __call__(self, _grad_outputs: tuple) -> None:
        calls, self.calls = self.calls, []
        results = self.results
        for node, grads, _ in calls:  # a C++ node called inline (Note [no frame per node] in ppbackward.backward)
            if isinstance(node, BackwardCFunction):
                results.append(_call_node(node, grads))
            else:
                results.append(list(node(*grads)))  # type: ignore[operator]  # a C++ node is callable


def _call_node(node, grads: tuple) -> list:
    """Run one autograd node on ``grads``; the result is aligned with ``node.next_functions``.

    C++ nodes are callable. A custom ``autograd.Function`` node is run through its ``apply``, which
    returns one entry per forward input; the entries of inputs that required grad map, in order, to
    the valid entries of ``next_functions``. Missing gradients are materialised as zeros for it, as
    the engine does by default (``ctx.set_materialize_grads``).
    """
    if not isinstance(node, BackwardCFunction):
        return list(node(*grads))
    metas = node._input_metadata  # type: ignore[attr-defined]  # not in torch's stub
    full = [
        g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
        for g, m in zip(grads, metas)
    ]
    outs = node.apply(*full)
    if not isinstance(outs, tuple):
        outs = (outs,)
    nf = node.next_functions
    result: list = [None] * len(nf)
    wanted = [i for i, needed in enumerate(node.needs_input_grad) if needed]
    valid = [j for j, (nxt, _) in enumerate(nf) if nxt is not None]
    for i, j in zip(wanted, valid):
        result[j] = outs[i] if i < len(outs) else None
    return result


def _conform(grad: torch.Tensor, edge: GradientEdge) -> torch.Tensor:
    """``grad`` shaped as the engine would deliver it into ``edge`` (its ``validate_outputs`` step):
    broadcast gradients summed back, dtype and device cast. Only for the public-call fallback of
    :func:`accumulate`, whose Python checks refuse what the engine would shape."""
    meta = edge.node._input_metadata[edge.output_nr]
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype or grad.device != meta.device:
        grad = grad.to(device=meta.device, dtype=meta.dtype)
    return grad


# Note [W's anchor runs no kernel]: W's first engine call needs a root of its own (a node to hang the
# pre-hook on, never a node of the stage). It is a view of a one-element leaf and the root gradient a
# one-element tensor, both made once per device and kept: a view is a metadata op, and the engine only
# captures at the leaf (it is among the call's ``inputs``), so the call dispatches no kernel besides the
# intermediates' own (a fresh ``zeros`` + ``clone`` + ``ones_like`` per call did; benchmarks/RESULTS.md, "W's
# engine entries"). Neither tensor is ever written: the leaf's gradient is captured, not accumulated, and
# the view's node passes the root gradient on unchanged to that capture. Each call makes its own view node,
# so threads running W at once never share a hook.
_ANCHORS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _anchor(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-element leaf and root gradient of W's first engine call on ``device``."""
    pair = _ANCHORS.get(device)
    if pair is None:
        with kept_tensors():  # kept for good: Note [probes run in plain autograd]
            pair = (
                torch.zeros((), device=device, dtype=torch.float32).requires_grad_(),
                torch.ones((), device=device, dtype=torch.float32),
            )
        pair = _ANCHORS.setdefault(device, pair)
    return pair


def weight_edge_grads(calls: list[NodeCall], job: _Job) -> list[list]:
    """Call each intermediate on its captured gradients, computing only its weight edges.

    Note [W computes only weight edges]: an autograd node decides which of its outputs to compute
    from the exec info of the engine call it runs in (``task_should_compute_output``): an edge whose
    next node the current call does not need is skipped. W therefore calls each intermediate from
    inside an engine call whose ``inputs`` are exactly the intermediates' edges into weight-only
    nodes. The edges back towards the stage input (the input-gradient work B already did) are
    skipped, so W does only the deferred weight work (e.g. ``grad_out^T @ input`` of a linear
    layer), never re-runs a node of the input side and never walks it. The call is an
    ``autograd.grad`` from a view of a one-element anchor, whose ``ViewBackward0`` node (W's own,
    made for this call; Note [W's anchor runs no kernel]) has a pre-hook that calls the nodes
    (:class:`_Job`; a custom ``autograd.Function`` did this before, slower: benchmarks/RESULTS.md, "W's engine
    entries"); it accumulates nothing, and the hook is removed when the call returns, whatever happens. No
    hook touches a node of the stage.

    ``job`` is the caller's :class:`_Job` over ``calls``: its ``results`` grow call by call, so where a call
    raises the caller knows which one (Note [saved tensors W reads are checked] in ``ppbackward._handoff``).

    Returns:
        For each call, what the node returned (aligned with its ``next_functions``), as the node
        returned it: :func:`accumulate` hands every weight-edge gradient to the engine as a root, and
        the engine shapes roots as it shapes a node's outputs in a full backward (``validate_outputs``:
        broadcast gradients summed back, dtype and device cast), in C++ (Note [W roots are validated by
        the engine]).
    """
    targets: list[GradientEdge] = []
    seen: set = set()
    new = tuple.__new__  # Note [no frame per node] in ppbackward.backward
    for call in calls:
        nf = call[0].next_functions
        for i in call[2]:
            edge = new(GradientEdge, nf[i][:2])
            if edge not in seen:
                seen.add(edge)
                targets.append(edge)
    # a call has a gradient (B skips a node nothing flowed into; a written entry of only None is refused)
    first = None
    for call in calls:
        for g in call[1]:
            if g is not None:
                first = g
                break
        if first is not None:
            break
    if first is None:
        return [[None] * len(call.node.next_functions) for call in calls]
    anchor, one = _anchor(first.device)
    if torch.is_inference_mode_enabled():  # W may be called under inference mode or no_grad
        with torch.inference_mode(False), torch.enable_grad():
            out = anchor.view_as(anchor)  # a node of W's own, no kernel (Note [W's anchor runs no kernel])
    else:  # grad mode switched in C: enable_grad's context manager is ~10 Python frames per chunk
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)
        try:
            out = anchor.view_as(anchor)
        finally:
            torch._C._set_grad_enabled(grad_was)
    handle = out.grad_fn.register_prehook(job)  # type: ignore[union-attr]  # a view of a leaf has one
    try:
        if ENGINE_RUN_BACKWARD is None:
            torch.autograd.grad([out], [anchor, *targets], grad_outputs=[one], allow_unused=True)  # type: ignore[arg-type]
        else:  # what torch.autograd.grad ends in, without its per-input Python checks
            ENGINE_RUN_BACKWARD((out,), (one,), False, False, (anchor, *targets), True, False)
    finally:
        handle.remove()
    if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
        _check_nan(calls, job.results)
    return job.results


def _check_nan(calls: list[NodeCall], results: list[list]) -> None:
    """Under ``torch.autograd.detect_anomaly()``, raise as the engine does for a node that returned NaN.

    Note [anomaly mode names W's nodes]: W calls the intermediates itself, not through the engine, so the
    engine's anomaly check never sees their outputs; a NaN they produce would first be seen as an input of
    the accumulating call and blamed on its ``GraphRoot``. So W checks them here, with the engine's message
    and the forward traceback the engine prints (from the node's anomaly metadata). Off outside anomaly mode.
    """
    for call, outs in zip(calls, results):
        node = call.node
        for i in call.w_edges:
            if outs[i] is not None and torch.isnan(outs[i]).any():
                raise nan_output(node, i)


def accumulate(roots: list, grads: list, inputs: list, retain_graph: bool) -> None:
    """``torch.autograd.backward(roots, grads, inputs=inputs)``, without its per-root Python checks.

    Note [W roots are validated by the engine]: the engine's ``execute`` runs ``validate_outputs`` on
    its roots against the metadata of the slots they lead into, the step a full backward runs on
    every node's outputs before adding them into the next node's input buffer: a gradient of a
    broadcast operand is summed back to its shape (``at::sum_to``), dtype and device are cast. W's
    roots are exactly such node outputs (or gradients already checked by ``ppbackward._tree``), so W
    hands them over unshaped and goes straight to the engine entry point that
    ``torch.autograd.backward`` itself ends in (without its per-root Python checks, benchmarks/RESULTS.md,
    "W's engine entries"); on a torch without it, the public call.

    Note [W accumulates through the graph's AccumulateGrad nodes]: ``inputs`` are ``GradientEdge(leaf, 0)``
    of the ``AccumulateGrad`` nodes B found in the graph (:attr:`ParamGroup.inputs`), not the parameters.
    Given a tensor, the engine looks its accumulator up through the tensor, which is not always the graph's:
    ``param.data = ...`` with another dtype or device (``module.double(); module.float()``, ``module.cpu();
    module.cuda()``) makes the parameter forget it, so the engine would build a new node the graph never
    reaches and accumulate nothing, silently; and a parameter frozen since its forward
    (``requires_grad_(False)``) makes the engine refuse the tensor ("can't retain_grad on Tensor that has
    requires_grad=False"). The graph's node is the one a full backward runs: it accumulates into its
    variable in both cases, and skips a parameter that no longer requires grad (``AccumulateGrad`` returns
    early, after the parameter's tensor hooks) while the others accumulate, as a full backward does.
    """
    if ENGINE_RUN_BACKWARD is None:
        grads = [_conform(g, edge) for edge, g in zip(roots, grads)]
        torch.autograd.backward(roots, grad_tensors=grads, inputs=inputs, retain_graph=retain_graph)
    else:
        ENGINE_RUN_BACKWARD(tuple(roots), tuple(grads), retain_graph, False, tuple(inputs), True, True)


# Note [weight halves hand their gradients over]: a gradient given to the engine as a root is held by the
# caller and by the call's GraphRoot, so an ``AccumulateGrad`` whose ``.grad`` is empty (the first microbatch
# of a step) copies it instead of taking it (one ``new_empty_strided`` + ``copy_`` per parameter), which a
# full backward does not: there the region's node returns the gradient into the engine, which hands it on as
# its only owner. So where a split compiled region is the only source of its param group's gradients and
# every weight edge of it is a leaf's ``AccumulateGrad`` (the parameters are the region's inputs: compiled
# blocks, a compiled stage), W runs its weight half as the backward of a node of its own, ``_WeightHalf`` (one
# per chunk, for all such regions), whose edges are those leaves' (the graph's own ``AccumulateGrad`` nodes,
# checked) and whose output is a root of W's accumulating call (a view of W's one-element anchor: no
# kernel). Elsewhere (an edge into a weight-only node: a cast, FSDP2's unsharding; a weight that also gets
# other gradients, whose order Note [accumulation order] keeps) the weight half runs before that call and
# its gradients are roots tagged with the region's sequence number, as a custom Function's outputs are.
class _WeightHalf(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, regions: list, anchor: torch.Tensor, *leaves: torch.Tensor) -> torch.Tensor:
        ctx.regions = regions
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple:
        regions, ctx.regions = ctx.regions, None
        grads: list = [None, None]
        try:
            for region in regions:
                grads += region.pending.run(region.node)
        finally:  # one that raised: the others let go of what they hold now, not with the traceback
            for region in regions:
                region.pending.drop()
        return tuple(grads)


# Note [weight halves hand their gradients over], continued: ``torch.autograd.Function.apply`` is Python that
# maps functorch's dead-wrapper unwrapping over every argument (a generator frame per leaf handed over: 51 of a
# compiled 4-block W's 197 calls) before it calls the C ``_FunctionBase.apply``. W calls the C one directly,
# bound to ``_WeightHalf``: W refuses to run inside a functorch transform (``_refuse_in_functorch_transform`` in
# ppbackward.backward), so no functorch wrapper can reach it (W's leaves and gradients are the graph's
# parameters and the weight halves' outputs); ``_WeightHalf`` has no ``setup_context``, so torch's
# default-argument binding does nothing for it either.
_WEIGHT_HALF_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _WeightHalf)


def _leaves_of(node: Any, positions: tuple[int, ...]) -> list | None:
    """The graph's ``AccumulateGrad`` nodes at ``node``'s edges ``positions`` and their leaves, flattened
    ``[acc, leaf, acc, leaf, ...]``; ``None`` where an edge is not an ``AccumulateGrad`` or its leaf no longer
    requires grad (Note [weight halves hand their gradients over]). Plain loop, no frame per edge (Note [no
    frame per node] in ``ppbackward.backward``)."""
    found = []
    nf = node.next_functions
    for i in positions:
        acc: Any = nf[i][0]
        if type(acc) is not _ACCUMULATE_GRAD:
            return None
        leaf = acc.variable  # type: ignore[attr-defined]  # AccumulateGrad's leaf
        if not leaf.requires_grad:
            return None
        found.append(acc)
        found.append(leaf)
    return found


def _hand_over(regions: list, found: list, anchor: torch.Tensor) -> torch.Tensor | None:
    """A root for W's accumulating call that runs each region's weight half and hands the gradients to the
    leaves of ``found`` (:func:`_leaves_of`'s, concatenated); its gradient is W's one-element root gradient
    (Note [weight halves hand their gradients over]). ``None`` where a leaf no longer points at the graph's
    ``AccumulateGrad`` node (``param.data`` of another dtype since the forward): the node made is dropped
    unrun and W hands the gradients as roots instead."""
    grad_was = torch.is_grad_enabled()
    torch._C._set_grad_enabled(True)
    try:
        root = _WEIGHT_HALF_APPLY(regions, anchor, *found[1::2])
    finally:
        torch._C._set_grad_enabled(grad_was)
    node: Any = root.grad_fn  # the node just made
    edges = node.next_functions
    accs = found[0::2]
    for k in range(len(accs)):
        if edges[k + 1][0] is not accs[k]:  # after the anchor's (the list of regions has no edge)
            node.regions = None
            return None
    return root


def run_weight_work(work: WeightWork, retain_graph: bool) -> None:
    """W's two engine calls for one chunk of its work (Note [W in chunks] in ``ppbackward._handoff``):
    the intermediates' weight edges (:func:`weight_edge_grads`), then every gradient of the chunk handed
    to one accumulating call (:func:`accumulate`) in the order of Note [accumulation order].

    Note [accumulation order]: a full backward adds the gradients reaching one node in the order their
    producers run: the outputs' first, then by decreasing sequence number. Feeding them as separate roots
    in that order (the engine adds roots in list order) keeps W bit-identical to a full backward where a
    weight gets several.
    """
    calls = work.calls
    contributions = list(work.ready)
    halves: list = []  # the root that runs compiled regions' weight halves in the accumulating call
    handed: list = []
    found: list = []
    rest: list = []
    for region in work.regions:  # Note [compiled regions split in two] in ppbackward._compiled
        theirs = _leaves_of(region.node, region.pending.positions) if region.alone else None
        if theirs is None:
            rest.append(region)
        else:  # Note [weight halves hand their gradients over]
            handed.append(region)
            found += theirs
    if handed:
        root = _hand_over(handed, found, _anchor(handed[0].pending.device())[0])
        if root is None:
            rest += handed
        else:
            halves.append(root)
        del handed, found
    for node, pending, _ in rest:
        nf, seq = node.next_functions, node._sequence_nr()
        for i, grad in zip(pending.positions, pending.run(node)):
            if grad is not None:
                contributions.append(Contribution(GradientEdge(*nf[i][:2]), grad, seq))
    taken = work.taken
    if taken:  # Note [weight matmuls from their saved input] in ppbackward._matmul_weights
        called: list[NodeCall] = []
        lean: list[NodeCall] = []
        for call in calls:
            (lean if call[0] in taken else called).append(call)
        contributions += weight_contributions(lean, taken)
        calls = called
        del lean
    if calls:
        new = tuple.__new__  # Note [no frame per node] in ppbackward.backward
        job = _Job(calls)
        try:
            results = weight_edge_grads(calls, job)
        except RuntimeError as e:  # Note [saved tensors W reads are checked] in ppbackward._handoff
            done = len(job.results)  # the calls that returned; the next one raised
            refusal = unreadable_saved_error(work, calls[done : done + 1])
            if refusal is None:
                raise
            raise refusal from e
        for call, outs in zip(calls, results):
            node = call[0]
            nf, seq = node.next_functions, node._sequence_nr()
            for i in call[2]:
                if outs[i] is not None:
                    edge = new(GradientEdge, nf[i][:2])
                    contributions.append(new(Contribution, (edge, outs[i], seq)))
        del outs, results
    if contributions or halves:
        contributions.sort(key=_BY_SEQ, reverse=True)
        roots = [c.edge for c in contributions] + halves
        grads = [c.grad for c in contributions] + [_anchor(h.device)[1] for h in halves]
        del contributions, halves
        accumulate(roots, grads, work.inputs, retain_graph)
        del roots, grads
    if calls and not retain_graph:
        # W called these nodes itself, outside an engine call that would free them: drop what they saved
        # now, not when the last output referencing the graph dies (an output B could not detach, e.g. a
        # view, may live until the next step).
        release_saved_tensors([call[0] for call in calls])


_BY_SEQ = operator.itemgetter(2)  # a Contribution's ``seq``, read in C
