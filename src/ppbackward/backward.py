"""Drop-in stage backward for ``torch.distributed.pipelining``: full backward and the zero-bubble split.

Public names: :func:`stage_backward`, :func:`stage_backward_input` (B),
:func:`stage_backward_weight` (W). They take the arguments of, and return what
``torch/distributed/pipelining/stage.py`` expects from, the functions of the same names in
``torch/distributed/pipelining/_backward.py`` (torch 2.13 is the reference).

Note [no closure cycle]: no function here defines a nested function that refers to itself or to a
container that will hold it (upstream's recursive ``extract_tensors_with_grads``,
pytorch/pytorch#136507). Tree walks use explicit stacks; the only hooks are capture hooks (a tensor
hook on a non-leaf input in :func:`stage_backward`, a node pre-hook on each intermediate in B); each
closes over a plain list, never over a node, a tensor with a ``grad_fn`` or a ``ParamGroups``, does
not change the gradient, and its handle is removed in ``finally``. W registers no hook on a node of
the stage (one pre-hook on a node of its own, Note [W computes only weight edges]). With the gc
disabled, every saved activation is therefore freed by reference counting as soon as the last
backward of its microbatch returns and the caller drops the outputs.

Note [no node mutation]: nothing writes ``node.metadata`` or any other state onto autograd nodes
(upstream 2.5 stored reverse edges there, pytorch/pytorch#136678). Graph analysis keeps its state in
local dicts (see ``ppbackward._graph``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node
from torch.overrides import has_torch_function
from torch.utils.hooks import RemovableHandle

from ppbackward._compiled import PendingWeightGrads, is_region, note_unsplit, splitting
from ppbackward._errors import BadIndex, BadType, BadValue, StageBackwardError, backpropagated_before
from ppbackward._gc_pause import automatic_gc_paused
from ppbackward._graph import (
    _ACCUMULATE_GRAD,
    NO_CHEAP_WORK,
    CheapLeaf,
    EagerWork,
    FrontierSlot,
    eager_work,
    gradient_edge,
    is_accumulate_grad,
)
from ppbackward._handoff import CONSUMED, ParamGroups, WeightSet, refuse_unreadable_in_b
from ppbackward._matmul_weights import take_saved_inputs
from ppbackward._node_owner import candidate_owners, owners_needed
from ppbackward._param_groups import Contribution, NodeCall, ParamGroup, RegionCall
from ppbackward._plan import analyze_planned
from ppbackward._saved import (
    HOOKS_VISIBLE,
    cpp_nodes_saving,
    holds_saved_tensors,
    hook_kinds,
    pin_saved_inputs,
    release_saved_tensors,
)
from ppbackward._tree import FlatOutputs, flatten_outputs_and_grads, versioned
from ppbackward._weight_edges import ENGINE_RUN_BACKWARD, run_weight_work

__all__ = ["stage_backward", "stage_backward_input", "stage_backward_weight"]

_ROOT_SEQ = float("inf")  # the outputs' gradients come first (Note [accumulation order] in ppbackward._weight_edges)
_NO_EAGER_WORK = EagerWork(set(), [])
# Note [no frame per node]: B's and W's host cost on a small stage is mostly Python frames entered per
# autograd node (a helper, a generator resumed, a NamedTuple's ``__new__``, which is a Python lambda). Their
# loops over nodes, edges, gradients and weights are written inline, and NamedTuples made there are built
# with ``tuple.__new__`` (a C call; the fields in order, no defaults). ``ppbackward._tools.bench.calls``
# counts the frames per node (tests/core/test_call_counts.py).
_new = tuple.__new__
# Outputs B detached in place, by id (weak): meeting one again is an error, not a silent no-op.
_DETACHED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TENSORS = itertools.repeat(torch.Tensor)  # isinstance's second argument for map(): no frame per weight


def _grad_inputs(input_values: Iterable[Any]) -> list[tuple[int, torch.Tensor]]:
    """(position, tensor) of every input that is a tensor requiring grad."""
    return [
        (i, v)
        for i, v in enumerate(input_values)
        if isinstance(v, torch.Tensor) and v.requires_grad
    ]


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _capture_hook(box: list):
    """A tensor hook or node pre-hook that stores what it sees in ``box`` and changes nothing
    (Note [no closure cycle]: it closes over a plain list only)."""

    def hook(grad) -> None:
        box.append(grad)

    return hook


def _refuse_in_functorch_transform(name: str) -> None:
    """Refuse a call inside a ``torch.func`` transform (``grad``, ``vjp``, ``vmap``...) before anything runs, as
    ``torch.autograd.backward`` (torch's ``stage_backward``) does there; torch's own B fails there too ("Attempted
    to get grad_fn, but got None"), and its W never gets that far. One C read."""
    if torch._C._are_functorch_transforms_active():
        raise StageBackwardError(
            f"{name} called inside a torch.func transform (grad, vjp, vmap, ...): autograd's backward is not "
            "supported there (torch.autograd.backward refuses it too); call it outside the transform. Nothing was run"
        )


def stage_backward(
    stage_output: Any,
    output_grads: Any,
    input_values: list[Any],
    outputs_with_grads_idxs: list[int] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Full backward of one stage for one microbatch: input grads plus parameter accumulation.

    Mirrors ``torch.distributed.pipelining._backward.stage_backward`` (torch 2.13) and fixes its
    crash modes: errors name the offending output path instead of an ``AssertionError`` deep in
    autograd, and the stage inputs' ``.grad`` is left exactly as it was (upstream sets it to ``None``
    since pytorch/pytorch#164329).

    Args:
        stage_output: the stage's output: a tensor, or nested tuples/lists/dicts of tensors and
            non-tensor leaves. Outputs that do not require grad are skipped.
        output_grads: gradients matching ``stage_output`` (same nesting, same shapes, dtypes and
            devices), ``None`` leaves allowed for one-element outputs; or ``None`` altogether for a
            loss (implicit gradient 1).
        input_values: the stage's flattened inputs (tensors and non-tensors).
        outputs_with_grads_idxs: deprecated upstream (its compiler path still passes it) and kept the
            same way: when given, only these top-level outputs (and grads) are used; no warning.

    Returns:
        A tuple aligned with ``input_values``: the gradient of each input, or ``None`` for inputs
        that are not tensors, do not require grad, or receive no gradient.

    Raises:
        ValueError, TypeError: malformed ``output_grads`` (see ``ppbackward._tree``); nothing has
            been run or accumulated then.
    """
    _refuse_in_functorch_transform("stage_backward")
    if outputs_with_grads_idxs is not None:  # deprecated upstream, used by torch's compiler path: no warning
        stage_output, output_grads = _select_outputs(stage_output, output_grads, outputs_with_grads_idxs)
    input_values = list(input_values)
    flat = flatten_outputs_and_grads(stage_output, output_grads, consumed=_DETACHED)
    wanted = _grad_inputs(input_values)
    if not flat.tensors:
        return tuple(None for _ in input_values)

    # Leaf inputs: the engine accumulates into ``.grad``; park the caller's value and restore it.
    # Non-leaf inputs: a capture hook, and the ``.grad`` of one that retains it put back too (torch's stage
    # calls ``retain_grad()`` on a received activation that is not a leaf):
    # Note [inputs' grad left as it was]. See Note [no closure cycle].
    parked: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    boxes: dict[int, list] = {}
    kept: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    handles = []
    try:
        for t in _unique(t for _, t in wanted):
            if t.grad_fn is None:
                parked[id(t)] = (t, t.grad)
                t.grad = None
            else:
                if t.retains_grad:
                    kept.append((t, t.grad))
                box: list = []
                boxes[id(t)] = box
                handles.append(t.register_hook(_capture_hook(box)))
        torch.autograd.backward(flat.tensors, grad_tensors=flat.grads)  # type: ignore[arg-type]  # mixed tensors and edges: accepted, not in torch's stub
        found: dict[int, torch.Tensor | None] = {}
        for key, (t, _) in parked.items():
            found[key] = t.grad
        for key, box in boxes.items():
            found[key] = box[0] if box else None
    finally:
        for handle in handles:
            handle.remove()
        for t, previous in parked.values():
            t.grad = previous
        for t, previous in kept:
            t.grad = previous
    result: list[torch.Tensor | None] = [None] * len(input_values)
    for i, t in wanted:
        result[i] = found[id(t)]
    return tuple(result)


def _select_outputs(stage_output: Any, output_grads: Any, idxs: list[int]) -> tuple[list[Any], list[Any]]:
    """The top-level outputs and grads ``outputs_with_grads_idxs`` selects, or a clear error naming the index."""
    for name, seq in (("stage_output", stage_output), ("output_grads", output_grads)):
        if not isinstance(seq, (tuple, list)):  # indexed as torch does, whatever it is
            continue
        for i in idxs:
            if not isinstance(i, int) or not -len(seq) <= i < len(seq):
                raise BadIndex(f"outputs_with_grads_idxs: index {i!r} is out of range for {name} of length {len(seq)}")
    return [stage_output[i] for i in idxs], [output_grads[i] for i in idxs]


def stage_backward_input(
    stage_outputs_or_loss: Any,
    output_grads: Any,
    input_values: list[Any],
    weights: Iterable[torch.nn.Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], ParamGroups]:
    """B: the stage inputs' gradients now, everything weights need for W captured.

    Mirrors ``torch.distributed.pipelining._backward.stage_backward_input`` (torch 2.13). One engine
    call computes the input grads; a capture pre-hook on every *intermediate* (a node on an input
    path with an edge into a weight-only subgraph) records the gradient flowing into it, after any
    tensor hook on that activation, and is removed before B returns. No parameter ``.grad`` is touched
    and no ``AccumulateGrad`` hook fires. The outputs
    that are neither leaves nor views are detached in place afterwards (as upstream,
    pytorch/pytorch#138119), freeing the output side of the graph that W does not need.

    Args:
        stage_outputs_or_loss: the stage outputs (nested like for :func:`stage_backward`), or a
            tuple holding the loss on the last stage.
        output_grads: gradients matching the outputs, or ``None`` for a loss.
        input_values: the stage's flattened inputs (tensors and non-tensors).
        weights: the stage's parameters (an iterator is fine, e.g. ``module.parameters()``).

    Returns:
        ``(input_grads, param_groups)``: ``input_grads`` aligned with ``input_values`` (``None`` for
        non-tensors, inputs not requiring grad and unused inputs); ``param_groups`` a
        :class:`ParamGroups` (groups that read, and for ``"grads"`` write, like torch's dicts: Note
        [param groups read like torch's]) to pass to :func:`stage_backward_weight` exactly once.

    Raises:
        ValueError, TypeError: malformed ``output_grads``, ``weights`` not an iterable of tensors, a stage
            input that is also among ``weights``, or one B reaches under ``register_multi_grad_hook``'s mode "all"
            (Note [a hook asks about a leaf in B]), or, on torch 2.13+, a weight-only node B would run for a weight
            gradient it computes itself whose saved tensor an earlier backward freed or an in-place op changed (Note
            [a weight-only node B runs was freed before] in ``ppbackward._handoff``); nothing has been run then (a
            ``GradientEdge`` output without output gradients raises one that is also an ``AssertionError``, as torch
            2.15's B does).
        StageBackwardError: after B's engine call, when a hook of that call changed in place a gradient B
            had captured for W (Note [captured gradients are checked at W]); the input gradients are
            not returned, nothing was accumulated and no hook is left registered. During it, when it reaches a
            compiled region or custom Function whose saved tensors an earlier backward freed (Note [a graph
            freed under a compiled region]): autograd's error chained, nothing accumulated.
    """
    _refuse_in_functorch_transform("stage_backward_input")
    if torch.is_inference_mode_enabled():
        # The graph was built outside; B needs views with grad_fn to find leaves' AccumulateGrad
        # nodes, which inference mode does not record (a full backward needs none).
        with torch.inference_mode(False):
            return stage_backward_input(stage_outputs_or_loss, output_grads, input_values, weights)
    input_values = list(input_values)
    flat = flatten_outputs_and_grads(stage_outputs_or_loss, output_grads, consumed=_DETACHED)
    grads = flat.grads
    for i in range(len(grads)):  # Note [inference-tensor gradients] (ppbackward._tree)
        g = grads[i]
        if g is not None and g.is_inference():
            grads[i] = versioned(g)
    weight_list = _weights_list(weights)
    wanted = _grad_inputs(input_values)
    weight_set = WeightSet(frozenset(map(id, weight_list)), len(weight_list), _any_dtensor(weight_list))
    asking: list[tuple[int, torch.Tensor]] = []  # Note [a hook asks about a leaf in B]
    kept: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # Note [inputs' grad left as it was]
    for i, t in wanted:  # B stops at a stage input (its gradient is returned): as a weight, W would give it none
        if t.grad_fn is None:
            if t._backward_hooks and _asks_about_leaves(t._backward_hooks.values()):
                asking.append((i, t))
        elif t.retains_grad:
            kept.append((t, t.grad))
        if id(t) in weight_set.ids:
            k = next(k for k, w in enumerate(weight_list) if w is t)
            raise BadValue(
                f"input_values[{i}]: the same tensor as weights[{k}]; B returns a stage input's gradient, so "
                "leave it out of weights"
            )
    if not flat.tensors:
        return tuple(None for _ in input_values), ParamGroups([], weight_set)
    # Note [B claims its outputs]; Note [no collection inside B and W] in ppbackward._gc_pause
    with _outputs_claimed(flat.tensors), automatic_gc_paused():
        try:
            return _backward_input(flat, output_grads is not None, input_values, wanted, weight_set, asking)
        finally:
            for t, previous in kept:
                t.grad = previous


# Note [inputs' grad left as it was]: B and the full backward return the stage inputs' gradients and leave
# their ``.grad`` as the caller had it. A leaf input's is parked before the full backward's engine call (which
# accumulates into it) and put back; B's engine call does not write it. A non-leaf input that retains its
# gradient (``retain_grad()``: torch's stage calls it on a received activation that is not a leaf) gets it
# written by autograd's retain hook in either call, so its ``.grad`` is put back afterwards too: otherwise
# each microbatch's input gradient stayed referenced from its activation (torch's full backward sets it to
# ``None``, torch's B adds to it).


def _backward_input(
    flat: FlatOutputs, grads_given: bool, input_values: list[Any], wanted: list, weight_set: WeightSet,
    asking: list[tuple[int, torch.Tensor]],
) -> tuple[tuple[torch.Tensor | None, ...], ParamGroups]:
    """B's work once its arguments are checked and its outputs claimed (see :func:`stage_backward_input`);
    ``asking``: the stage inputs under ``register_multi_grad_hook``'s mode "all", by index."""
    grad_inputs = _unique(t for _, t in wanted)
    input_nodes = {gradient_edge(t).node for t in grad_inputs}
    root_edges = [gradient_edge(t) for t in flat.tensors]
    analysis = analyze_planned(root_edges, input_nodes)  # Note [one plan per graph structure]
    for i, t in asking:  # Note [a hook asks about a leaf in B]: refused where the engine call would reach it
        if gradient_edge(t).node in analysis.structure.number:
            raise BadValue(_LEAF_QUERY_REFUSED.format(where=f"input_values[{i}]", after="Nothing was run"))
    specs, b_only, w_only = analysis.groups, analysis.b_only, analysis.w_only
    inter = [i.node for spec in specs for i in spec.intermediates]
    _refuse_reentrant_checkpoint(b_only, inter, w_only)
    if analysis.cheap.nodes:  # Note [a weight-only node B runs was freed before] (ppbackward._handoff)
        refuse_unreadable_in_b(analysis.cheap.nodes)
    owners = candidate_owners(flat.tensors)  # Note [custom Function nodes need an owner]; () on torch 2.13+
    # Note [weight matmuls from their saved input] (ppbackward._matmul_weights): without saved-tensor hooks
    # on what W reads (the deferred intermediates, the W-only nodes), B computes the matmuls' weight gradients
    # from their taken-out input and keeps no graph; the hooks of nodes only B runs then need nothing more
    taken = None
    cheap = analysis.cheap
    deferred, deferred_edges = _deferred(specs, _NO_EAGER_WORK.nodes, cheap.edges)
    if HOOKS_VISIBLE and not hook_kinds([*deferred, *w_only]):
        taken = take_saved_inputs(deferred, deferred_edges, cheap.edges)
    eager = _NO_EAGER_WORK
    if taken is None:
        eager = _eager_work(analysis, b_only, inter, w_only)  # Note [hooked saved tensors run once]
    if eager is not _NO_EAGER_WORK:
        # Note [cheap weight gradients in B] (ppbackward._graph); not beside hooked work, which runs as before
        cheap = NO_CHEAP_WORK
        deferred, deferred_edges = _deferred(specs, eager.nodes, cheap.edges)
    # B must keep the graph for the C++ intermediates W calls again; otherwise it releases every node
    # it runs, as a full backward does (Note [hooked saved tensors run once])
    retain = taken is None and any(not isinstance(n, BackwardCFunction) for n in deferred)
    # Note [compiled regions split in two] (ppbackward._compiled): B runs these regions' input halves; and
    # where B keeps the graph, the regions it runs whole must not be refused for their donated buffers
    regions: list[tuple[Any, tuple[int, ...]]] = []
    # custom Functions whose saved tensors B releases, or its engine call frees: read before that call. Not a
    # region's: a write into "grads" for a region is refused by its type alone (_checked_grads), and reading a
    # region's saved tensors costs one wrapper per tensor (a block's activations)
    spent_list: list[Any] = []
    for n, e in zip(deferred, deferred_edges):  # Note [no frame per node]
        if isinstance(n, BackwardCFunction):
            if is_region(n):
                regions.append((n, e))
            elif holds_saved_tensors(n):
                spent_list.append(n)
    spent = frozenset(spent_list)
    whole = [n for n in (*b_only, *eager.nodes) if isinstance(n, BackwardCFunction) and is_region(n)] if retain else []
    try:
        run = _engine_call(flat, grad_inputs, deferred, eager, cheap, retain, regions, whole)
    except RuntimeError as e:  # Note [a graph freed under a compiled region]
        node = _freed_at(e)
        if node is None:
            if _LEAF_QUERY in str(e):  # Note [a hook asks about a leaf in B]
                where = "stage_backward_input"
                raise StageBackwardError(_LEAF_QUERY_REFUSED.format(where=where, after=_AFTER_QUERY)) from e
            raise
        raise backpropagated_before(
            "stage_backward_input or backward",
            f"{node.name()} holds no saved tensors any more",
            f"autograd stopped B at {node.name()}: hooks and custom Function backwards above it may have run; "
            "nothing was accumulated, and an earlier B's W is intact",
        ) from e
    captured: dict = {}
    for node, w_edges, box in zip(deferred, deferred_edges, run.boxes):  # _checked_capture's common case inline
        if not box:  # (Note [no frame per node])
            captured[node] = None
            continue
        grads, versions = box[0]
        for g, version in zip(grads, versions):
            if g is not None and g._version != version:
                captured[node] = _checked_capture(node, box, w_edges, analysis.structure)
                break
        else:
            captured[node] = grads
    for node in run.unseen:  # Note [compiled regions split in two]: ran, but compiled before install()
        if captured.get(node) is not None:
            note_unsplit(node)

    groups = _build_groups(
        specs, captured, cheap.edges, flat.grads, root_edges, run.frontier, eager.nodes, spent, run.halves, taken
    )
    pinned: list = []
    w_saving: list = []
    taken_ = taken or {}  # the matmuls W computes from what B took out: their graph is released
    if groups:  # Note [release unread saved tensors]
        called = set(deferred)
        done_in_b = {*eager.nodes, *cheap.nodes, *[n for n in cheap.edges if n not in called]}
        if HOOKS_VISIBLE:  # Note [saved tensors W reads are checked] (ppbackward._handoff): W reads them first
            w_saving = [n for n in cpp_nodes_saving(w_only) if n not in done_in_b]
        if retain:  # else B's engine call released every node it ran
            release_saved_tensors(
                [*b_only, *[n for n in deferred if isinstance(n, BackwardCFunction)], *done_in_b]
            )
        # Note [outputs detached after B]: given a loss, B cannot tell the stage outputs from the rest
        at_risk = analysis.output_consumers if grads_given else [*inter, *w_only]
        pinned = pin_saved_inputs(
            [n for n in at_risk if not isinstance(n, BackwardCFunction) and n not in done_in_b and n not in taken_]
        )
    # Note [custom Function nodes need an owner]: what W runs and the intermediates a group lists, which a write
    # into "grads" makes W call again and whose input metadata checks the write (freed: a segfault on torch 2.5.1)
    owners = owners_needed(owners, [(group.calls, group.ready, group._nodes) for group in groups])
    _detach_outputs(flat.tensors, analysis.used_nodes)
    result: list[torch.Tensor | None] = [None] * len(input_values)
    for i, t in wanted:
        result[i] = run.found.get(id(t))
    return tuple(result), ParamGroups(groups, weight_set, owners, pinned, run.hooked_in_b, w_saving)


def _deferred(specs: list, eager_nodes: set, cheap_edges: dict) -> tuple[list[Node], list[tuple[int, ...]]]:
    """The intermediates whose weight work waits for W (not run entirely in B, not every weight edge computed
    by B), and each one's weight edges."""
    nodes: list[Node] = []
    edges: list[tuple[int, ...]] = []
    for spec in specs:  # Note [no frame per node]
        for node, w_edges in spec.intermediates:
            if node not in eager_nodes and len(cheap_edges.get(node, ())) < len(w_edges):
                nodes.append(node)
                edges.append(w_edges)
    return nodes, edges


# Note [a graph freed under a compiled region]: B refuses a second backward through the same outputs before anything
# runs where it can see the earlier one (outputs it detached, saved inputs it took out, hooked saved tensors it
# released: Note [B claims its outputs]). A compiled region's saved tensors are out of that sight (reading them costs
# one wrapper per tensor, which every B would pay), and so are those of a custom Function or of any node B only passes
# through; a graph an earlier B or backward freed at such a node is found when the engine reaches it. Autograd raises
# its "backward through the graph a second time" from inside that node's ``BackwardCFunction.apply`` (``apply_boxed``
# for a region on torch 2.13+; every custom Function's and region's backward goes through one of them, torch 2.5-2.15).
# B finds that frame in the traceback, checks that the node's saved tensors are freed (as they are only when an earlier
# call ran it: this call raised on entering it), and raises its StageBackwardError naming the node, autograd's chained.
# Any other error, a hook's with the same words included, comes through as it was raised. What ran before that node in
# this call ran (tensor and module hooks above it, custom Function backwards); nothing was accumulated (B accumulates
# nothing), and its capture hooks, claims and the regions' plans are undone on the way out. The matmul inputs B took out
# before its call (Note [weight matmuls from their saved input]) stay out: that graph is spent.
_BACKWARD_TWICE = "backward through the graph a second time"  # autograd's ERR_BACKWARD_TWICE, torch 2.5-2.15
# the methods autograd enters a custom Function's or region's backward through (apply_boxed: regions, torch 2.13+)
_APPLY = frozenset(getattr(BackwardCFunction, name).__code__ for name in ("apply", "apply_boxed")
                   if hasattr(BackwardCFunction, name))


# Note [a hook asks about a leaf in B]: B computes the input gradients as ``torch.autograd.grad`` does (its
# engine call accumulates nothing), where ``torch._C._will_engine_execute_node`` refuses the ``AccumulateGrad``
# of a leaf whose gradient the call returns: a stage input. ``register_multi_grad_hook`` in its default mode
# "all" asks that of every tensor it covers when its first gradient arrives, so over a stage input it fails
# inside B's engine call, part-way (torch's own B fails there too), where the call reaches that input (an input
# the differentiated outputs do not depend on is not asked about). Its hook sits on the input tensor itself, so
# B refuses it after the analysis (which says whether the input is reached) and before running anything, the
# graph intact; where such a query comes from elsewhere (a hook of the user's own), B names it when autograd
# raises it. Over parameters and activations only, the hook fires in B and in W (two engine calls), and never
# asks about a leaf B returns.
_LEAF_QUERY = "A leaf node was passed to _will_engine_execute_node"
_LEAF_QUERY_REFUSED = (
    "{where}: a hook asks whether a stage input's AccumulateGrad will run (torch._C._will_engine_execute_node: "
    "what torch.autograd.graph.register_multi_grad_hook does in its default mode 'all' over a stage input); B "
    "computes input gradients as torch.autograd.grad does, where torch cannot answer that for a stage input "
    "(torch's own B fails the same way). Register that hook with mode='any' or leave the stage inputs out of it, "
    "or give this stage a full backward (stage_backward: a schedule without zero bubble). {after}"
)
_AFTER_QUERY = ("Autograd stopped B part-way: hooks above that point may have run; nothing was accumulated, and "
                "this microbatch's graph is spent")


def _nested_code(code: Any, name: str) -> Any:
    """The code object of the function ``name`` defined in ``code`` (``None`` where there is none)."""
    return next((c for c in code.co_consts if isinstance(c, type(code)) and c.co_name == name), None)


# register_multi_grad_hook's mode-"all" hook (torch 2.5-2.15: ``get_inner_hook``'s ``inner_hook``); None where a
# torch defines it otherwise, and then only autograd's error names it (Note [a hook asks about a leaf in B])
_INNER = _nested_code(torch.autograd.graph.register_multi_grad_hook.__code__, "get_inner_hook")
_MULTI_GRAD_ALL = None if _INNER is None else _nested_code(_INNER, "inner_hook")


def _asks_about_leaves(hooks: Iterable[Any]) -> bool:
    """Whether one of a stage input's tensor hooks is ``register_multi_grad_hook``'s mode-"all" hook."""
    return _MULTI_GRAD_ALL is not None and any(getattr(h, "__code__", None) is _MULTI_GRAD_ALL for h in hooks)


def _freed_at(error: RuntimeError) -> Any:
    """The custom Function or compiled region node autograd was entering when it raised ``error`` because an
    earlier backward freed what the node saved, or ``None`` (Note [a graph freed under a compiled region])."""
    if _BACKWARD_TWICE not in str(error):
        return None
    node = None
    tb = error.__traceback__
    while tb is not None:  # the innermost such frame is the node that raised
        if tb.tb_frame.f_code in _APPLY:
            node = tb.tb_frame.f_locals.get("self")
        tb = tb.tb_next
    if not isinstance(node, BackwardCFunction):
        return None
    try:
        node._raw_saved_tensors  # noqa: B018 (read for the error it raises once freed)
    except RuntimeError:
        return node
    return None


class _Captured(NamedTuple):
    """What a capture hook saw (Note [capturing intermediates]): the gradients, and their versions then
    (Note [captured gradients are checked at W] in ``ppbackward._handoff``)."""

    grads: tuple
    versions: tuple


class _EngineCall(NamedTuple):
    """What B's engine call left: per deferred intermediate its capture box (a list that gets one
    :class:`_Captured` if the engine reached the node), the input gradients by input id, each
    frontier slot (:class:`~ppbackward._graph.FrontierSlot` or ``CheapLeaf``) with its gradient, and the
    tensor hooks registered during the call on the leaves it captured at, ``(leaf, hook ids)`` (Note
    [hooks registered during B])."""

    boxes: list[list[_Captured]]
    found: dict[int, torch.Tensor | None]
    frontier: list[tuple[FrontierSlot | CheapLeaf, torch.Tensor | None]]
    hooked_in_b: list[tuple[torch.Tensor, tuple[int, ...]]]
    halves: dict[Any, PendingWeightGrads]  # compiled region -> its weight half (Note [compiled regions split in two])
    unseen: list  # the regions to split whose compiled backward never saw the plan (compiled before install)


def _engine_call(
    flat: FlatOutputs, grad_inputs: list, deferred: list, eager: EagerWork, cheap: Any, retain: bool, regions: list,
    whole: list,
) -> _EngineCall:
    """B's one engine call, with a capture hook on each deferred intermediate, removed whatever happens.

    Note [capturing intermediates]: a C++ intermediate gets a pre-hook recording the gradients flowing
    into it, after the tensor hooks on that activation ran (exactly what the node consumes; an engine
    ``GradientEdge`` capture would see them before those hooks); W calls it again. A custom
    ``autograd.Function`` computes all its outputs whatever the engine needs (and may have side effects),
    so it must run once: a post-hook records its outputs in B, and W only routes the weight edges among
    them (no re-run). A compiled region among the deferred ones (``regions``: ``(node, w_edges)``) runs only
    its input half, and its weight half waits for W; the regions B runs whole (``whole``, where B keeps the
    graph) have their donated buffers switched off for the call (Note [compiled regions split in two] in
    ``ppbackward._compiled``). The intermediates B runs entirely
    (``eager``) need no capture: the engine call returns what they send to W's nodes, at the frontier
    edges; nor do those whose every weight edge B computes (``cheap``): the engine call returns the
    gradient at each such weight's ``AccumulateGrad``.
    """
    taken = [slot.edge for slot in eager.frontier] + [leaf.edge for leaf in cheap.leaves]
    boxes: list[list[_Captured]] = [[] for _ in deferred]
    handles = []
    try:
        for node, box in zip(deferred, boxes):  # Note [one frame per capture]
            if isinstance(node, BackwardCFunction):
                handles.append(node.register_hook(_capture_outputs_hook(box)))
            else:
                handles.append(node.register_prehook(_capture_inputs_hook(box)))
        if not (grad_inputs or taken):
            return _EngineCall(boxes, {}, [], [], {}, [])
        frontier = [slot.edge.node for slot in eager.frontier]
        # cheap leaves have no hook to mute; watched for hooks registered during B, as the frontier's
        with _leaf_hooks_muted(frontier, cheap.leaves) as hooked_in_b:  # noqa: SIM117 (3.9 has no parenthesised with)
            with splitting(regions, whole) as plans:
                results = _grad(flat, [*grad_inputs, *taken], retain)
    finally:
        _remove_handles(handles)
    found: dict[int, torch.Tensor | None] = {id(t): g for t, g in zip(grad_inputs, results)}
    slots: list[FrontierSlot | CheapLeaf] = [*eager.frontier, *cheap.leaves]
    grads: list[torch.Tensor | None] = list(results[len(grad_inputs) :])
    halves = {node: plan.pending for node, plan in plans.items() if plan.pending is not None}
    unseen = [node for node, plan in plans.items() if plan.pending is None and plan.declined is None]
    return _EngineCall(boxes, found, list(zip(slots, grads)), hooked_in_b, halves, unseen)


def _grad(flat: FlatOutputs, inputs: list, retain: bool) -> tuple:
    """``torch.autograd.grad(flat.tensors, inputs, flat.grads, retain_graph=retain, allow_unused=True)``.

    Note [B enters the engine directly]: where every output has its gradient (``ppbackward._tree`` checked each
    against its output: what ``torch.autograd.grad``'s ``_make_grads`` would) and no tensor overrides
    ``__torch_function__``, B calls the engine entry point ``torch.autograd.grad`` itself ends in, without its
    per-input Python checks (about 1.7 µs per input; B names one per weight whose gradient it computes, Note
    [cheap weight gradients in B]). A loss without a gradient (made by ``_make_grads``) or an overriding
    subclass takes the public call."""
    tensors = [t for t in flat.tensors if isinstance(t, torch.Tensor)]
    if (
        ENGINE_RUN_BACKWARD is None
        or any([g is None for g in flat.grads])
        or has_torch_function((*tensors, *[t for t in inputs if isinstance(t, torch.Tensor)]))
    ):
        return torch.autograd.grad(
            flat.tensors,  # type: ignore[arg-type]  # mixed tensors and edges: accepted, not in torch's stub
            inputs,
            grad_outputs=flat.grads,
            retain_graph=retain,
            allow_unused=True,
        )
    return ENGINE_RUN_BACKWARD(tuple(flat.tensors), tuple(flat.grads), retain, False, tuple(inputs), True, False)


# Note [B claims its outputs]: B registers the outputs it was given (by id, under a lock) before it runs
# anything and unregisters them when it returns. A second B on the same outputs while the first is
# still running (from a hook the first one fires, or from another thread) is refused before it runs
# anything; a later one finds them detached (``_DETACHED``) or their graph released by the first B
# (``hook_kinds``: "released"), and is refused too. Either way the first microbatch's W is untouched.
_IN_B: dict[Any, Any] = {}
_IN_B_LOCK = threading.Lock()


@contextlib.contextmanager
def _outputs_claimed(outputs: list[Any]) -> Iterator[None]:
    keys = [(id(t.node), t.output_nr) if isinstance(t, GradientEdge) else id(t) for t in outputs]
    with _IN_B_LOCK:
        for i, key in enumerate(keys):
            if key in _IN_B:
                raise StageBackwardError(
                    f"stage_outputs_or_loss: differentiable output {i} is being backpropagated by another "
                    "stage_backward_input call, still running (B called from a hook it fired, or from another "
                    "thread); a microbatch's outputs go through backward once"
                )
        _IN_B.update(zip(keys, outputs))
    try:
        yield
    finally:
        with _IN_B_LOCK:
            for key in keys:
                _IN_B.pop(key, None)


def _eager_work(analysis: Any, b_only: list, inter: list, w_only: list) -> EagerWork:
    """The W work B does itself because of saved-tensor hooks (Note [hooked saved tensors run once]):
    all of it where a node B runs holds a tensor through a hook, else the checkpointed nodes of W's
    (and what feeds them); none without hooks."""
    kinds = hook_kinds([*b_only, *inter, *w_only])
    if not kinds:
        return _NO_EAGER_WORK
    released = next((node for node, kind in kinds.items() if kind == "released"), None)
    if released is not None:  # Note [B claims its outputs]
        raise backpropagated_before("stage_backward_input", f"it released or pinned what {released.name()} saved")
    if any(kinds.get(node) == "held" for node in (*b_only, *inter)):
        return eager_work(analysis, None)
    recompute = [node for node in (*inter, *w_only) if kinds.get(node) == "recompute"]
    return eager_work(analysis, recompute) if recompute else _NO_EAGER_WORK


# Note [frontier captures skip leaf hooks]: (the frontier of B's hooked work; the weights of Note [cheap
# weight gradients in B] are captured the same way, and for that reason only where they have no tensor
# hook) the engine runs the tensor hooks of a node it does not run before capturing the gradient flowing
# into it (``evaluate_function``: tensor pre-hooks of
# a node that is only captured). B's frontier edges (Note [hooked saved tensors run once]) may lead
# straight into a parameter's ``AccumulateGrad``: captured as is, the gradient would come with the
# parameter's ``register_hook`` hooks applied, and W, which feeds it to that ``AccumulateGrad``, would
# apply them a second time (a hook scaling by 0.5 gave 0.25). So B empties those parameters'
# ``_backward_hooks`` dicts (which torch's C++ hook reads at call time) for its engine call and puts
# every hook back, in order, afterwards, whatever happens: the hooks run once, in W, as in a full
# backward (in W, not B). A tensor hook on a non-leaf activation inside such a weight subgraph cannot
# be reached from its node and is not covered (docs/how-it-works.md, Known limits).
#
# Note [hooks registered during B]: a hook of B's engine call (a tensor hook on an activation, a module's
# backward hook) may register a tensor hook on a parameter whose gradient B captures at its
# ``AccumulateGrad`` (a norm weight, a bias: Note [cheap weight gradients in B]; a frontier leaf). Registered
# before the capture, the engine runs it there, in B, on the gradient B keeps; a full backward runs it once,
# when that ``AccumulateGrad`` runs, at the same point. W feeding the kept gradient to the ``AccumulateGrad``
# would run it a second time (a x0.5 hook gave 0.25x). Registered after the capture, a full backward has run
# that ``AccumulateGrad`` already and does not run it for this microbatch either. So the hooks registered
# on those leaves during B's engine call are B's: B lists them (the leaf and the hook ids, after its call),
# and W mutes exactly those for its accumulating calls and puts them back, in order, afterwards (Note
# [W mutes B's hooks] in ``ppbackward._handoff``); hooks registered after B returned run in W, as
# every parameter hook does. Cost: ``RemovableHandle.next_id`` (torch's counter of every hook registered
# through a handle, ``Tensor.register_hook`` included) is read before and after the call; only when it moved
# are the captured leaves' hook dicts read.
@contextlib.contextmanager
def _leaf_hooks_muted(
    nodes: list[Any], cheap: list[CheapLeaf]
) -> Iterator[list[tuple[torch.Tensor, tuple[int, ...]]]]:
    """Around B's engine call: empty the hook dicts of the leaves among ``nodes`` (the frontier: Note
    [frontier captures skip leaf hooks]) and put them back, in order, whatever happens; the list yielded gets,
    on a normal exit, the hooks registered during the block on those leaves and on the ``cheap`` ones (Note
    [hooks registered during B])."""
    parked: dict[int, tuple[dict, list]] = {}
    for node in nodes:  # is_accumulate_grad inline (Note [no frame per node])
        leaf = getattr(node, "variable", None) if type(node) is _ACCUMULATE_GRAD else None
        hooks = getattr(leaf, "_backward_hooks", None)
        if hooks:
            parked[id(leaf)] = (hooks, list(hooks.items()))
            hooks.clear()
    registered = RemovableHandle.next_id
    hooked_in_b: list[tuple[torch.Tensor, tuple[int, ...]]] = []
    try:
        yield hooked_in_b
        if RemovableHandle.next_id != registered:
            hooked_in_b += _hooks_registered([*nodes, *(leaf.edge.node for leaf in cheap)])
    finally:
        for hooks, items in parked.values():
            later = list(hooks.items())  # registered during the block: after the parked ones, as registered
            hooks.clear()
            hooks.update(items)
            hooks.update(later)


def _hooks_registered(nodes: list[Any]) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``(leaf, hook ids)`` of the leaves among ``nodes`` holding tensor hooks now: called before the parked
    hooks are put back, so these are the ones registered during B's engine call (Note [hooks registered
    during B])."""
    found = []
    for node in nodes:
        if is_accumulate_grad(node):
            leaf: torch.Tensor = node.variable
            if leaf._backward_hooks:
                found.append((leaf, tuple(leaf._backward_hooks)))
    return found


# Note [one frame per capture]: B's capture of a deferred intermediate is one Python frame when the
# engine reaches the node: a ``functools.partial`` (made in C) of a module-level function over the node's
# box, which records the gradients and their versions inline. Registering the hook enters torch's two
# Python frames (``Function._register_hook``, ``RemovableHandle.__init__``); removing it enters none
# (:func:`_remove_handles`). The hook still closes over a plain list only (Note [no closure cycle]).
def _capture_inputs(box: list, grad_outputs: tuple) -> None:
    """A node pre-hook (bound to ``box`` by ``functools.partial``) that stores the gradients flowing into
    the node, and their versions then, in ``box`` (Note [captured gradients are checked at W] in
    ``ppbackward._handoff``)."""
    versions = []
    for g in grad_outputs:
        versions.append(None if g is None else g._version)
    box.append(_new(_Captured, (grad_outputs, tuple(versions))))


def _capture_outputs(box: list, grad_inputs: tuple, _grad_outputs: tuple) -> None:
    """A node post-hook (bound to ``box``) that stores the node's outputs, and their versions then."""
    versions = []
    for g in grad_inputs:
        versions.append(None if g is None else g._version)
    box.append(_new(_Captured, (grad_inputs, tuple(versions))))


# The factories B calls per deferred intermediate: ``factory(box)`` is ``functools.partial(capture, box)``,
# made in C (no frame); module globals, looked up at each call (tests/core/test_capture_leaks.py spies on them)
_capture_inputs_hook = functools.partial(functools.partial, _capture_inputs)
_capture_outputs_hook = functools.partial(functools.partial, _capture_outputs)


def _remove_handles(handles: list) -> None:
    """``handle.remove()`` for each node-hook handle, its work done inline where the handle is torch's plain
    ``RemovableHandle`` without extra dicts (Note [one frame per capture]); any other kind is asked."""
    for handle in handles:
        ref = getattr(handle, "hooks_dict_ref", None)
        if ref is None or getattr(handle, "extra_dict_ref", None) or type(handle) is not RemovableHandle:
            handle.remove()
            continue
        hooks = ref()
        if hooks is not None:
            hooks.pop(handle.id, None)


def _checked_capture(node: Any, box: list[_Captured], w_edges: tuple[int, ...], structure: Any) -> tuple | None:
    """What B captured for ``node`` (``None`` if the engine never reached it), or a
    :class:`StageBackwardError` when a later hook of B's own engine call changed what W reads of it in
    place: every gradient flowing into a C++ intermediate, the weight edges (``w_edges``) of a custom
    Function's outputs. ``structure`` (the analysis') names the tensors whose hook may have done it.

    Note [captured gradients are checked at W] covers changes after B; this covers one during B: a hook
    that runs after the capture and modifies its gradient argument in place (autograd's contract forbids
    it) changes what W would compute from, since one gradient tensor can flow to several nodes (``Add``
    hands both operands the same one). A full backward computed the weight gradient before that hook ran.
    """
    if not box:
        return None
    grads, versions = box[0].grads, box[0].versions
    custom = isinstance(node, BackwardCFunction)
    for i in w_edges if custom else range(len(grads)):
        g, version = grads[i], versions[i]
        if g is not None and g._version != version:
            name = node.name()
            where = f"that {name} sends along its edge {i}" if custom else f"flowing into {name} (input {i})"
            raise StageBackwardError(
                f"stage_backward_input: the gradient {where}, {g.dtype} {list(g.shape)}, "
                f"was modified in place later in B (version {version} -> {g._version}), after B captured it "
                f"for W, by a hook that received the same gradient tensor ({_sharers(node, structure)}). "
                "autograd's hooks must not change their argument in place (return a new tensor instead); W "
                "would compute the weight gradient from the changed values. Nothing was accumulated"
            )
    return grads


def _sharers(node: Any, structure: Any) -> str:
    """The tensors that received ``node``'s incoming gradient too (their hooks could change it): named by
    their ``grad_fn`` and the node that fed both."""
    st = structure
    i = st.number.get(node)
    names = []
    for p in st.parents[i] if i is not None else ():
        for kid, _ in st.nexts[p]:
            if kid is not None and kid is not node:
                names.append(f"the tensor whose grad_fn is {kid.name()}, fed by {st.nodes[p].name()}")
    return "; ".join(dict.fromkeys(names)) or "a tensor hook or node hook of the stage"


def _refuse_reentrant_checkpoint(*node_lists) -> None:
    for nodes in node_lists:
        for kind in set(map(type, nodes)):  # the distinct node types, found in C (Note [no frame per node])
            if kind.__name__ == "CheckpointFunctionBackward":
                raise StageBackwardError(
                    "stage_backward_input: the stage uses torch.utils.checkpoint with "
                    "use_reentrant=True (node CheckpointFunctionBackward), whose backward cannot run "
                    "inside the engine calls of B and W (they name their inputs); use "
                    "use_reentrant=False, or a full backward (stage_backward)"
                )


def _detach_outputs(outputs: list[Any], used_nodes: set) -> None:
    """Free the output side of the graph after B by detaching outputs in place (as upstream,
    pytorch/pytorch#138119), except where that would break W or the caller.

    Note [safe in-place detach]: an output is left attached when it is a leaf (a parameter returned
    as output would lose ``requires_grad``), a view (cannot be detached in place,
    pytorch/pytorch#142229), or an input of another op of the stage (its ``grad_fn`` is in
    ``used_nodes``): that op may have saved it, and W re-running the op would fail with "Trying to
    use a saved tensor that has been detached in-place" (upstream 2.13 crashes there).
    """
    for t in outputs:
        if not isinstance(t, torch.Tensor):  # a GradientEdge: nothing to detach
            continue
        if t.grad_fn is not None and not t._is_view() and t.grad_fn not in used_nodes:
            t.detach_()
            _DETACHED[id(t)] = t


def _build_groups(
    specs, captured: dict, cheap_edges: dict, output_grads, root_edges, frontier, eager_nodes, spent: frozenset,
    halves: dict, taken: dict | None = None,
) -> list[ParamGroup]:
    """Turn what B captured (``captured``: intermediate -> its gradients, for the intermediates W calls;
    ``cheap_edges``: intermediate -> the weight edges B computed itself) and the frontier gradients of
    B's own W work (``frontier``: ``(slot, grad)``, the weight leaves of Note [cheap weight gradients in B]
    among the slots) into W's work.

    C++ intermediates become deferred calls; a custom Function's captured outputs, the outputs that
    lead straight into weight-only nodes and the frontier gradients become ready contributions, each
    tagged with the sequence number that orders it (Note [accumulation order] in
    ``ppbackward._weight_edges``). Intermediates B ran entirely are not in ``captured``: W does nothing
    for them, nor for an output whose gradient B's engine call already sent on (into a node B ran, or
    into a frontier slot, whose gradient includes it). A compiled region B split (``halves``: node -> its
    :class:`~ppbackward._compiled.PendingWeightGrads`) gives W its weight half to run instead of outputs.
    ``taken`` (node -> ``(mat1, version)``): the matmuls whose weight gradients W computes from what B took
    out of them (Note [weight matmuls from their saved input] in ``ppbackward._matmul_weights``), each group
    given its own.
    """
    extra: dict[int, list[Contribution]] = {}
    done = set()  # the frontier slots, whose gradients B's engine call already sent on (with the roots')
    fed_by: dict[int, dict] = {}  # group -> {the one intermediate feeding a cheap leaf: its entries}
    for slot, grad in frontier:
        done.add(slot.edge)
        if grad is not None:
            entry = _new(Contribution, (slot.edge, grad, slot.seq))
            extra.setdefault(id(slot.group), []).append(entry)
            feeders = slot.feeders if isinstance(slot, CheapLeaf) else ()  # Note [param groups read like torch's]
            for node in feeders:
                fed_by.setdefault(id(slot.group), {}).setdefault(node, []).append(entry if len(feeders) == 1 else None)
    groups: list[ParamGroup] = []
    for spec in specs:  # Note [no frame per node]: plain loops, NamedTuples made by tuple.__new__
        deferred: list[NodeCall] = []
        ready = []
        for i in spec.root_edges:
            if root_edges[i] not in done and root_edges[i].node not in eager_nodes:
                ready.append(_new(Contribution, (root_edges[i], output_grads[i], _ROOT_SEQ)))
        ready += extra.get(id(spec), [])
        regions: list[tuple[Any, PendingWeightGrads]] = []
        nodes = []  # Note [param groups read like torch's]: the intermediates W could still call
        replaced = dict(fed_by.get(id(spec), {}))  # node -> B's entries its written gradients replace
        group_taken: dict = {}  # the taken inputs of this group's intermediates (a written gradient may need one)
        for inter in spec.intermediates:
            node, w_edges = inter
            if taken:
                saved = taken.get(node)
                if saved is not None:
                    group_taken[node] = saved
            grads = captured.get(node)
            pending = halves.get(node) if halves else None
            if pending is not None:  # Note [compiled regions split in two]: W runs its weight half
                regions.append((node, pending))
                replaced[node] = []
                nodes.append(inter)
                continue
            if grads is None:
                continue
            for g in grads:
                if g is not None:
                    break
            else:  # nothing flowed into it
                continue
            if isinstance(node, BackwardCFunction):  # outputs, computed once in B
                nf, seq = node.next_functions, node._sequence_nr()
                mine = [Contribution(GradientEdge(*nf[i][:2]), grads[i], seq) for i in w_edges if grads[i] is not None]
                ready += mine
                replaced[node] = mine
                nodes.append(inter)
            else:  # only the weight edges B did not compute (Note [cheap weight gradients in B])
                in_b = cheap_edges.get(node)
                todo = w_edges
                if in_b is not None:
                    left = []
                    for j in w_edges:
                        if j not in in_b:
                            left.append(j)
                    todo = tuple(left)
                deferred.append(_new(NodeCall, (node, tuple(grads), todo)))
                nodes.append(inter)
        if deferred or ready or regions:
            params = []
            for leaf in spec.leaves:
                params.append(leaf.variable)
            # the sole source of its group's gradients: W may hand them over (Note [weight halves hand their
            # gradients over] in ppbackward._weight_edges)
            alone = len(regions) == 1 and not deferred and not ready
            calls = []
            for region, half in regions:
                calls.append(_new(RegionCall, (region, half, alone)))
            groups.append(
                ParamGroup(deferred, ready, params, nodes, spec.leaves, replaced, spent, calls, group_taken)
            )
    return groups


def stage_backward_weight(
    weights: Iterable[torch.nn.Parameter],
    param_groups: ParamGroups,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """W: accumulate the weights' gradients of one microbatch, through their ``AccumulateGrad``.

    Mirrors ``torch.distributed.pipelining._backward.stage_backward_weight`` (torch 2.13) and fixes
    it: gradients flow through each parameter's ``AccumulateGrad`` node exactly as in a full
    backward, so tensor hooks and ``register_post_accumulate_grad_hook`` hooks (DDP,
    optimizer-in-backward; pytorch/pytorch#144530) fire once per parameter, and the grad layout is
    the one a full backward produces. Two engine calls per chunk of param groups holding about 4 MiB
    of parameters (one chunk for a small stage; Note [W in chunks] in ``ppbackward._handoff``): one
    computes the intermediates' weight edges (Note [W computes only weight edges] in
    ``ppbackward._weight_edges``), one runs the weight-only subgraphs and accumulates every parameter of
    the chunk exactly once.

    Args:
        weights: the same parameters that were given to :func:`stage_backward_input`.
        param_groups: the object :func:`stage_backward_input` returned for this microbatch.
        retain_graph: passed to the accumulating engine call; ``param_groups`` is consumed either
            way.

    Returns:
        A tuple aligned with ``weights``: each parameter's ``.grad`` after accumulation.

    Raises:
        TypeError: ``param_groups`` is not a :class:`ParamGroups` (e.g. upstream's list of dicts), or
            ``weights`` is not an iterable of tensors.
        RuntimeError: ``param_groups`` was already consumed by an earlier call.
        ValueError: ``weights`` are not the parameters given to B (another stage's, or a subset).
        These three are raised before anything runs; ``param_groups`` stays usable then. Once W has
        started (claimed ``param_groups``), it is released whatever happens, and these refusals come
        before anything accumulates: StageBackwardError, a gradient B captured (or a caller wrote into
        ``"grads"``) was changed in place since (Note [captured gradients are checked at W]), or a weight-only
        node W runs cannot read a tensor it saved (Note [saved tensors W reads are checked]); ValueError, a
        parameter's shape changed since B. A chunk after the first is checked again before it runs
        (a hook of an earlier chunk may have changed its gradients): refused there, the earlier chunks
        stay accumulated. An exception while computing a
        chunk's weight edges leaves that chunk's and later chunks' ``.grad`` untouched (a stage
        under 4 MiB of parameters is one chunk: every ``.grad``); one raised inside an
        accumulating call (e.g. by a user hook) can leave the parameters accumulated before it, but
        never half-accumulates one: each gets exactly one ``AccumulateGrad`` call.
    """
    _refuse_in_functorch_transform("stage_backward_weight")
    weight_list = _weights_list(weights)
    _check_param_groups(param_groups, weight_list)
    with param_groups._consumed_by_w(weight_list, retain_graph) as chunks, automatic_gc_paused():
        # Note [no collection inside B and W] in ppbackward._gc_pause
        for work in chunks:
            run_weight_work(work, retain_graph)
    return tuple([w.grad for w in weight_list])


def _check_param_groups(param_groups: Any, weights: list[torch.Tensor]) -> None:
    """W's checks before it runs anything: ``param_groups`` is B's, unconsumed, for these ``weights``."""
    if not isinstance(param_groups, ParamGroups):
        raise BadType(
            "param_groups: expected the ppbackward.ParamGroups returned by "
            f"ppbackward.stage_backward_input, got {type(param_groups).__name__}"
        )
    if param_groups.consumed:
        raise StageBackwardError(CONSUMED)
    _check_same_weights(weights, param_groups._weights)


def _weights_list(weights: Any) -> list[torch.Tensor]:
    """``weights`` as a list, each a tensor (a parameter), or a clear error before anything runs."""
    if isinstance(weights, torch.Tensor) or not isinstance(weights, Iterable):
        raise BadType(
            "weights: expected an iterable of parameters (e.g. module.parameters()), got "
            f"{type(weights).__name__}"
        )
    out = list(weights)
    if not all(map(isinstance, out, _TENSORS)):  # in C: no frame per weight (Note [no frame per node])
        for i, w in enumerate(out):
            if not isinstance(w, torch.Tensor):
                raise BadType(f"weights[{i}]: expected a torch.Tensor (a parameter), got {type(w).__name__}")
    return out


def _any_dtensor(tensors: list[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (without importing ``torch.distributed.tensor``: if nothing
    imported it, no tensor can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return False
    dtensor = module.DTensor
    return any([issubclass(kind, dtensor) for kind in set(map(type, tensors))])  # the distinct types only


def _check_same_weights(weights: list[torch.Tensor], expected: WeightSet) -> None:
    """Refuse weights that are not the ones B was given (another stage's, or a subset).

    Note [FSDP2 swaps parameters]: FSDP2 registers a module's sharded parameters (DTensors) between its
    forward and backward and its unsharded ones (other objects) while they run, so ``module.parameters()``
    at W time may yield the other form of what B got. Where either side has DTensors, only the number of
    weights is checked. W accumulates through the ``AccumulateGrad`` nodes B found in the graph (the
    unsharded parameters FSDP2's backward reads), whatever form W is given.
    """
    if expected.sharded or _any_dtensor(weights):
        if len(weights) != expected.n_weights:
            raise BadValue(
                f"weights: {len(weights)} parameter(s) given to stage_backward_weight, "
                f"{expected.n_weights} to stage_backward_input"
            )
        return
    ids = list(map(id, weights))
    if len(ids) == expected.n_weights and expected.ids.issuperset(ids) and len(set(ids)) == len(expected.ids):
        return  # the same weights (the common case, checked in C)
    for i, key in enumerate(ids):
        if key not in expected.ids:
            raise BadValue(
                f"weights[{i}]: parameter of shape {tuple(weights[i].shape)} was not among the "
                "weights given to stage_backward_input for these param_groups (another stage's?)"
            )
    missing = len(expected.ids - set(ids))
    if missing:
        raise BadValue(
            f"weights: {missing} parameter(s) given to stage_backward_input are missing from "
            "the weights given to stage_backward_weight"
        )
