"""``track_activations``: what it records, that it keeps nothing alive, how it classifies lifetimes,
and how it composes with the user's own saved-tensor hooks.

Single-process, CPU, tiny tensors. Stage and sizes come from leaky_variants.py (64-byte outputs,
128-byte hidden activations, 512-byte weights).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from ppbackward._compat import torch_release
from ppbackward.leaks import (
    ActivationReport,
    ActivationTracker,
    SavedActivation,
    check_tensor_leaks,
    track_activations,
)
from ppbackward.leaks._saved_hooks import top_hooks
from tests.leaks.gc_threads import another_thread_collecting
from tests.leaks.leaky_variants import HIDDEN_BYTES, OUT_BYTES, make_input, make_stage
from tests.leaks.odd_tensors import UnreadableGradFn

WEIGHT_BYTES = 16 * 8 * 4
# Note [tracker composes with saved-tensor hooks] reads the hooks in force, which torch 2.5 does not expose
composes = pytest.mark.skipif(
    top_hooks is None,
    reason="this torch has no torch._C._autograd._top_saved_tensors_default_hooks: the tracker cannot compose",
)


def _rows(activations: list[SavedActivation]) -> list[tuple]:
    return [(a.node_name, a.shape, a.nbytes, a.state, a.is_leaf) for a in activations]


def _reference_grads(stage: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(stage(x).sum(), [x, *stage.parameters()]))


def _grads(stage: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out.sum(), [x, *stage.parameters()]))


def test_clean_step_records_activations_and_all_die_by_refcount():
    stage, x = make_stage(), make_input()
    with check_tensor_leaks() as leaks:  # the tracker's own bookkeeping makes no cyclic garbage
        with track_activations() as tracker:
            out = stage(x)
        before = tracker.report(collect=False)
        out.sum().backward()
        del out
        after = tracker.report()
    assert leaks.ok and leaks.num_garbage == 0
    assert isinstance(tracker, ActivationTracker) and isinstance(after, ActivationReport)
    assert _rows(before.saved) == [
        ("TanhBackward0", (2, 16), HIDDEN_BYTES, "alive", False),  # Tanh saves its result ...
        ("AddmmBackward0", (2, 16), HIDDEN_BYTES, "alive", False),  # ... which the 2nd Linear saves too
    ]
    assert before.bytes_alive == HIDDEN_BYTES  # one storage, counted once
    assert before.collected is False and len(before.held_after_gc) == 2
    assert after.collected is True
    assert [a.state for a in after.saved] == ["freed_by_refcount", "freed_by_refcount"]
    assert after.alive == [] and after.freed_only_by_gc == [] and after.held_after_gc == []
    assert (after.bytes_alive, after.bytes_freed_only_by_gc, after.bytes_held_after_gc) == (0, 0, 0)


def test_a_saved_output_is_not_kept_alive_by_the_tracker():
    # An identity pack hook would make output -> grad_fn -> saved output a C++ cycle gc cannot break.
    a = torch.ones(5, requires_grad=True)
    with track_activations() as tracker:
        y = a.exp()  # ExpBackward0 saves its output
    assert _rows(tracker.report().saved) == [("ExpBackward0", (5,), 20, "alive", False)]
    del y
    rep = tracker.report()
    assert _rows(rep.saved) == [("ExpBackward0", (5,), 20, "freed_by_refcount", False)]


@pytest.mark.parametrize(
    ("include_parameters", "include_leaves", "expected"),
    [
        (False, False, [("TanhBackward0", (2, 16)), ("AddmmBackward0", (2, 16))]),
        (
            True,
            False,
            [
                ("AddmmBackward0", (8, 16)),
                ("TanhBackward0", (2, 16)),
                ("AddmmBackward0", (2, 16)),
                ("AddmmBackward0", (16, 8)),
            ],
        ),
        (False, True, [("AddmmBackward0", (2, 8)), ("TanhBackward0", (2, 16)), ("AddmmBackward0", (2, 16))]),
    ],
)
def test_parameters_and_outside_leaves_are_excluded_by_default(include_parameters, include_leaves, expected):
    stage, x = make_stage(), make_input()  # x: a leaf that requires grad, like a stage input
    with track_activations(include_parameters=include_parameters, include_leaves=include_leaves) as tracker:
        out = stage(x)
    rep = tracker.report(collect=False)
    assert [(a.node_name, a.shape) for a in rep.saved] == expected
    params = [a for a in rep.saved if a.shape in ((16, 8), (8, 16))]  # weight.t() views: whole weight
    assert [a.nbytes for a in params] == [WEIGHT_BYTES] * len(params) and all(a.is_leaf for a in params)
    del out


def test_non_differentiable_outputs_made_in_the_block_are_recorded():
    h = torch.randn(2, 16, requires_grad=True) * 1  # a non-leaf activation made outside the block
    outside_mask = torch.ones(2, 16, dtype=torch.bool)
    with track_activations() as tracker:
        inside_mask = h > 0  # a leaf made by an op in the block
        y = torch.where(inside_mask, h, 0.0) + torch.where(outside_mask, h, 0.0).exp()
        torch.manual_seed(0)
        z = torch.nn.functional.dropout(y, 0.5, training=True)  # its mask is made inside the op
    rows = [(a.node_name, a.dtype, a.is_leaf) for a in tracker.report(collect=False).saved]
    assert rows == [
        ("WhereBackward0", torch.bool, True),  # inside_mask; outside_mask is not recorded
        ("ExpBackward0", torch.float32, False),
        ("MulBackward0", torch.float32, True),  # dropout's mask (dropout = mask * input / (1 - p))
    ]
    del z


def test_inplace_modification_of_a_saved_tensor_still_raises():
    a = torch.randn(3, requires_grad=True)
    with track_activations():
        h = a * 2
        y = h.sin()
    h.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_reference_cycle_is_freed_only_by_gc():
    def leave_cycle() -> None:
        y = torch.ones(5, requires_grad=True).exp()
        box: dict = {"y": y}
        box["self"] = box

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the two reports
    try:
        with track_activations() as tracker:
            leave_cycle()
        unverified = tracker.report(collect=False)
        verified = tracker.report()
    finally:
        if was_enabled:
            gc.enable()
    assert _rows(unverified.held_after_gc) == [("ExpBackward0", (5,), 20, "alive", False)]
    assert unverified.freed_only_by_gc == [] and unverified.bytes_alive == 20
    assert _rows(verified.freed_only_by_gc) == [("ExpBackward0", (5,), 20, "freed_by_gc", False)]
    assert verified.alive == verified.freed_only_by_gc and verified.held_after_gc == []
    assert (verified.bytes_alive, verified.bytes_freed_only_by_gc, verified.bytes_held_after_gc) == (20, 20, 0)


@pytest.mark.parametrize("name", ["include_parameters", "include_leaves"])
def test_a_flag_that_is_not_a_bool_is_refused(name):
    """``"no"`` is truthy: it recorded what the caller meant to leave out (hostile tester)."""
    with pytest.raises(TypeError, match=f"track_activations: {name} must be a bool, got str 'no'"):
        track_activations(**{name: "no"})


class _LazyProxy:
    """A lazy-object proxy, as libraries write them: ``__class__`` forwards to a target not bound yet, and raises."""

    def __init__(self) -> None:
        object.__setattr__(self, "_target", None)

    @property  # type: ignore[misc]
    def __class__(self):
        raise RuntimeError("proxy target not bound yet")


def test_a_holder_whose_class_raises_is_named_and_the_report_does_not_fail():
    """The holder search reads each object's type, never its ``__class__``: a proxy whose ``__class__`` raises held
    the activation, and ``report()`` raised the proxy's error (hostile tester)."""
    holder = _LazyProxy()
    with track_activations() as tracker:
        holder.out = torch.ones(3, requires_grad=True).exp()
    report = tracker.report()
    assert _rows(report.held_after_gc) == [("ExpBackward0", (3,), 12, "alive", False)]
    assert any("_LazyProxy" in chain for chain in report.held_by), report.held_by
    del holder


