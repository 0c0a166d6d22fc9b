"""The adapters' own behaviour, on any installed torch (they only wrap ppbackward's functions):
what each returns, that the torch 2.5 B keeps stage 0's graph whole for the full backward at W
time, the custom-Function node owners ppbackward's B keeps (``ppbackward._node_owner``), exact grads against plain
autograd, and no reference cycle."""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ppbackward as pb
from ppbackward import _compat, _node_owner
from tests.core.stages import Double, KeepsInputOnCtx, Scale


class Stage(nn.Module):
    """Linear -> scale by w (a custom Function when ``custom``) -> tanh -> Linear.

    Custom Function nodes that B's ParamGroups reaches only through an edge (Note [custom Function
    nodes need an owner]): with ``weight_only`` an extra output is a custom Function of a weight
    alone (an output edge, as ``get_gradient_edge`` gives it); with ``custom`` the scale's weight
    goes through a custom Function first, and the stage ends in another custom scale whose weight
    does too (an entry of a custom node's ``next_functions`` that only the detached output owned).
    With ``pair`` an extra output is the scaled activation summed."""

    def __init__(self, custom: bool = False, pair: bool = False, weight_only: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.rand(4) + 0.5)
        self.v = nn.Parameter(torch.randn(4))
        self.u = nn.Parameter(torch.rand(4) + 0.5)
        self.custom, self.pair, self.weight_only = custom, pair, weight_only

    def forward(self, x, y=None):
        h = self.a(x if y is None else x + y)
        h = Scale.apply(h, Double.apply(self.w)) if self.custom else h * self.w
        act = torch.tanh(h)
        self.activation = weakref.ref(act)  # saved by tanh's node and by ``b`` (W reads it)
        top = self.b(act)
        outs = (Scale.apply(top, Double.apply(self.u)) if self.custom else top,)
        if self.pair:
            outs += (h.sum(1),)
        if self.weight_only:
            outs += (Double.apply(self.v),)
        return outs if len(outs) > 1 else outs[0]


