"""Every capture path frees what it captured by reference counting, on non-leaf stage inputs too (#39).

A capture path is a place where ppbackward holds a gradient autograd computed, beyond the engine's own
buffers:

* the full backward (``backward.stage_backward``; also what a merged B+W pair runs, a ``FULL_BACKWARD``
  action, Note [merged B and W] in ``ppbackward._merge``): a tensor hook per non-leaf input
  (``_capture_hook``) whose box holds the input's gradient; a leaf input's ``.grad``, parked and restored;
* B (``backward.stage_backward_input``): its engine call's results (``_engine_call``: the input
  gradients, and the weight gradients B computes for W at its frontier); a node pre-hook per deferred C++
  intermediate (``_capture_inputs_hook``); a node post-hook per custom ``autograd.Function`` intermediate
  (``_capture_outputs_hook``); and what it hands to W (``ParamGroups``);
* W (``backward.stage_backward_weight``): the ``_Job`` pre-hook on its anchor's view node
  (``_weight_edges``), which calls the intermediates (``_call_node``) and keeps what they return;
* torch 2.5's adapter B on stage 0 (``_compat.legacy_stage_backward_input``): an ``autograd.grad`` with
  the graph retained, then ppbackward's B on aliases of the outputs.

Each path runs on a stage whose gradient inputs are a non-leaf tensor (made by an upstream op) and a
leaf, and is checked the same way: (1) with the gc disabled, weak references to every gradient each
capture point saw or returned, to each capture hook and to each ``_Job`` are all dead as soon as the call
returns and the caller drops what it got (reference counting alone frees them: Note [no closure cycle]
in ``ppbackward.backward``); (2) under :func:`ppbackward.leaks.check_tensor_leaks` nothing at all is left
in cyclic garbage. Spies (installed per test with ``monkeypatch``) take the weak references and pass
everything on unchanged; each path also asserts that its capture point saw a gradient, so the stage
keeps exercising it.

Negative controls: for each path, a tests-only leaky twin of its capture point that keeps a reference to
itself in its own box (a closure cycle holding the gradients: the bug the rest of the quick suite
missed, found by mutating the code), which both checks must catch.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

from ppbackward import _compat, _weight_edges
from ppbackward import backward as bw
from ppbackward._tools.bench.timing import gc_paused
from ppbackward.leaks import check_tensor_leaks
from tests.core.stages import Scale


class _Stage(nn.Module):
    """``x`` (non-leaf) -> Linear (a C++ intermediate W calls again; its bias gradient is computed in B)
    -> tanh -> ``Scale`` (a custom Function intermediate) -> ``+ y * k`` (``y`` a leaf) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4))
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, k: float) -> torch.Tensor:
        h = Scale.apply(torch.tanh(self.a(x)), self.w)
        return self.b(h + y * k)


def _stage() -> _Stage:
    torch.manual_seed(0)
    module = _Stage()
    for p in module.parameters():
        # a defined .grad: accumulation adds into it, so no gradient a capture point saw becomes a .grad
        p.grad = torch.zeros_like(p)
    return module