def test_a_free_by_refcount_while_another_thread_collects_is_by_refcount():
    """Note [freed by gc vs refcount]: the collector's phase is per thread. The tracker used to read any
    thread's collection as its own and count this tensor, freed by ``del``, as freed only by gc."""
    with track_activations() as tracker:
        y = torch.ones(5, requires_grad=True).exp()
    with another_thread_collecting():
        del y  # freed by reference counting here, while the helper thread is inside a collection
    report = tracker.report()
    assert _rows(report.saved) == [("ExpBackward0", (5,), 20, "freed_by_refcount", False)]
    assert report.freed_only_by_gc == [] and report.held_after_gc == []


def test_custom_function_nodes_are_named():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * t

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            return 2 * t * g

    a = torch.randn(4, requires_grad=True)
    with track_activations() as tracker:
        out = Square.apply(a * 1).sum()
    assert [a.node_name for a in tracker.report(collect=False).saved] == ["SquareBackward"]
    del out


def _user_hooks(calls: list[int]) -> torch.autograd.graph.saved_tensors_hooks:
    """An offloading-like user pair: saves a copy, so the original storage can be freed at once."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.detach().clone()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


@composes
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_composes_with_user_saved_tensor_hooks(where):
    stage, x = make_stage(), make_input()
    expected = _reference_grads(stage, x)
    calls: list[int] = []
    if where == "outside":
        with _user_hooks(calls), track_activations() as tracker:
            out = stage(x)
    else:
        with track_activations() as tracker, _user_hooks(calls):
            out = stage(x)
    assert len(calls) == 5  # the user's pack still sees every saved tensor (x, 2 weights, 2 activations)
    rep = tracker.report()
    # the tracker records what autograd asked to save; the user's copy replaced it, so it died at once
    assert _rows(rep.saved) == [
        ("TanhBackward0", (2, 16), HIDDEN_BYTES, "freed_by_refcount", False),
        ("AddmmBackward0", (2, 16), HIDDEN_BYTES, "freed_by_refcount", False),
    ]
    for got, want in zip(_grads(stage, x, out), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@composes
def test_composes_with_activation_checkpointing():
    stage, x = make_stage(), make_input()
    expected = _reference_grads(stage, x)
    with track_activations() as tracker:
        out = checkpoint(stage, x, use_reentrant=False)
    rep = tracker.report()
    assert [(a.node_name, a.state) for a in rep.saved] == [
        ("TanhBackward0", "freed_by_refcount"),  # checkpointing drops them right after the forward
        ("AddmmBackward0", "freed_by_refcount"),
    ]
    for got, want in zip(_grads(stage, x, out), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@composes
def test_nested_trackers_record_each_tensor_once_each():
    stage, x = make_stage(), make_input()
    with track_activations() as outer:
        with torch.autograd.graph.save_on_cpu(), track_activations() as inner:
            first = stage(x)
        second = stage(x)
    assert (outer.num_recorded, inner.num_recorded) == (4, 2)
    del first, second


def test_refuses_where_saved_tensor_hooks_are_disabled_and_nested_reentry():
    with torch.autograd.graph.disable_saved_tensors_hooks("not here"):
        with pytest.raises(RuntimeError, match="saved-tensor hooks are disabled here"):
            with track_activations():
                pass
    tracker = track_activations()
    with tracker, pytest.raises(RuntimeError, match="already active"):
        tracker.__enter__()


def test_reentry_accumulates_and_clear_forgets():
    stage, x = make_stage(), make_input()
    tracker = track_activations()
    for _ in range(2):  # e.g. two schedule steps
        with tracker:
            out = stage(x)
        out.sum().backward()
    assert tracker.num_recorded == 4
    assert [a.index for a in tracker.report().saved] == [0, 1, 2, 3]
    tracker.clear()
    assert tracker.num_recorded == 0 and tracker.report().saved == []


def test_format_and_to_dict():
    stage = make_stage()
    kept = []
    with track_activations() as tracker:
        kept.append(torch.tanh(stage[0](make_input())))
    rep = tracker.report()
    text = rep.format()
    assert "1 saved activation(s) recorded" in text
    assert f"still alive after gc (held by a live reference, or a cycle inside C++): 1, {HIDDEN_BYTES} bytes" in text
    assert f"#0 TanhBackward0 saved float32[2, 16] on cpu, {HIDDEN_BYTES} bytes" in text
    data = json.loads(json.dumps(rep.to_dict()))
    assert data["held_after_gc"] == [0] and data["bytes_held_after_gc"] == HIDDEN_BYTES
    assert data["saved"] == [
        {
            "index": 0,
            "node_name": "TanhBackward0",
            "shape": [2, 16],
            "dtype": "torch.float32",
            "device": "cpu",
            "nbytes": HIDDEN_BYTES,
            "state": "alive",
            "is_leaf": False,
        }
    ]
    assert OUT_BYTES == 64  # sizes used across these tests


# -- leaks the gc cannot see (Note [leaks the gc cannot see] in ppbackward/leaks/_node_watches.py) -----------


def _identity_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


@composes
@pytest.mark.parametrize("retain_graph", [True, False], ids=["negative-control-retained", "released"])
def test_a_node_holding_itself_through_a_pack_hook_is_caught_where_the_gc_sees_nothing(retain_graph):
    """``tanh`` saves its own output; a pack hook returning that tensor closes node -> tensor -> node in
    C++. Only a backward without retain_graph releases the node: with it retained, the node, its graph and
    the packed tensor live for ever, and gc.garbage stays empty."""
    from ppbackward.leaks import check_tensor_leaks

    with check_tensor_leaks(strict=False) as garbage:
        with _identity_hooks(), track_activations() as tracker:
            x = torch.randn(4, requires_grad=True)
            y = torch.tanh(x * 2)
        torch.autograd.grad(y.sum(), x, retain_graph=retain_graph)
        del y
    assert garbage.ok and garbage.num_garbage == 0  # the gc sees no cycle either way
    rep = tracker.report()
    assert rep.nodes == 2 and rep.packed == 1 and rep.nodes_freed_only_by_gc == 0
    if retain_graph:
        assert rep.nodes_held_after_gc == ["MulBackward0", "TanhBackward0"]
        assert rep.packed_held_after_gc == ["float32[4]"] and rep.bytes_packed_held_after_gc == 16
        text = rep.format()
        nodes = "autograd nodes created in the block: 2; freed only by the cycle collector: 0; still alive after gc: 2"
        assert nodes in text
        assert "tensors returned by saved-tensor pack hooks: 1" in text
    else:
        assert rep.nodes_held_after_gc == [] and rep.packed_held_after_gc == []
    json.dumps(rep.to_dict())


def test_nodes_freed_by_a_python_cycle_are_told_apart():
    with track_activations() as tracker:
        x = torch.randn(4, requires_grad=True)
        y = x * 3
        box: dict = {"y": y}
        box["self"] = box
        del y, box
    rep = tracker.report()  # its collection frees the cycle, and the node with it
    assert rep.nodes == 1 and rep.nodes_freed_only_by_gc == 1 and rep.nodes_held_after_gc == []


class _Loop:
    """A training loop that keeps a step's outputs on ``self`` (Lightning's ``self.outputs``)."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def step(self, w: torch.Tensor, x: torch.Tensor, keep: bool) -> None:
        loss = (x * w).pow(2).sum()
        self.outputs = [loss] if keep else []


