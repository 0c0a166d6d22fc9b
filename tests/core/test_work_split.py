"""B does the input-gradient work, W only the deferred weight-gradient work: together they run
exactly the matrix multiplies of one plain backward (W re-runs nothing of the input side)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import ppbackward as pb


def _count_matmuls(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in {"aten::mm", "aten::addmm", "aten::bmm"})


def test_b_plus_w_matmuls_equal_plain_backward():
    torch.manual_seed(0)
    layers = 5
    module = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(layers)])
    ref = copy.deepcopy(module)
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)

    out = ref(x.detach().clone().requires_grad_())
    plain = _count_matmuls(lambda: out.backward(g))

    xs = x.detach().clone().requires_grad_()
    out = module(xs)
    state = {}
    b = _count_matmuls(lambda: state.update(groups=pb.stage_backward_input((out,), (g,), [xs], module.parameters())[1]))
    w = _count_matmuls(lambda: pb.stage_backward_weight(module.parameters(), state["groups"]))
    assert plain == 2 * layers
    assert b == layers, "B: one input-gradient matmul per linear layer"
    assert w == layers, "W: one weight-gradient matmul per linear layer, nothing re-run"
    for p, q in zip(module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
