"""Graph shapes and misuse found by adversarial testing: custom Functions run once, accumulation
order is a full backward's, misuse raises instead of silently doing nothing."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import ppbackward as pb
from tests.core.stages import Scale


class _FusedLinear(torch.autograd.Function):
    """A Megatron-style fused linear: its backward has a side effect on ``w.main_grad``."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        _FusedLinear.calls += 1
        x, w = ctx.saved_tensors
        w.main_grad += g.t() @ x
        g.mul_(0.5)  # in place on the incoming gradient: must not leak into a second run
        return g @ w * 2.0, None


def test_custom_function_intermediate_runs_once_and_is_exact():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    v = nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4)
    results = {}
    for mode in ("plain", "split"):
        _FusedLinear.calls = 0
        w.main_grad = torch.zeros(4, 4)
        w.grad = v.grad = None
        xi = x.clone().requires_grad_()
        out = Scale.apply(_FusedLinear.apply(xi, w), v)
        g = torch.ones(3, 4)
        if mode == "plain":
            out.backward(g)
            gx = xi.grad
        else:
            (gx,), groups = pb.stage_backward_input(out, g, [xi], [w, v])
            assert _FusedLinear.calls == 1 and v.grad is None
            pb.stage_backward_weight([w, v], groups)
        results[mode] = (gx, w.main_grad.clone(), v.grad, _FusedLinear.calls)
    (gx_p, mg_p, v_p, calls_p), (gx_s, mg_s, v_s, calls_s) = results["plain"], results["split"]
    assert calls_p == calls_s == 1, "a custom Function's backward runs once (in B)"
    assert torch.equal(gx_s, gx_p) and torch.equal(mg_s, mg_p) and torch.equal(v_s, v_p)


def test_accumulation_order_is_bit_identical_to_full_backward():
    for trial in range(20):
        g = torch.Generator().manual_seed(trial)
        b0, x0, grad = (torch.randn(64, generator=g) for _ in range(3))

        def forward(b, x):
            h = x * 1.5
            return (h + b) * (h * 2 + b) * (h * 3 + b)  # one bias, three intermediates

        b1, x1 = b0.clone().requires_grad_(), x0.clone().requires_grad_()
        forward(b1, x1).backward(grad)
        b2, x2 = b0.clone().requires_grad_(), x0.clone().requires_grad_()
        (dx,), groups = pb.stage_backward_input(forward(b2, x2), grad, [x2], [b2])
        pb.stage_backward_weight([b2], groups)
        assert torch.equal(dx, x1.grad) and torch.equal(b2.grad, b1.grad), f"trial {trial}"


def test_second_b_on_the_same_outputs_raises():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = lin(x)
    _, groups = pb.stage_backward_input(out, torch.ones(2, 4), [x], lin.parameters())
    with pytest.raises(RuntimeError, match=r"stage_output: this output was already backpropagated"):
        pb.stage_backward_input(out, torch.ones(2, 4), [x], lin.parameters())
    with pytest.raises(RuntimeError, match=r"stage_output\[0\]: this output was already backpropagated"):
        pb.stage_backward((out,), (torch.ones(2, 4),), [x])
    pb.stage_backward_weight(lin.parameters(), groups)


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    step: int


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t: {t}, "stage_output: a set cannot be matched with gradients"),
        (lambda t: (x for x in [t]), "stage_output: a generator cannot be matched with gradients"),
        (
            lambda t: (t.sum(), _Out(t, 3)),
            "stage_output[1]: dataclass _Out holds a tensor that requires grad ('hidden')",
        ),
    ],
)
def test_containers_that_would_hide_tensors_are_refused(make, message):
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = make(lin(x))
    with pytest.raises(TypeError) as info:
        pb.stage_backward_input(out, None, [x], lin.parameters())
    assert str(info.value).startswith(message), str(info.value)


def test_reentrant_checkpoint_is_refused_clearly_in_b_and_works_in_full():
    torch.manual_seed(0)
    inner, head = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = head(checkpoint(inner, x, use_reentrant=True))
    with pytest.raises(RuntimeError, match=r"use_reentrant=True .* use use_reentrant=False"):
        pb.stage_backward_input(out, torch.ones(2, 4), [x], [*inner.parameters(), *head.parameters()])
    assert out.requires_grad and inner.weight.grad is None
    (gx,) = pb.stage_backward(out, torch.ones(2, 4), [x])
    assert gx is not None and inner.weight.grad is not None


def test_reentrant_checkpoint_on_a_weight_only_branch_is_refused_in_b_before_anything_runs():
    """W's accumulating call names its inputs, which reentrant checkpointing refuses: B must say so
    up front, not leave W to fail after accumulating part of the grads."""
    torch.manual_seed(0)
    w, v = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    ww = checkpoint(lambda a: torch.sin(a) * 2, w, use_reentrant=True)  # a weight-only branch
    out = torch.tanh(x @ v) @ ww
    with pytest.raises(RuntimeError, match=r"use_reentrant=True .* use use_reentrant=False"):
        pb.stage_backward_input((out,), (torch.ones(2, 4),), [x], [w, v])
    assert out.requires_grad and w.grad is None and v.grad is None
    (gx,) = pb.stage_backward((out,), (torch.ones(2, 4),), [x])
    assert gx is not None and w.grad is not None and v.grad is not None


def test_b_does_not_consume_the_weights_iterator_when_input_is_bad():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    params = lin.parameters()
    with pytest.raises(ValueError):
        pb.stage_backward_input(lin(x), torch.ones(3), [x], params)
    assert len(list(params)) == 2


def test_split_backward_called_under_inference_mode_matches_autograd():
    """The graph is built outside; B and W called inside ``torch.inference_mode()`` (e.g. by an
    evaluation wrapper) give exactly autograd's grads."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    ref = copy.deepcopy(module)
    x = torch.randn(3, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(3, 4)
    ref(x_ref).backward(grad)
    out = module(x)
    with torch.inference_mode():
        (gx,), groups = pb.stage_backward_input(out, grad, [x], module.parameters())
        pb.stage_backward_weight(module.parameters(), groups)
    assert torch.equal(gx, x_ref.grad)
    for p, q in zip(module.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("where", ["inside", "received", "written"])
def test_gradients_made_under_inference_mode_give_a_full_backward_s_grads(where):
    """Note [inference-tensor gradients] (ppbackward._tree): output gradients made under
    ``torch.inference_mode()``, with B and W called there (``inside``: every ``.grad`` an inference tensor, as a
    full backward there makes them) or outside it (``received``), and B's gradients written back into
    ``group["grads"]`` as copies made there (``written``); two accumulating microbatches each, the weight matmuls
    W computes itself included (Note [weight matmuls from their saved input])."""
    inside = where != "received"

    def grads(split: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
        x = torch.randn(3, 4, requires_grad=True)
        for _ in range(2):
            out = module(x)
            with torch.inference_mode():
                grad = torch.ones(3, 4)
            with torch.inference_mode(inside):
                if not split:
                    pb.stage_backward(out, grad, [x])
                    continue
                _, groups = pb.stage_backward_input(out, grad, [x], module.parameters())
                if where == "written":
                    for group in groups:
                        group["grads"] = [
                            tuple(None if g is None else g.clone() for g in entry) for entry in group["grads"]
                        ]
                pb.stage_backward_weight(module.parameters(), groups)
        return [p.grad for p in module.parameters() if p.grad is not None]

    split, full = grads(split=True), grads(split=False)
    assert len(split) == len(full) == 6
    for got, want in zip(split, full):
        assert want.is_inference() == got.is_inference() == inside
        assert torch.equal(got, want)
