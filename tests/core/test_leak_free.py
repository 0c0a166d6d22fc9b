"""Leak-free by construction: no call creates a reference cycle of any kind, ParamGroups hold nothing
after W, and with the gc disabled every saved activation dies by reference counting on time.

Each check has a negative control: a tests-only leaky variant that the same check must catch."""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn

import ppbackward as pb
from ppbackward._saved import observing_only
from ppbackward.leaks._gc_phase import full_collect
from tests.core.helpers import clone_inputs, output_grads
from tests.core.stages import ZOO, build, make_mul_function


def _garbage_of(fn, *args):
    """Objects that ``fn(*args)`` left in cyclic garbage (gc.DEBUG_SAVEALL), any type."""
    # until one finds nothing: cycles freed by C++ may make more collectable only on the next one (torch
    # 2.5.1's own W, raising in an earlier test, leaves such a chain); not gc.collect(): Note [a collection
    # that surely ran]
    while full_collect():
        pass
    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        result = fn(*args)
        full_collect()
        found = list(gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(flags)
    return result, found


@contextmanager
def _saved_activations():
    """Weak references to every non-leaf tensor autograd saves inside the block."""
    refs: list[weakref.ref] = []

    def pack(t):
        if t.requires_grad and t.grad_fn is None:  # a parameter or input leaf, not an activation
            return t
        # Note [detached pack]: the graph must hold a detached alias. Packing ``t`` itself when it is
        # the saving node's own output ties tensor -> grad_fn -> saved tensor -> tensor in C++, a
        # cycle no gc can see (it is only broken when a backward without retain_graph runs).
        alias = t.detach()
        refs.append(weakref.ref(alias))
        return alias

    @observing_only  # the split treats the tensors as unhooked
    def unpack(t):
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield refs


def _leaky_stage_backward_input(outputs, grads, inputs, weights):
    """Tests-only leaky variant, pytorch/pytorch#136507's kind: a nested function that refers to
    itself through its closure and to the outputs."""
    kept = []

    def walk(o):
        kept.append(o)
        if isinstance(o, (tuple, list)):
            for v in o:
                walk(v)

    walk(outputs)
    kept.append(outputs[0].view_as(outputs[0]))  # a new tensor object, reachable only from the cycle
    return pb.stage_backward_input(outputs, grads, inputs, weights)


_STASH: list[list] = []


def _stashing_stage_backward_weight(weights, groups):
    """Tests-only leaky variant: a live module-level reference to the graph (no cycle at all)."""
    _STASH.append([call.node for g in groups for call in g.calls])
    return pb.stage_backward_weight(weights, groups)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_no_call_creates_cyclic_garbage(name):
    module, make_inputs = build(name)
    xs = clone_inputs(make_inputs(0))
    out = module(*xs)
    _, garbage = _garbage_of(pb.stage_backward, out, output_grads(out), xs)
    assert garbage == []
    xs = clone_inputs(make_inputs(1))
    out = module(*xs)
    (_, groups), garbage = _garbage_of(
        pb.stage_backward_input, out, output_grads(out), xs, module.parameters()
    )
    assert garbage == []
    _, garbage = _garbage_of(pb.stage_backward_weight, module.parameters(), groups)
    assert garbage == []
    assert groups.consumed and len(groups) == 0 and groups._groups == []


def test_negative_control_recursive_closure_is_caught():
    module, make_inputs = build("mlp")
    xs = clone_inputs(make_inputs(0))
    out = module(*xs)
    (_, groups), garbage = _garbage_of(
        _leaky_stage_backward_input, (out,), (output_grads(out),), xs, module.parameters()
    )
    kinds = sorted({type(o).__name__ for o in garbage})
    assert "function" in kinds and "cell" in kinds and "Tensor" in kinds, kinds
    pb.stage_backward_weight(module.parameters(), groups)


def _run_split(module, make_inputs, w_fn):
    """One microbatch B then W; returns weak refs to the activations the forward saved."""
    xs = clone_inputs(make_inputs(0))
    with _saved_activations() as refs:
        out = module(*xs)
    assert refs, "the forward must save activations"
    _, groups = pb.stage_backward_input(out, output_grads(out), xs, module.parameters())
    w_fn(module.parameters(), groups)
    del out, groups, xs
    return refs


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("mode", ["split", "full"])
def test_activations_freed_by_refcount_when_last_backward_returns(name, mode):
    module, make_inputs = build(name)
    gc.collect()
    gc.disable()
    try:
        if mode == "split":
            refs = _run_split(module, make_inputs, pb.stage_backward_weight)
        else:
            xs = clone_inputs(make_inputs(0))
            with _saved_activations() as refs:
                out = module(*xs)
            pb.stage_backward(out, output_grads(out), xs)
            del out, xs
        alive = [r() for r in refs if r() is not None]
        assert alive == [], [tuple(t.shape) for t in alive]
    finally:
        gc.enable()


def test_negative_control_live_reference_is_caught(graph_kept):
    module, make_inputs = build("mlp")
    gc.disable()
    try:
        refs = _run_split(module, make_inputs, _stashing_stage_backward_weight)
        assert sum(r() is not None for r in refs) > 0
    finally:
        _STASH.clear()
        gc.enable()


@pytest.mark.parametrize("retain_graph", [False, True], ids=["w", "negative-control-retain_graph"])
def test_w_frees_what_its_intermediates_saved_while_the_caller_still_holds_a_view_output(retain_graph, monkeypatch):
    """B cannot detach a view output, so the output keeps the graph; torch 2.5's stage holds every
    stage's outputs until the next step. W must not leave the activation its intermediate (``lin2``'s
    addmm) saved to that output's lifetime; with ``retain_graph=True`` it stays (the check can fail), on the
    path where B keeps the graph (W calls the addmm again; without it, B took the activation out and W drops it)."""
    if retain_graph:
        monkeypatch.setattr("ppbackward.backward.take_saved_inputs", lambda *args: None)
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
    weights = [*lin1.parameters(), *lin2.parameters()]
    x = torch.randn(4, 8, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        act = torch.relu(lin1(x))
        saved = weakref.ref(act)
        out = lin2(act).view(32)  # the stage's output is a view
        del act
        _, groups = pb.stage_backward_input(out, torch.ones(32), [x], weights)
        assert saved() is not None  # W's intermediate reads it
        pb.stage_backward_weight(weights, groups, retain_graph=retain_graph)
        del groups
        assert out.grad_fn is not None  # the caller still holds the (attached) output
        assert (saved() is not None) is retain_graph
    finally:
        gc.enable()


def _norm_weight_hooked_during_b():
    torch.manual_seed(0)
    norm, lin = nn.LayerNorm(8), nn.Linear(8, 8)
    weights = [*norm.parameters(), *lin.parameters()]
    x = torch.randn(4, 8, requires_grad=True)
    h = norm(x)
    h.register_hook(lambda _g: norm.weight.register_hook(lambda g: g * 0.5) and None)
    return norm, weights, x, lin(h)


def test_hooks_registered_during_b_leave_no_cyclic_garbage_and_param_groups_hold_nothing_after_w():
    """Note [hooks registered during B]: B lists the hook ids registered on a captured weight during its engine
    call and W mutes them; neither creates a cycle, and W's release drops the list with the rest."""
    _, weights, x, out = _norm_weight_hooked_during_b()  # once first: lazy imports of the hook path are garbage
    pb.stage_backward_weight(weights, pb.stage_backward_input([out], [torch.ones(4, 8)], [x], weights)[1])
    norm, weights, x, out = _norm_weight_hooked_during_b()
    (_, groups), garbage = _garbage_of(pb.stage_backward_input, [out], [torch.ones(4, 8)], [x], weights)
    assert garbage == []
    assert [(leaf is norm.weight, len(keys)) for leaf, keys in groups._hooked_in_b] == [(True, 1)]
    _, garbage = _garbage_of(pb.stage_backward_weight, weights, groups)
    assert garbage == []
    assert groups.consumed and groups._hooked_in_b == [] and len(norm.weight._backward_hooks) == 1


def _function_class_lifetime() -> weakref.ref:
    """A custom Function defined in a function (as a recompile or a closure makes one) through B and W; a
    weak reference to its backward class, which nothing of ppbackward may keep (its per-type caches keep C++
    node types only: a compiled region's class holds its compiled graph)."""

    w = nn.Parameter(torch.randn(3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    out = make_mul_function().apply(x, w)
    node_type = type(out.grad_fn)
    _, groups = pb.stage_backward_input([out], [torch.ones(2, 3, dtype=torch.float64)], [x], [w])
    pb.stage_backward_weight([w], groups)
    return weakref.ref(node_type)


def test_a_custom_function_class_dies_after_b_and_w():
    node_type = _function_class_lifetime()
    # a class is in a cycle with its methods: the collector frees it (full_collect, not gc.collect(): Note [a
    # collection that surely ran] in ppbackward.leaks._gc_phase)
    full_collect()
    assert node_type() is None


def test_negative_control_a_kept_function_class_is_caught(monkeypatch):
    """The bug back: B's per-type cache of saved-tensor attribute names made to take a custom Function's class
    as a C++ node type (the check that keeps such classes out of it blinded) keeps the class alive."""

    class NoFunctionIsPython:  # what ``isinstance(node, BackwardCFunction)`` is checked against
        pass

    monkeypatch.setattr("ppbackward._saved.BackwardCFunction", NoFunctionIsPython)
    kept = _function_class_lifetime()
    full_collect()
    assert kept() is not None  # the check above would fail
    import ppbackward._saved

    ppbackward._saved._ATTRS.pop(kept(), None)  # let it go after the test