def _reference(stage, inputs, grads):
    """Parameter and input grads of one plain autograd backward on deep copies."""
    ref = copy.deepcopy(stage)
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    outs = ref(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(list(outs), list(grads))
    return [p.grad for p in ref.parameters()], [t.grad for t in leaves]


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _setup(custom=False, pair=False, received=True, n_inputs=1, weight_only=False):
    torch.manual_seed(0)
    stage = Stage(custom, pair, weight_only)
    inputs = [torch.randn(3, 4) for _ in range(n_inputs)]
    if received:  # what a non-first stage gets: leaf receive buffers that require grad
        inputs = [t.requires_grad_() for t in inputs]
    outs = stage(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = tuple(torch.randn_like(o) for o in outs)
    return stage, inputs, outs, grads


# --- torch 2.5 adapter: result containers ---------------------------------------------------------


def test_legacy_full_backward_returns_a_list_even_for_two_inputs():
    # 2.5's stage.py would unpack a 2-tuple as B's (grads, param_groups).
    stage, inputs, outs, grads = _setup(n_inputs=2)
    want_params, want_inputs = _reference(stage, inputs, grads)
    got = _compat.legacy_stage_backward(outs, grads, inputs)
    assert type(got) is list and len(got) == 2
    _close(got, want_inputs)
    _close([p.grad for p in stage.parameters()], want_params)


def test_legacy_weight_returns_a_list_of_grads_after_accumulation():
    stage, inputs, outs, grads = _setup()
    want_params, want_inputs = _reference(stage, inputs, grads)
    got_inputs, groups = _compat.legacy_stage_backward_input(
        outs, grads, inputs, stage.parameters()
    )
    assert type(got_inputs) is tuple and isinstance(groups, pb.ParamGroups)
    _close(list(got_inputs), want_inputs)
    got = _compat.legacy_stage_backward_weight(stage.parameters(), groups)  # called with 2 args
    assert type(got) is list
    _close(got, want_params)
    assert all(g is p.grad for g, p in zip(got, stage.parameters()))


# --- torch 2.5 adapter: Note [stage 0 on torch 2.5] ---------------------------------------------


@pytest.mark.parametrize("user_input_requires_grad", [False, True])
def test_legacy_b_on_stage_0_keeps_the_graph_for_the_full_backward_at_w_time(
    user_input_requires_grad,
):
    torch.manual_seed(0)
    stage = Stage(custom=True)
    user = torch.randn(6, 4, requires_grad=user_input_requires_grad)
    chunk = user.tensor_split(2)[0]  # what 2.5's schedule hands stage 0
    out = stage(chunk)
    grad = torch.randn_like(out)
    ref_stage = copy.deepcopy(stage)
    ref_user = user.detach().clone().requires_grad_(user_input_requires_grad)
    ref_out = ref_stage(ref_user.tensor_split(2)[0])
    ref_out.backward(grad)

    got_inputs, groups = _compat.legacy_stage_backward_input(
        (out,), (grad,), [chunk], stage.parameters()
    )
    assert out.grad_fn is not None, "stage 0's outputs must stay attached for the full backward"
    assert all(p.grad is None for p in stage.parameters())
    if user_input_requires_grad:
        want = torch.autograd.grad(ref_stage(ref_user.tensor_split(2)[0]), ref_user, grad)[0][:3]
        torch.testing.assert_close(got_inputs[0], want)
    else:
        assert got_inputs == (None,)
    # What 2.5's backward_weight_one_chunk does on stage 0: a full backward of the same outputs.
    _compat.legacy_stage_backward((out,), (grad,), [chunk])
    _close([p.grad for p in stage.parameters()], [p.grad for p in ref_stage.parameters()])
    if user_input_requires_grad:
        torch.testing.assert_close(user.grad, ref_user.grad)
    del groups


def test_legacy_b_on_stage_0_also_hands_w_a_complete_param_groups():
    torch.manual_seed(0)
    stage = Stage()
    x = torch.randn(3, 4)
    out = stage(x)
    grad = torch.randn_like(out)
    want_params, _ = _reference(stage, [x], [grad])
    _, groups = _compat.legacy_stage_backward_input((out,), (grad,), [x], stage.parameters())
    got = _compat.legacy_stage_backward_weight(stage.parameters(), groups)
    _close(got, want_params)


def test_legacy_full_backward_refuses_outputs_a_split_b_detached():
    stage, inputs, outs, grads = _setup()
    _compat.legacy_stage_backward_input(outs, grads, inputs, stage.parameters())
    assert outs[0].grad_fn is None
    with pytest.raises(RuntimeError, match="already detached"):
        _compat.legacy_stage_backward(outs, grads, inputs)
    assert all(p.grad is None for p in stage.parameters())


def test_legacy_detached_registry_holds_no_tensor():
    stage, inputs, outs, grads = _setup()
    _compat.legacy_stage_backward_input(outs, grads, inputs, stage.parameters())
    ref = weakref.ref(outs[0])
    assert any(t is outs[0] for t in _compat._DETACHED_BY_B.values())
    del outs
    assert ref() is None


# --- Note [custom Function nodes need an owner] -------------------------------------------------


@pytest.fixture
def owners_needed(monkeypatch):
    """Make B take owners whatever the torch (2.13+ needs none): the mechanism runs on every release."""
    monkeypatch.setattr(_node_owner, "custom_nodes_need_owner", lambda: True)


@pytest.mark.parametrize("custom", [False, True])
def test_b_keeps_custom_nodes_alive_until_w_then_drops_them(custom, owners_needed):
    stage, inputs, outs, grads = _setup(custom=custom, weight_only=True)
    want_params, want_inputs = _reference(stage, inputs, grads)
    got_inputs, groups = pb.stage_backward_input(outs, grads, inputs, stage.parameters())
    assert groups._owners
    del outs  # the caller may drop its outputs: the owners keep the custom nodes alive
    _close(list(got_inputs), want_inputs)
    got = pb.stage_backward_weight(stage.parameters(), groups)
    _close(list(got), want_params)
    assert groups.consumed and groups._owners == () and len(groups) == 0


def test_b_keeps_a_listed_custom_intermediate_alive_for_a_write_into_its_grads(owners_needed):
    """The custom node is only listed (``group["intermediates"]``), W has nothing of it to run: B still keeps
    it, since a write makes W call it and the write is checked against its input metadata (a freed node: a
    segfault on torch 2.5.1)."""
    w = nn.Parameter(torch.randn(4, dtype=torch.float64))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64)
    outs = [KeepsInputOnCtx.apply(x, w)]
    _, groups = pb.stage_backward_input(outs, [torch.ones(3, 4, dtype=torch.float64)], [x], [w])
    assert groups._owners
    del outs  # the caller may drop its outputs: the owners keep the custom node alive
    (group,) = groups
    (node,) = group["intermediates"]
    assert isinstance(node, torch.autograd.function.BackwardCFunction)
    group["grads"] = [(g,)]
    pb.stage_backward_weight([w], groups)
    assert torch.equal(w.grad, (g * x.detach()).sum(0)) and groups._owners == ()


def test_b_takes_no_owner_when_no_custom_node_is_referenced(owners_needed):
    stage, inputs, outs, grads = _setup(custom=False, pair=True)
    _, groups = pb.stage_backward_input(outs, grads, inputs, stage.parameters())
    assert len(groups) and groups._owners == ()


def test_b_takes_no_owner_where_torch_keeps_custom_nodes_alive():
    stage, inputs, outs, grads = _setup(custom=True, weight_only=True)
    _, groups = pb.stage_backward_input(outs, grads, inputs, stage.parameters())
    assert bool(groups._owners) is _node_owner.custom_nodes_need_owner()
    pb.stage_backward_weight(stage.parameters(), groups)


_DIRECT = """
import sys, torch
sys.path[:0] = [{root!r}]
import ppbackward as pb
from ppbackward import _node_owner
from tests.compat.test_compat_adapters import _setup
if {unowned!r}:
    _node_owner.custom_nodes_need_owner = lambda: False
stage, inputs, outs, grads = _setup(custom=True, weight_only=True)
_, groups = pb.stage_backward_input(outs, grads, inputs, stage.parameters())
del outs
pb.stage_backward_weight(stage.parameters(), groups)
print("W ran")
"""


def _direct_b_then_w(unowned: bool) -> subprocess.CompletedProcess:
    """Direct calls (no ``install()``), the outputs dropped between B and W, in a child process
    (without owners torch may crash outright)."""
    root = Path(__file__).resolve().parents[2]  # the repository: ``tests`` is a package in it
    code = _DIRECT.format(root=str(root), unowned=unowned)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)


