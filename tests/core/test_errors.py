"""Bad input gets a clear error naming the path, and leaves nothing behind."""

from __future__ import annotations

import copy
import gc
import types
import weakref

import pytest
import torch
import torch.nn as nn

import ppbackward as pb
from ppbackward._saved import HOOKS_VISIBLE
from ppbackward.leaks._heap import instances_of
from tests.core.helpers import clone_inputs, output_grads
from tests.core.stages import build


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 5)

    def forward(self, x):
        return (self.a(x), {"h": self.b(x), "n": 3})


def _fresh():
    torch.manual_seed(0)
    m = TwoHeads()
    x = torch.randn(3, 4, requires_grad=True)
    out = m(x)
    good = (torch.ones(3, 4), {"h": torch.ones(3, 5), "n": None})
    return m, x, out, good


BAD_GRADS = {
    "shape": (
        lambda: (torch.ones(3, 4), {"h": torch.ones(3, 4), "n": None}),
        ValueError,
        "stage_output[1]['h']: grad shape (3, 4) != output shape (3, 5)",
    ),
    "dtype": (
        lambda: (torch.ones(3, 4, dtype=torch.float64), {"h": torch.ones(3, 5), "n": None}),
        TypeError,
        "stage_output[0]: grad dtype torch.float64 != output dtype torch.float32",
    ),
    "device": (
        lambda: (torch.ones(3, 4), {"h": torch.ones(3, 5, device="meta"), "n": None}),
        ValueError,
        "stage_output[1]['h']: grad device meta != output device cpu",
    ),
    "none_for_non_scalar": (
        lambda: (None, {"h": torch.ones(3, 5), "n": None}),
        ValueError,
        "stage_output[0]: its gradient is None but the output has shape (3, 4)",
    ),
    "length": (
        lambda: (torch.ones(3, 4),),
        ValueError,
        "stage_output: output has 2 elements but its gradient has 1",
    ),
    "keys": (
        lambda: (torch.ones(3, 4), {"h": torch.ones(3, 5)}),
        ValueError,
        "stage_output[1]: gradient keys differ from output keys (missing: 'n'; unexpected: -)",
    ),
    "container_type": (
        lambda: (torch.ones(3, 4), torch.ones(3, 5)),
        TypeError,
        "stage_output[1]: output is a dict but its gradient is a Tensor",
    ),
    "not_a_tensor": (
        lambda: (torch.ones(3, 4), {"h": [1.0], "n": None}),
        TypeError,
        "stage_output[1]['h']: gradient must be a torch.Tensor or None, got list",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_GRADS))
@pytest.mark.parametrize("fn", ["full", "input"])
def test_bad_grads_raise_naming_the_path_and_leave_nothing(kind, fn):
    make_bad, exc, message = BAD_GRADS[kind]
    m, x, out, good = _fresh()
    with pytest.raises(exc) as info:
        if fn == "full":
            pb.stage_backward(out, make_bad(), [x])
        else:
            pb.stage_backward_input(out, make_bad(), [x], m.parameters())
    assert str(info.value).startswith(message), str(info.value)
    assert x.grad is None and all(p.grad is None for p in m.parameters())
    assert out[0].requires_grad and out[1]["h"].requires_grad, "outputs untouched"
    # The same outputs still work afterwards: nothing half-done was left on the graph.
    ref = copy.deepcopy(m)
    xr = x.detach().clone().requires_grad_()
    ro = ref(xr)
    torch.autograd.backward([ro[0], ro[1]["h"]], [good[0], good[1]["h"]])
    if fn == "full":
        (gx,) = pb.stage_backward(out, good, [x])
    else:
        (gx,), groups = pb.stage_backward_input(out, good, [x], m.parameters())
        pb.stage_backward_weight(m.parameters(), groups)
    torch.testing.assert_close(gx, xr.grad)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _b(name="mlp"):
    m, make_inputs = build(name)
    xs = clone_inputs(make_inputs(0))
    out = m(*xs)
    _, groups = pb.stage_backward_input(out, output_grads(out), xs, m.parameters())
    return m, out, groups


def test_w_twice_raises():
    m, _, groups = _b()
    pb.stage_backward_weight(m.parameters(), groups)
    assert groups.consumed and len(groups) == 0
    with pytest.raises(RuntimeError, match="already consumed by an earlier stage_backward_weight"):
        pb.stage_backward_weight(m.parameters(), groups)


def test_w_with_another_stages_weights_raises_before_anything_runs():
    m, _, groups = _b()
    other = nn.Linear(6, 6).double()
    with pytest.raises(ValueError, match=r"weights\[0\]: parameter of shape \(6, 6\) was not among"):
        pb.stage_backward_weight(other.parameters(), groups)
    with pytest.raises(ValueError, match=r"weights: 2 parameter\(s\) given to stage_backward_input"):
        pb.stage_backward_weight(list(m.parameters())[:-2], groups)
    assert all(p.grad is None for p in m.parameters()) and other.weight.grad is None
    assert not groups.consumed
    pb.stage_backward_weight(m.parameters(), groups)  # still usable with the right weights
    assert all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (None, "weights: expected an iterable of parameters (e.g. module.parameters()), got NoneType"),
        ("w", "weights[0]: expected a torch.Tensor (a parameter), got str"),
        (lambda m: [m.layers[0].weight, 3], "weights[1]: expected a torch.Tensor (a parameter), got int"),
        (
            lambda m: m.layers[0].weight,
            "weights: expected an iterable of parameters (e.g. module.parameters()), got Parameter",
        ),
    ],
    ids=["None", "str", "an-int-among-them", "one-tensor"],
)
def test_weights_that_are_not_tensors_are_refused_before_anything_runs(weights, message):
    m, _out, groups = _b()
    bad = weights(m) if callable(weights) else weights
    with pytest.raises(TypeError) as info:
        pb.stage_backward_weight(bad, groups)
    assert str(info.value) == message and isinstance(info.value, pb.StageBackwardError)
    assert not groups.consumed and all(p.grad is None for p in m.parameters())
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError) as info:
        pb.stage_backward_input(m(x), torch.ones(4, 6, dtype=torch.float64), [x], bad)
    assert str(info.value) == message
    assert x.grad is None and all(p.grad is None for p in m.parameters())


