"""Saved-tensor hooks under the B/W split (Note [hooked saved tensors run once] in ``ppbackward._saved``).

Four hook styles users run (``save_on_cpu``; a pack returning the tensor itself; a pack keeping a copy;
an offload-to-disk pack returning a file name): B + W give a full backward's grads, call the unpack
hook exactly as often as a full backward, hold between B and W only what W reads, and leave no
autograd node and no packed tensor alive once W is done and the caller drops its outputs (tracked by
``ppbackward.leaks`` through weak references: Note [leaks the gc cannot see]). torch's own split, on
the same stage with a pack returning the tensor, keeps nodes and packed tensors for ever: the negative
control of that check.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import _backward as upstream

import ppbackward as pb
from ppbackward._compat import torch_release
from ppbackward._saved import HOOKS_VISIBLE
from ppbackward.leaks import check_tensor_leaks, track_activations
from tests.core.helpers import ATOL, RTOL

pytestmark = pytest.mark.skipif(not HOOKS_VISIBLE, reason="this torch does not expose saved-tensor hooks to Python")


class Hooks:
    """A pack/unpack pair of one style, counting unpacks and watching what pack returned."""

    def __init__(self, style: str, folder) -> None:
        self.style, self.folder = style, folder
        self.unpacks = 0
        self.packed: list[weakref.ref] = []  # tensors the pack hook returned
        self.files = 0

    def pack(self, t: torch.Tensor):
        if self.style == "identity":
            packed = t
        elif self.style == "copy":
            packed = t.detach().clone()
        else:  # disk: torch.save to a file, return its name
            self.files += 1
            path = os.path.join(self.folder, f"{self.files}.pt")
            torch.save(t.detach(), path)
            return path
        self.packed.append(weakref.ref(packed))
        return packed

    def unpack(self, packed):
        self.unpacks += 1
        return torch.load(packed) if self.style == "disk" else packed

    def context(self):
        if self.style == "save_on_cpu":
            return _CountingSaveOnCpu(self)
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def alive(self) -> int:
        return sum(r() is not None for r in self.packed)


class _CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's ``save_on_cpu`` with its unpack counted and its packed tensors watched."""

    def __init__(self, hooks: Hooks) -> None:
        super().__init__()
        pack, unpack = self.pack_hook, self.unpack_hook

        def counting_pack(t):
            packed = pack(t)
            hooks.packed.append(weakref.ref(packed[1]))
            return packed

        def counting_unpack(packed):
            hooks.unpacks += 1
            return unpack(packed)

        self.pack_hook, self.unpack_hook = counting_pack, counting_unpack


STYLES = ["save_on_cpu", "identity", "copy", "disk"]


def _stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.GELU()).double()


