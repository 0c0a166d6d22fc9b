"""``GradientEdge`` stage outputs (Note [GradientEdge outputs] in ``ppbackward._tree``): torch's pipelining
after 2.14 lets a stage pass ``get_gradient_edge(out)`` and drop the output tensor before backward.
Full backward and B + W, with grads given per edge, against plain autograd."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

import ppbackward as pb
from ppbackward import _node_owner
from tests.core.stages import Scale

# An edge into a custom Function node with no tensor left to hold that node (Note [custom Function nodes need an
# owner]): where torch frees such a node with its last output, reading the edge's node crashes (a segfault on
# torch 2.5.1). torch's own stages hand over edges from 2.15 on, where the node lives.
custom_node_edges = pytest.mark.skipif(
    _node_owner.custom_nodes_need_owner(),
    reason="on this torch a custom Function node dies with its last output: an edge to it points at a freed node",
)


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    mod = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))
    return mod, copy.deepcopy(mod)


def _assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_full_backward_from_an_edge_after_the_output_is_gone():
    mod, ref = _pair()
    x = torch.randn(4, 6, requires_grad=True)
    rx = x.detach().clone().requires_grad_()
    g = torch.randn(4, 6)
    out = mod(x)
    edge, released = get_gradient_edge(out), weakref.ref(out)
    del out
    assert released() is None  # the edge does not keep the activation
    (dx,) = pb.stage_backward((edge,), (g,), [x])
    ref(rx).backward(g)
    torch.testing.assert_close(dx, rx.grad)
    _assert_same_grads(mod, ref)


def test_edges_tensors_and_non_grad_outputs_together():
    torch.manual_seed(1)
    a, b = nn.Linear(6, 6), nn.Linear(6, 6)
    ra, rb = copy.deepcopy(a), copy.deepcopy(b)
    x = torch.randn(4, 6, requires_grad=True)
    rx = x.detach().clone().requires_grad_()
    grads = (torch.randn(4, 6), torch.randn(4, 6), None)
    first, second, constant = a(x), b(x), torch.ones(1)
    edge = get_gradient_edge(first)
    del first
    (dx,) = pb.stage_backward((edge, second, constant), grads, [x])
    torch.autograd.backward((ra(rx), rb(rx)), grads[:2])
    torch.testing.assert_close(dx, rx.grad)
    _assert_same_grads(a, ra)
    _assert_same_grads(b, rb)


@custom_node_edges
def test_an_edge_into_a_custom_function_keeps_its_graph():
    class Triple(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 3

        @staticmethod
        def backward(ctx, g):
            return g * 3

    x = torch.randn(4, 6, requires_grad=True)
    g = torch.randn(4, 6)
    out = Triple.apply(x)
    edge = get_gradient_edge(out)
    del out
    (dx,) = pb.stage_backward((edge,), (g,), [x])
    torch.testing.assert_close(dx, g * 3)


@custom_node_edges
@pytest.mark.parametrize("order", ["BW", "BBWW"])
def test_split_backward_from_edges_equals_plain_autograd(order):
    mod, ref = _pair(2)
    w = nn.Parameter(torch.randn(6))
    rw = nn.Parameter(w.detach().clone())
    pending = []
    for k in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k), requires_grad=True)
        rx = x.detach().clone().requires_grad_()
        g = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + k))
        edge = get_gradient_edge(Scale.apply(mod(x), w))  # a custom Function intermediate too
        (dx,), groups = pb.stage_backward_input([edge], [g], [x], [*mod.parameters(), w])
        torch.autograd.backward(Scale.apply(ref(rx), rw), g)
        torch.testing.assert_close(dx, rx.grad)
        pending.append(groups)
        if order == "BW":
            pb.stage_backward_weight([*mod.parameters(), w], pending.pop())
    for groups in pending:
        pb.stage_backward_weight([*mod.parameters(), w], groups)
    _assert_same_grads(mod, ref)
    torch.testing.assert_close(w.grad, rw.grad)


def test_an_edge_needs_its_gradient_and_one_that_fits():
    mod, _ = _pair()
    x = torch.randn(4, 6, requires_grad=True)
    edge = get_gradient_edge(mod(x))
    message = r"stage_output\[0\]: a GradientEdge output requires output gradients"
    with pytest.raises(pb.StageBackwardError, match=message):
        pb.stage_backward_input([edge], None, [x], mod.parameters())
    message = r"stage_output\[0\]: grad shape \(4, 5\) != GradientEdge input shape \(4, 6\)"
    with pytest.raises(ValueError, match=message):
        pb.stage_backward([edge], [torch.ones(4, 5)], [x])
    message = r"stage_output\[0\]: grad dtype torch.float64 != GradientEdge input dtype torch.float32"
    with pytest.raises(TypeError, match=message):
        pb.stage_backward([edge], [torch.ones(4, 6, dtype=torch.float64)], [x])
    assert all(p.grad is None for p in mod.parameters())  # nothing ran


def test_a_malformed_edge_is_refused_naming_the_output():
    from torch.autograd.graph import GradientEdge

    mod, _ = _pair()
    x = torch.randn(3, 6, requires_grad=True)
    out = mod(x)
    with pytest.raises(ValueError, match=r"stage_output\[0\]: GradientEdge node is NoneType, not an autograd node"):
        pb.stage_backward((GradientEdge(None, 0),), (torch.ones(3, 6),), [x])
    message = r"stage_output\[0\]: GradientEdge output_nr 5 is out of range for AddmmBackward0"
    with pytest.raises(ValueError, match=message):
        pb.stage_backward_input((GradientEdge(out.grad_fn, 5),), (torch.ones(3, 6),), [x], mod.parameters())
    assert out.requires_grad and all(p.grad is None for p in mod.parameters())