def test_a_stage_input_among_the_weights_is_refused_before_anything_runs():
    """Hostile review (2026-12-03): an input also passed as a weight got its gradient from B and none from W,
    silently (B stops at a stage input)."""
    m = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4))
    x = torch.randn(3, 6, requires_grad=True)
    out = m(x)
    with pytest.raises(ValueError) as info:
        pb.stage_backward_input(out, torch.ones(3, 4), [3, x], [*m.parameters(), x])
    assert str(info.value).startswith("input_values[1]: the same tensor as weights[4]; B returns")
    assert isinstance(info.value, pb.StageBackwardError)
    assert x.grad is None and all(p.grad is None for p in m.parameters())
    grads, groups = pb.stage_backward_input(out, torch.ones(3, 4), [3, x], m.parameters())  # nothing was run
    pb.stage_backward_weight(m.parameters(), groups)
    assert grads[1] is not None and all(p.grad is not None for p in m.parameters())


def test_w_rejects_upstream_param_groups():
    m, _, _ = _b()
    with pytest.raises(TypeError, match=r"param_groups: expected the ppbackward\.ParamGroups"):
        pb.stage_backward_weight(m.parameters(), [{"params": set(), "intermediates": []}])


def test_exception_in_accumulating_call_releases_everything():
    m, out, groups = _b("shared_late")
    nodes = [call.node for group in groups for call in group.calls]
    grad_refs = [
        weakref.ref(g) for group in groups for call in group.calls for g in call.grads if g is not None
    ]
    assert nodes and grad_refs

    def boom(_p):
        raise RuntimeError("user hook failed")

    handle = m.shared.register_post_accumulate_grad_hook(boom)
    with pytest.raises(RuntimeError, match="user hook failed"):
        pb.stage_backward_weight(m.parameters(), groups)
    handle.remove()
    assert groups.consumed and len(groups) == 0
    gc.disable()
    try:
        # The intermediates are still alive (``nodes``), yet nothing holds the captured grads.
        assert out is not None and nodes
        assert [r() for r in grad_refs] == [None] * len(grad_refs)
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "kept",
    [pytest.param(False, marks=pytest.mark.skipif(not HOOKS_VISIBLE, reason="torch < 2.13: B keeps the graph")), True],
    ids=["taken-input", "graph-kept"],
)
def test_exception_while_computing_weight_edges_touches_no_grad(kept, monkeypatch):
    """An activation an intermediate saved was modified in place after B: W refuses before any parameter of any
    group is accumulated: its check of the input B took out (Note [weight matmuls from their saved input]),
    or, where B kept the graph, W's first engine call (the weight edges) with torch's own error."""
    if kept:
        monkeypatch.setattr("ppbackward.backward.take_saved_inputs", lambda *args: None)
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    h = torch.tanh(a(x))  # saved by b's AddmmBackward (an intermediate)
    out = b(h)
    params = [*a.parameters(), *b.parameters()]
    _, groups = pb.stage_backward_input(out, torch.ones(3, 4), [x], params)
    assert len(groups) == 2, "a's group and b's group: a failure must touch neither"
    with torch.no_grad():
        h.mul_(2)
    expected = "modified by an inplace operation" if kept else "AddmmBackward0 saved for its weight gradient"
    with pytest.raises(RuntimeError, match=expected):
        pb.stage_backward_weight(params, groups)
    assert all(p.grad is None for p in params)
    assert groups.consumed


def _live_capture_hooks():
    return [  # a heap scan safe beside the suite's background thread (Note [heap scans beside other threads])
        f for f in instances_of(types.FunctionType) if f.__qualname__ == "_capture_hook.<locals>.hook"
    ]


def test_exception_inside_b_leaves_no_hook_and_no_grad():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    h = m[0](x)
    h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("activation hook failed")))
    out = m[2](m[1](h))
    assert _live_capture_hooks() == []
    with pytest.raises(RuntimeError, match="activation hook failed"):
        pb.stage_backward_input(out, torch.ones(2, 4), [x], m.parameters())
    assert _live_capture_hooks() == [], "B's capture pre-hooks must be removed on failure"
    assert x.grad is None and all(p.grad is None for p in m.parameters())
    assert out.requires_grad, "a failed B detaches nothing"


def test_negative_control_a_leftover_hook_is_seen():
    """The check above can fail: a capture hook that stays registered is found alive."""
    from ppbackward.backward import _capture_hook

    torch.manual_seed(0)
    out = nn.Linear(4, 4)(torch.randn(2, 4, requires_grad=True))
    handle = out.grad_fn.register_prehook(_capture_hook([]))
    assert len(_live_capture_hooks()) == 1
    handle.remove()