def _inputs(seed: int) -> list[Any]:
    """A non-leaf input (made by an upstream op), a leaf input and a non-tensor."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(3, 4, generator=g, requires_grad=True)
    return [base * 2.0, torch.randn(3, 4, generator=g, requires_grad=True), 0.5]


def _grad_of(out: torch.Tensor) -> torch.Tensor:
    """The output's gradient (not ``tests.core.helpers.output_grads``: its recursive walk is a closure
    cycle, garbage this check would count)."""
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(100))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


# -- the spies ------------------------------------------------------------------------------------------

class _Spies:
    """Weak references, by capture point, to every gradient it saw or returned and to every hook or
    ``_Job`` it made; ``seen`` counts the gradients. Holds nothing strongly."""

    def __init__(self) -> None:
        self.refs: dict[str, list[weakref.ref]] = {}
        self.seen: Counter[str] = Counter()

    def saw(self, point: str, value: Any) -> None:
        found = _tensors(value)
        self.seen[point] += len(found)
        self.refs.setdefault(point, []).extend(weakref.ref(t) for t in found)

    def made(self, point: str, obj: Any) -> None:
        self.refs.setdefault(point, []).append(weakref.ref(obj))

    def alive(self) -> dict[str, int]:
        """Capture point -> how many of its referents are still alive (only those with any)."""
        counts = {point: sum(r() is not None for r in refs) for point, refs in self.refs.items()}
        return {point: n for point, n in counts.items() if n}


def _relay(hook: Callable[..., None], spies: _Spies, point: str, first: Any, *rest: Any) -> None:
    """The hook that gets registered: the capture hook itself, then a look at what it stored."""
    hook(first, *rest)
    spies.saw(point, first)


def _spied_factory(factory: Callable[[list], Callable[..., None]], spies: _Spies, point: str) -> Callable:
    def make(box: list) -> Callable[..., None]:
        hook = factory(box)
        spies.made(point, hook)
        return functools.partial(_relay, hook, spies, point)

    return make


def _spied_engine_call(real: Callable[..., Any], spies: _Spies) -> Callable[..., Any]:
    def engine_call(*args: Any) -> Any:
        call = real(*args)
        spies.saw("_engine_call:inputs", list(call.found.values()))
        spies.saw("_engine_call:frontier", [grad for _, grad in call.frontier])
        return call

    return engine_call


def _spied_call_node(real: Callable[..., list], spies: _Spies) -> Callable[..., list]:
    def call_node(node: Any, grads: tuple) -> list:
        out = real(node, grads)
        spies.saw("_call_node", out)
        return out

    return call_node


def _spied_job(real: type, spies: _Spies) -> type:
    class Job(real):  # a subclass of whatever _Job is in place
        __slots__ = () if hasattr(real, "__weakref__") else ("__weakref__",)

        def __init__(self, calls: list) -> None:
            super().__init__(calls)
            spies.made("_Job", self)

        def __call__(self, grad_outputs: tuple) -> None:
            super().__call__(grad_outputs)
            for out in self.results:  # a C++ node's results: the Job calls it inline, not through _call_node
                spies.saw("_call_node", out)

    return Job


def _install_spies(monkeypatch: pytest.MonkeyPatch) -> _Spies:
    """Spies around the capture points now in place (ppbackward's own, or a leaky twin put in first)."""
    spies = _Spies()
    for name in ("_capture_hook", "_capture_inputs_hook", "_capture_outputs_hook"):
        monkeypatch.setattr(bw, name, _spied_factory(getattr(bw, name), spies, name))
    monkeypatch.setattr(bw, "_engine_call", _spied_engine_call(bw._engine_call, spies))
    monkeypatch.setattr(_weight_edges, "_call_node", _spied_call_node(_weight_edges._call_node, spies))
    monkeypatch.setattr(_weight_edges, "_Job", _spied_job(_weight_edges._Job, spies))
    return spies


# -- the runs: everything they make dies when they return, but what the caller keeps (module, .grad) --

def _returned(spies: _Spies, input_grads: Any) -> None:
    spies.saw("returned:non-leaf", input_grads[0])
    spies.saw("returned:leaf", input_grads[1])


def _run_full(module: nn.Module, spies: _Spies) -> None:
    xs = _inputs(0)
    out = module(*xs)
    _returned(spies, bw.stage_backward(out, _grad_of(out), xs))


def _run_split(module: nn.Module, spies: _Spies) -> None:
    xs = _inputs(1)
    out = module(*xs)
    input_grads, groups = bw.stage_backward_input(out, _grad_of(out), xs, module.parameters())
    _returned(spies, input_grads)
    spies.saw("param_groups", [t for group in groups for t in group.kept_gradients()])
    bw.stage_backward_weight(module.parameters(), groups)


def _run_legacy_stage0(module: nn.Module, spies: _Spies) -> None:
    """torch 2.5's adapter on stage 0 (inputs that are not receive buffers: Note [stage 0 on torch 2.5])."""
    xs = _inputs(2)
    out = module(*xs)
    input_grads, groups = _compat.legacy_stage_backward_input((out,), (_grad_of(out),), xs, module.parameters())
    _returned(spies, input_grads)
    _compat.legacy_stage_backward_weight(module.parameters(), groups)


_RUNS: dict[str, Callable[[nn.Module, _Spies], None]] = {
    "full": _run_full,
    "split": _run_split,
    "legacy-stage0": _run_legacy_stage0,
}


def _leftovers(run: str, monkeypatch: pytest.MonkeyPatch) -> tuple[_Spies, dict[str, int], Any]:
    """One run with the gc disabled (what its capture points left alive by reference, once it returned),
    then one under ``check_tensor_leaks`` (what it left in cyclic garbage; its own weak references, which
    the spies keep too, are not looked at). The second run, too, with the automatic gc paused, so that the
    checker's own collection at the end is the only one: a collection between B and W (the runner's code
    runs with the gc on) found a leaky box's cycle while the gradients it holds were still W's, saved the
    cycle without them, and the final collection then saw no tensor in garbage (a CI run's negative
    control failed so)."""
    module = _stage()
    spies = _install_spies(monkeypatch)
    with gc_paused():
        _RUNS[run](module, spies)
        alive = spies.alive()
    with check_tensor_leaks(strict=False) as report, gc_paused():
        _RUNS[run](module, spies)
    return spies, alive, report


# -- the capture paths, each with its tests-only leaky twin --------------------------------------------

def _self_boxing_factory(factory: Callable[[list], Callable[..., None]]) -> Callable[[list], Callable[..., None]]:
    """Tests-only leaky twin of a capture-hook factory: the hook keeps a reference to itself in its own
    box, after what it captured (a closure cycle: box -> hook -> its cell -> hook, holding the gradients)."""

    def make(box: list) -> Callable[..., None]:
        capture = factory(box)

        def hook(*args: Any) -> None:
            capture(*args)
            box.append(hook)

        return hook

    return make


def _self_boxing_job(real: type) -> type:
    """Tests-only leaky twin of W's ``_Job``: it keeps itself among its results (job -> results -> job)."""

    class Job(real):
        def __call__(self, grad_outputs: tuple) -> None:
            super().__call__(grad_outputs)
            self.results.append(self)

    return Job


def _self_boxing_engine_call(real: Callable[..., Any]) -> Callable[..., Any]:
    """Tests-only leaky twin of B's engine call: its dict of input gradients refers to the call's record
    (found -> record -> found, holding the input and frontier gradients)."""

    def engine_call(*args: Any) -> Any:
        call = real(*args)
        call.found[id(call.found)] = call
        return call

    return engine_call


def _self_referring_groups(real: Callable[..., list]) -> Callable[..., list]:
    """Tests-only leaky twin of B's ``_build_groups``: each param group refers to itself (group -> its dict
    -> group, holding the gradients it keeps for W; W's release empties the ``ParamGroups``, not the group)."""

    def build_groups(*args: Any) -> list:
        groups = real(*args)
        for group in groups:
            group._replaced[id(group)] = group
        return groups

    return build_groups


def _self_boxing_result(real: Callable[..., Any]) -> Callable[..., Any]:
    """Tests-only leaky twin of a whole function: it keeps what it returns in a box that holds itself."""

    def fn(*args: Any) -> Any:
        result = real(*args)
        box: list = [result]
        box.append(box)
        return result

    return fn


def _plant(module: Any, name: str, twin: Callable[[Any], Any]) -> Callable[[pytest.MonkeyPatch], None]:
    def put(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(module, name, twin(getattr(module, name)))

    return put


class _Path(NamedTuple):
    run: str  # which of _RUNS goes through it
    point: str  # the spy that must see its gradients
    leaky: Callable[[pytest.MonkeyPatch], None]  # puts its tests-only leaky twin in place


PATHS = {
    # stage_backward; a merged B+W pair is a FULL_BACKWARD and runs it too
    "full-non-leaf-input-hook": _Path("full", "_capture_hook", _plant(bw, "_capture_hook", _self_boxing_factory)),
    "full-leaf-input-grad": _Path("full", "returned:leaf", _plant(bw, "stage_backward", _self_boxing_result)),
    # stage_backward_input
    "b-input-grads": _Path("split", "_engine_call:inputs", _plant(bw, "_engine_call", _self_boxing_engine_call)),
    "b-frontier-weight-grads": _Path(
        "split", "_engine_call:frontier", _plant(bw, "_engine_call", _self_boxing_engine_call)
    ),
    "b-intermediate-prehook": _Path(
        "split", "_capture_inputs_hook", _plant(bw, "_capture_inputs_hook", _self_boxing_factory)
    ),
    "b-custom-function-posthook": _Path(
        "split", "_capture_outputs_hook", _plant(bw, "_capture_outputs_hook", _self_boxing_factory)
    ),
    "b-param-groups": _Path("split", "param_groups", _plant(bw, "_build_groups", _self_referring_groups)),
    # stage_backward_weight
    "w-job": _Path("split", "_call_node", _plant(_weight_edges, "_Job", _self_boxing_job)),
    # torch 2.5's adapter, stage 0
    "legacy-stage0-b": _Path(
        "legacy-stage0", "returned:non-leaf", _plant(_compat, "legacy_stage_backward_input", _self_boxing_result)
    ),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_capture_path_frees_what_it_captured_by_refcount(path, monkeypatch):
    run, point, _ = PATHS[path]
    if point == "_call_node":  # W calls intermediates only where B keeps the graph
        monkeypatch.setattr("ppbackward.backward.take_saved_inputs", lambda *args: None)
    spies, alive, report = _leftovers(run, monkeypatch)
    assert spies.seen[point] > 0, f"the stage no longer exercises {path} ({point} saw no gradient)"
    assert alive == {}
    assert (report.num_tensors, report.num_nodes, report.num_garbage) == (0, 0, 0), report.garbage_types


@pytest.mark.parametrize("path", sorted(PATHS))
def test_negative_control_capture_that_boxes_itself_is_caught(path, monkeypatch):
    run, point, leaky = PATHS[path]
    leaky(monkeypatch)
    if point == "_call_node":  # W calls intermediates only where B keeps the graph
        monkeypatch.setattr("ppbackward.backward.take_saved_inputs", lambda *args: None)
    spies, alive, report = _leftovers(run, monkeypatch)
    assert spies.seen[point] > 0
    assert alive.get(point, 0) > 0, alive
    assert report.num_tensors > 0 and report.num_garbage > 0, report.garbage_types


def test_negative_control_the_full_backwards_self_boxing_hook_leaves_its_gradient_exactly():
    """Issue #39's case, counted: the hook and the one gradient it boxed (the non-leaf input's, the one
    the caller got back) outlive the call with the gc off, and that gradient is the one tensor in cyclic
    garbage."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        PATHS["full-non-leaf-input-hook"].leaky(monkeypatch)
        _, alive, report = _leftovers("full", monkeypatch)
    assert alive == {"_capture_hook": 2, "returned:non-leaf": 1}
    assert (report.num_tensors, report.num_nodes) == (1, 0)