def test_print_of_a_report_is_readable_and_names_what_holds_a_kept_output():
    """Issue 23: ``print(report)`` was a 2,000-character dataclass repr, and nothing said who holds the
    tensor a step's kept output keeps alive (Note [holder chains])."""
    w, x = torch.randn(4, requires_grad=True), torch.randn(4)
    loop = _Loop()
    with track_activations() as tracker:
        loop.step(w, x, keep=True)
    report = tracker.report()
    assert str(report) == report.format()
    assert len(report.held_after_gc) == 1 and report.held_after_gc[0].node_name == "PowBackward0"
    (chain,) = report.held_by
    lines = chain.splitlines()
    assert lines[0] == "[0] Tensor float32[] on cpu, 4 bytes, grad_fn=SumBackward0"
    assert lines[1] == "  <- [1] list (len 1) via [0]"
    assert lines[2] == f"  <- [2] {__name__}._Loop object via .outputs"
    assert "what holds the block's live outputs" in str(report) and "_Loop object via .outputs" in str(report)
    assert report.to_dict()["held_by"] == [chain]
    # negative control: the same step, its outputs not kept: nothing held, no chain
    with track_activations() as tracker:
        loop.step(w, x, keep=False)
    report = tracker.report()
    assert report.held_after_gc == [] and report.held_by == []
    assert "what holds" not in str(report)