def _batch(k: int):
    g = torch.Generator().manual_seed(k)
    return torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True), torch.randn(
        4, 8, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("as_loss", [False, True], ids=["output", "loss"])
@pytest.mark.parametrize("style", STYLES)
def test_split_equals_full_backward_and_unpacks_as_often(style, as_loss, tmp_path):
    """Also with a loss (a last stage): B then pins the saved inputs of every node W would run (Note
    [outputs detached after B]) and must not unpack a hooked one to find out whether it needs to."""
    full, split = _stage(), _stage()
    full_hooks, split_hooks = Hooks(style, tmp_path), Hooks(style, tmp_path)

    def forward(stage, x, g):
        out = stage(x)
        return ((out * g).sum(),) if as_loss else (out,)

    for k in range(2):  # two microbatches: B, B, W, W
        x, g = _batch(k)
        with full_hooks.context():
            outs = forward(full, x, g)
        torch.autograd.backward(outs, None if as_loss else (g,))
    pending, dxs = [], []
    for k in range(2):
        x, g = _batch(k)
        with split_hooks.context():
            outs = forward(split, x, g)
        (dx,), groups = pb.stage_backward_input(outs, None if as_loss else (g,), [x], split.parameters())
        pending.append(groups)
        dxs.append(dx)
    for groups in pending:
        pb.stage_backward_weight(split.parameters(), groups)
    for p, q in zip(split.parameters(), full.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    assert split_hooks.unpacks == full_hooks.unpacks > 0  # never more than a full backward


@pytest.mark.parametrize("style", ["save_on_cpu", "identity", "copy"])
def test_between_b_and_w_only_what_w_reads_is_held(style, tmp_path):
    stage, hooks = _stage(), Hooks(style, tmp_path)
    x, g = _batch(0)
    with hooks.context():
        out = stage(x)
    _, groups = pb.stage_backward_input((out,), (g,), [x], stage.parameters())
    del out, x  # what the caller keeps is not ours to count
    held = hooks.alive()
    before = hooks.unpacks
    pb.stage_backward_weight(stage.parameters(), groups)
    assert held == hooks.unpacks - before  # held between B and W == what W unpacked
    del groups
    assert hooks.alive() == 0


@pytest.mark.parametrize("style", STYLES)
def test_nothing_outlives_w_not_even_through_a_cycle_the_gc_cannot_see(style, tmp_path):
    stage, hooks = _stage(), Hooks(style, tmp_path)
    gc.collect()
    gc.disable()
    try:
        with check_tensor_leaks() as garbage:
            for k in range(3):
                x, g = _batch(k)
                with hooks.context(), track_activations() as tracker:
                    out = stage(x)
                _, groups = pb.stage_backward_input((out,), (g,), [x], stage.parameters())
                pb.stage_backward_weight(stage.parameters(), groups)
                del out, groups, x
                rep = tracker.report(collect=False)
                assert rep.nodes > 0 and rep.nodes_held_after_gc == [], rep.format()
                assert rep.packed_held_after_gc == [], rep.format()
    finally:
        gc.enable()
    assert garbage.ok
    assert hooks.alive() == 0


@pytest.mark.skipif(not (2, 13) <= torch_release()[:2] <= (2, 15), reason="torch's side pinned for 2.13-2.15")
def test_negative_control_torch_split_keeps_nodes_and_packed_tensors_for_ever(tmp_path):
    stage, hooks = _stage(), Hooks("identity", tmp_path)
    with contextlib.ExitStack() as stack:
        stack.enter_context(hooks.context())
        tracker = stack.enter_context(track_activations())
        x, g = _batch(0)
        out = stage(x)
    _, groups = upstream.stage_backward_input((out,), (g,), [x], stage.parameters())
    upstream.stage_backward_weight(stage.parameters(), groups)
    del out, groups, x
    rep = tracker.report()  # after a gc run
    assert "TanhBackward0" in rep.nodes_held_after_gc  # the node that saved its own output
    assert rep.packed_held_after_gc and hooks.alive() > 0
    assert hooks.unpacks > 5  # and it unpacked more than a full backward's 5


@pytest.mark.parametrize("around", ["checkpoint", "save_on_cpu"])
def test_a_parameter_s_tensor_hook_runs_once_where_b_does_w_s_work(around):
    """Note [frontier captures skip leaf hooks]: ``x @ w`` sends w's gradient straight into its
    ``AccumulateGrad``; B, doing the hooked region's weight work, captures it there. The hook (which
    halves the gradient) must run once, in W, as in a full backward, never in B."""

    def run(split: bool):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
        calls = []
        def halve(g: torch.Tensor) -> torch.Tensor:
            calls.append("hook")
            return g * 0.5

        w.register_hook(halve)
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        if around == "checkpoint":
            out = torch.utils.checkpoint.checkpoint(lambda a: torch.tanh(a @ w), x, use_reentrant=False)
        else:
            with torch.autograd.graph.save_on_cpu():
                out = torch.tanh(x @ w)
        g = torch.ones(3, 4, dtype=torch.float64)
        if not split:
            out.backward(g)
            return w.grad, calls, None
        _, groups = pb.stage_backward_input((out,), (g,), [x], [w])
        in_b = list(calls)
        pb.stage_backward_weight([w], groups)
        return w.grad, calls, in_b

    ref, ref_calls, _ = run(split=False)
    got, calls, in_b = run(split=True)
    assert in_b == [] and calls == ref_calls == ["hook"]
    assert torch.equal(got, ref)


class _OneShot:
    """Offloading-style hooks: each packed tensor can be handed back once (a second unpack fails)."""

    def __init__(self) -> None:
        self.store: dict[int, torch.Tensor] = {}
        self.packs = 0

    def pack(self, t: torch.Tensor) -> int:
        self.packs += 1
        self.store[self.packs] = t.detach().clone()
        return self.packs

    def unpack(self, key: int) -> torch.Tensor:
        return self.store.pop(key)


@pytest.mark.parametrize("split", [False, True], ids=["full", "split"])
def test_an_in_place_op_on_a_view_unpacks_its_hidden_saved_tensors_once(split):
    """``h[0].mul_(w)`` is a ``CopySlices`` node whose saved tensors Python cannot see; W must not call
    it again (it would unpack a one-shot hook's tensor a second time: KeyError)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, dtype=torch.float64))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    hooks = _OneShot()
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        out = x * 1.0
        out[0].mul_(w)  # the only saved tensors are CopySlices's (w and the view's old value)
    g = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    ref_w = g[0] * x[0].detach()
    if split:
        _, groups = pb.stage_backward_input((out,), (g,), [x], [w])
        pb.stage_backward_weight([w], groups)
    else:
        pb.stage_backward((out,), (g,), [x])
    assert hooks.store == {}  # every packed tensor unpacked exactly once
    torch.testing.assert_close(w.grad, ref_w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("as_loss", [False, True], ids=["output", "loss"])
def test_hooks_on_a_weight_only_branch_unpack_once(as_loss, tmp_path):
    """Hooks around a weight-only branch alone (``cos(w)``): W runs that node, B does not. Given a loss,
    B pins the saved inputs of every node W will run (Note [outputs detached after B]); it must tell
    them apart without unpacking (it unpacked ``cos``'s input once in B, once more in W)."""
    results = []
    for split in (False, True):
        torch.manual_seed(0)
        lin, w = nn.Linear(4, 4).double(), nn.Parameter(torch.randn(4, dtype=torch.float64))
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        hooks = Hooks("identity", tmp_path)
        with hooks.context():
            c = torch.cos(w)
        out = lin(x) * c
        outs, grads = ((out.square().sum(),), None) if as_loss else ((out,), (torch.ones_like(out),))
        params = [w, *lin.parameters()]
        if split:
            _, groups = pb.stage_backward_input(outs, grads, [x], params)
            assert hooks.unpacks == 0  # B never runs the branch, nor unpacks it
            pb.stage_backward_weight(params, groups)
        else:
            torch.autograd.backward(outs, grads)
        results.append((hooks.unpacks, [p.grad for p in params]))
    (full_unpacks, full_grads), (split_unpacks, split_grads) = results
    assert split_unpacks == full_unpacks == 1
    for a, b in zip(split_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
