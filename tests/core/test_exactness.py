"""Split B/W and full stage_backward give exactly plain autograd's grads on every zoo graph shape."""

from __future__ import annotations

import copy

import pytest
import torch

import ppbackward as pb
from tests.core.helpers import (
    assert_grads_equal,
    assert_param_grads,
    clone_inputs,
    output_grads,
    reference,
)
from tests.core.stages import ZOO, build

N_MICROBATCHES = 2


def _inputs(make_inputs):
    return [make_inputs(10 * k) for k in range(N_MICROBATCHES)]


@pytest.mark.parametrize("name", sorted(ZOO))
def test_full_backward_matches_plain_autograd(name):
    module, make_inputs = build(name)
    inputs = _inputs(make_inputs)
    ref_in, ref_params = reference(module, inputs)
    stage = copy.deepcopy(module)
    for k, mb in enumerate(inputs):
        xs = clone_inputs(mb)
        out = stage(*xs)
        grads_in = pb.stage_backward(out, output_grads(out, 100 + k), xs)
        assert len(grads_in) == len(xs)
        for i, (g, e) in enumerate(zip(grads_in, ref_in[k])):
            assert_grads_equal(g, e, f"{name} mb{k} input[{i}]")
        # Inputs' .grad is left as it was (None), unlike plain backward.
        assert all(x.grad is None for x in xs if isinstance(x, torch.Tensor))
    assert_param_grads(stage, ref_params, name)


@pytest.mark.parametrize("order", ["BWBW", "BBWW", "BBWW-reversed"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_split_matches_plain_autograd(name, order):
    module, make_inputs = build(name)
    inputs = _inputs(make_inputs)
    ref_in, ref_params = reference(module, inputs)
    stage = copy.deepcopy(module)
    pending = []
    for k, mb in enumerate(inputs):
        xs = clone_inputs(mb)
        out = stage(*xs)
        before = [None if p.grad is None else p.grad.clone() for p in stage.parameters()]
        grads_in, groups = pb.stage_backward_input(
            out, output_grads(out, 100 + k), xs, stage.parameters()
        )
        for i, (g, e) in enumerate(zip(grads_in, ref_in[k])):
            assert_grads_equal(g, e, f"{name} mb{k} input[{i}]")
        for b, p in zip(before, stage.parameters()):
            assert (p.grad is None) if b is None else torch.equal(p.grad, b), "B touched a grad"
        pending.append((out, groups))
        if order == "BWBW":
            pb.stage_backward_weight(stage.parameters(), pending.pop()[1])
    if order == "BBWW-reversed":
        pending.reverse()
    for _, groups in pending:
        returned = pb.stage_backward_weight(stage.parameters(), groups)
        assert all(r is p.grad for r, p in zip(returned, stage.parameters()))
    assert_param_grads(stage, ref_params, f"{name} {order}")


def test_full_and_split_agree_with_loss_on_last_stage():
    module, make_inputs = build("mlp")
    (x,) = make_inputs(0)
    full, split = copy.deepcopy(module), copy.deepcopy(module)
    xf, xs = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    loss_f = full(xf).pow(2).sum()
    (gf,) = pb.stage_backward((loss_f,), None, [xf])
    loss_s = split(xs).pow(2).sum()
    (gs,), groups = pb.stage_backward_input((loss_s,), None, [xs], split.parameters())
    assert not loss_s.requires_grad, "B detaches the loss (output side freed)"
    pb.stage_backward_weight(split.parameters(), groups)
    assert_grads_equal(gs, gf, "input")
    for pf, ps in zip(full.parameters(), split.parameters()):
        assert_grads_equal(ps.grad, pf.grad, "param")


def test_non_leaf_input_grad_is_returned():
    module, _ = build("mlp")
    base = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    x = base * 2.0  # non-leaf stage input
    out = module(x)
    g = torch.ones_like(out)
    (gx,) = pb.stage_backward(out, g, [x])
    ref = copy.deepcopy(module)
    xr = (base.detach() * 2.0).requires_grad_()
    ref(xr).backward(g)
    assert_grads_equal(gx, xr.grad, "non-leaf input")


def test_output_that_is_a_parameter():
    lin = torch.nn.Linear(3, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    outs = (lin(x), lin.bias)  # a leaf output: must never be detached
    grads = (torch.ones(2, 3, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64))
    _, groups = pb.stage_backward_input(outs, grads, [x], lin.parameters())
    assert lin.bias.requires_grad
    pb.stage_backward_weight(lin.parameters(), groups)
    torch.testing.assert_close(lin.bias.grad, torch.full((3,), 4.0, dtype=torch.float64))