def test_the_holder_search_passes_over_a_tensor_whose_grad_fn_cannot_be_read():
    w, x = torch.randn(4, requires_grad=True), torch.randn(4)
    loop = _Loop()
    with track_activations() as tracker:
        loop.step(w, x, keep=True)
    unreadable = torch.zeros(2).as_subclass(UnreadableGradFn)
    with pytest.raises(RuntimeError, match="undefined tensor"):
        unreadable.grad_fn  # noqa: B018  # what the search meets in the heap
    (chain,) = tracker.report().held_by
    assert "_Loop object via .outputs" in chain
    del unreadable


def test_storages_of_a_dtensor_are_its_local_tensors_not_its_mesh() -> None:
    """DTensor's ``__tensor_flatten__`` lists ``device_mesh`` next to ``_local_tensor`` (torch 2.13): the
    tracker opens only the inner tensors (it raised AttributeError on the mesh before issue 20's fix)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from ppbackward.leaks._storage import tensor_storages

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        local = torch.randn(4)
        dt = DTensor.from_local(local, init_device_mesh("cpu", (1,)), [Replicate()])
        keys = [s.data_ptr() for s in tensor_storages(dt)]
        assert keys == [local.untyped_storage().data_ptr()]
    finally:
        if owned:
            dist.destroy_process_group()


def _compiled_regions(out: torch.Tensor) -> int:
    seen, stack, found = set(), [out.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += type(node).__name__ == "CompiledFunctionBackward"
        stack.extend(f for f, _ in node.next_functions)
    return found


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="no torch.compile")
@pytest.mark.skipif(
    torch_release()[:2] == (2, 5),
    reason="torch 2.5's torch.compile (aot_eager) keeps the region's saved tensors alive after its backward",
)
def test_a_compiled_block_compiles_under_the_tracker_as_one_region_whose_saved_tensors_are_recorded():
    """Note [tracker steps aside in compiled regions]: dynamo traced the tracker's torch-function mode into
    the region and broke the graph at every op, so under the tracker a compiled block ran eagerly, op by op
    (0 compiled regions; ``ppbackward check``'s compiled scenarios measured no compiled region)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        compiled = torch.compile(block, backend="aot_eager")
        x = torch.randn(2, 8, requires_grad=True)
        with track_activations() as tracker:
            out = compiled(x)
        assert _compiled_regions(out) == 1  # one compiled node, as without the tracker
        recorded = tracker.report(collect=False)
        assert recorded.saved and all(a.state == "alive" for a in recorded.saved)  # what the region saved
        got = _grads(block, x, out)
        del out
        for a, b in zip(got, _reference_grads(block, x)):
            torch.testing.assert_close(a, b)
        assert [a.state for a in tracker.report().saved] == ["freed_by_refcount"] * len(recorded.saved)
    finally:
        torch._dynamo.reset()