def test_direct_b_and_w_survive_the_caller_dropping_its_outputs():
    child = _direct_b_then_w(unowned=False)
    assert child.returncode == 0 and "W ran" in child.stdout, child.stderr[-2000:]


def test_without_an_owner_w_fails_where_torch_holds_custom_nodes_weakly():
    """Negative control: why B keeps owners."""
    if not _node_owner.custom_nodes_need_owner():
        pytest.skip("this torch keeps custom Function nodes alive from Python")
    child = _direct_b_then_w(unowned=True)
    assert child.returncode != 0 and "W ran" not in child.stdout, child.stderr[-2000:]
    # the failure is W's (a RuntimeError from a dead node, or a crash by signal), not the set-up's
    crashed = child.returncode < 0
    assert crashed or "stage_backward_weight" in child.stderr, child.stderr[-2000:]
    assert crashed or "RuntimeError" in child.stderr.strip().splitlines()[-1], child.stderr[-2000:]


# --- leak freedom of every adapter path ----------------------------------------------------------


def _paths():
    def legacy_split():
        stage, inputs, outs, grads = _setup(custom=True, pair=True, n_inputs=2, weight_only=True)
        _, groups = _compat.legacy_stage_backward_input(outs, grads, inputs, stage.parameters())
        _compat.legacy_stage_backward_weight(stage.parameters(), groups)

    def legacy_stage_0():
        stage, inputs, outs, grads = _setup(custom=True, pair=True, received=False)
        _, _groups = _compat.legacy_stage_backward_input(outs, grads, inputs, stage.parameters())
        _compat.legacy_stage_backward(outs, grads, inputs)

    def legacy_full():
        _stage, inputs, outs, grads = _setup(custom=True, pair=True, n_inputs=2)
        _compat.legacy_stage_backward(outs, grads, inputs)

    def direct_split():
        stage, inputs, outs, grads = _setup(custom=True, pair=True, weight_only=True)
        _, groups = pb.stage_backward_input(outs, grads, inputs, stage.parameters())
        del outs
        pb.stage_backward_weight(stage.parameters(), groups)

    return {f.__name__: f for f in (legacy_split, legacy_stage_0, legacy_full, direct_split)}


@pytest.mark.parametrize("path", sorted(_paths()))
def test_no_reference_cycle_on_any_adapter_path(path, cyclic_garbage):
    run = _paths()[path]
    run()  # warm-up (lazy imports, caches)
    found = cyclic_garbage(run)
    assert found.total == 0, found


@pytest.mark.parametrize("path", ["legacy_split", "direct_split"])
def test_activations_freed_by_refcount_when_w_returns(path, owners_needed):
    stage, inputs, outs, grads = _setup(custom=True, weight_only=True)
    saved = stage.activation
    b = _compat.legacy_stage_backward_input if path == "legacy_split" else pb.stage_backward_input
    gc.disable()
    try:
        _, groups = b(outs, grads, inputs, stage.parameters())
        pb.stage_backward_weight(stage.parameters(), groups)
        del outs, groups, grads
        assert saved() is None
    finally:
        gc.enable()


def test_b_owns_a_sparse_output_and_w_is_exact(owners_needed):
    """A layout without views (sparse): the owner is a clone's node; B runs, W matches autograd."""
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    w_ref, x_ref = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    grad = torch.randn(3, 4).to_sparse()
    torch.autograd.backward(Scale.apply(x_ref, Double.apply(w_ref)).to_sparse(), grad)
    out = Scale.apply(x, Double.apply(w)).to_sparse()
    (gx,), groups = pb.stage_backward_input(out, grad, [x], [w])
    assert groups._owners
    del out
    pb.stage_backward_weight([w], groups)
    assert torch.equal(gx, x_ref.grad) and torch.equal(w.grad, w_ref.grad)
