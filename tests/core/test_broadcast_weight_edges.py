"""Weight edges whose gradient the engine must shape: broadcast parameters (summed back to their
shape) and a parameter of another dtype (cast), through the split. W hands the intermediates'
outputs to its accumulating engine call unshaped (Note [W roots are validated by the engine] in
``ppbackward._weight_edges``): the grads must equal a plain backward's bit for bit, in both regimes.
Negative control: feeding the unshaped gradient straight into ``.grad`` would have the wrong shape."""

from __future__ import annotations

import pytest
import torch

import ppbackward


class Broadcasting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(6, 6, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(6, generator=g))  # (6,) added to (4, 3, 6)
        self.row = torch.nn.Parameter(torch.randn(1, 1, 6, generator=g))  # (1, 1, 6) multiplied in
        self.scale = torch.nn.Parameter(torch.tensor(0.5))  # a 0-d parameter
        self.wide = torch.nn.Parameter(torch.randn(6, dtype=torch.float64, generator=g))  # cast to float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w + self.bias
        h = h * self.row
        h = h * self.scale + self.wide.float()
        return torch.tanh(h) @ self.w.t()


def _plain(model: Broadcasting, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    model(x).backward(grad)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("accumulating", [False, True])
def test_split_shapes_broadcast_and_cast_weight_grads_exactly_like_a_full_backward(accumulating):
    model = Broadcasting()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 6, generator=g, requires_grad=True)
    grad = torch.randn(4, 3, 6, generator=g)
    if accumulating:
        _plain(model, x, grad)
    start = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    ref = _plain(model, x, grad)
    for p, s in zip(model.parameters(), start):
        p.grad = None if s is None else s.clone()
    out = model(x.detach().requires_grad_())
    (_gx,), groups = ppbackward.stage_backward_input((out,), (grad,), [x], model.parameters())
    ppbackward.stage_backward_weight(model.parameters(), groups)
    for (name, p), r in zip(model.named_parameters(), ref):
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
        assert torch.equal(p.grad, r), name


def test_negative_control_the_bias_edge_gradient_is_not_bias_shaped():
    model = Broadcasting()
    x = torch.randn(4, 3, 6, requires_grad=True)
    h = x @ model.w + model.bias
    add = h.grad_fn
    grads = add(torch.ones(4, 3, 6))  # the node's outputs, unshaped: what W hands the engine
    assert tuple(grads[1].shape) != tuple(model.bias.shape)
