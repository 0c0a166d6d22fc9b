"""Note [weight matmuls from their saved input] (ppbackward._matmul_weights): B takes each weight matmul's
``mat1`` out, runs without keeping the graph, and W computes the weight gradient with torch's formula.

Checked here: the path is taken where it should be (the engine freed the matmul's saved tensors after B) and
not where it must not be (the node still holds them); grads bit-identical to plain autograd in each stride
case the formula distinguishes, first microbatch and accumulating; an in-place change of the taken input
between B and W refused; gradients written into ``"grads"`` computed from the formula. The negative control
is a formula with the branches swapped (``_swapped``): the bitwise comparison must catch it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge

import ppbackward._matmul_weights as mw
from ppbackward import StageBackwardError, stage_backward_input, stage_backward_weight
from ppbackward._param_groups import Contribution
from ppbackward._saved import HOOKS_VISIBLE

# B keeps no graph only where torch's SavedTensor shows its hooks (torch 2.13+: ppbackward._saved.HOOKS_VISIBLE)
_NO_KEPT_GRAPH = pytest.mark.skipif(
    not HOOKS_VISIBLE, reason="torch < 2.13: SavedTensor does not show its hooks, so B keeps the graph"
)


class _Linears(nn.Module):
    """Three weight matmul spellings: ``F.linear`` with bias (addmm, mat2 column-major), without bias on a 3-D
    input (mm through a view), and ``h @ W`` with ``W`` (in, out) (mm, mat2 row-major, no transpose)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64))
        self.ab = nn.Parameter(torch.randn(d, generator=g, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64))
        self.c = nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x.reshape(-1, x.shape[-1]), self.a, self.ab).tanh().reshape(x.shape)
        h = F.linear(h, self.b).tanh()
        return h.reshape(-1, h.shape[-1]) @ self.c


def _run(module: nn.Module, xs: list[torch.Tensor], grads: list[torch.Tensor], order: str = "BWBW") -> list:
    """B and W per microbatch; the input grads."""
    params = list(module.parameters())
    out_grads = []
    for x, g in zip(xs, grads):
        x = x.detach().requires_grad_()
        (gx,), groups = stage_backward_input(module(x), g, [x], params)
        stage_backward_weight(params, groups)
        out_grads.append(gx)
    return out_grads


def _reference(module: nn.Module, xs: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[list, list]:
    ref = _Linears()
    ref.load_state_dict(module.state_dict())
    gxs = []
    for x, g in zip(xs, grads):
        x = x.detach().requires_grad_()
        torch.autograd.backward(ref(x), g)
        gxs.append(x.grad)
    return gxs, [p.grad for p in ref.parameters()]


def _inputs(n: int = 3) -> tuple[list, list]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 5, 6, generator=g, dtype=torch.float64) for _ in range(n)]
    gs = [torch.randn(10, 6, generator=g, dtype=torch.float64) for _ in range(n)]
    return xs, gs


def test_formula_path_taken_and_exact():
    module = _Linears()
    xs, gs = _inputs()
    out_ref, p_ref = _reference(module, xs, gs)
    out = _run(module, xs, gs)
    for a, b in zip(out, out_ref):
        assert torch.equal(a, b)
    for p, r in zip(module.parameters(), p_ref):
        assert torch.equal(p.grad, r), "weight gradient differs from plain autograd"


@_NO_KEPT_GRAPH
def test_graph_released_after_b():
    """The formula path keeps no graph: the matmuls' saved tensors are gone after B, as after a full backward."""
    module = _Linears()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    out = module(x)
    node = out.grad_fn
    assert type(node).__name__ == "MmBackward0"
    _, groups = stage_backward_input(out, torch.ones_like(out), [x], list(module.parameters()))
    with pytest.raises(RuntimeError, match=r"freed|second time"):
        node._saved_self  # noqa: B018
    stage_backward_weight(list(module.parameters()), groups)


def test_alpha_not_one_keeps_the_graph():
    """``addmm`` with alpha 2 is not the formula's case: B keeps the matmul's saved tensors for W."""
    w = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    out = torch.addmm(torch.zeros(5, 4, dtype=torch.float64), x.tanh(), w.t(), alpha=2.0)
    node = out.grad_fn
    _, groups = stage_backward_input(out, torch.ones_like(out), [x], [w])
    assert node._saved_mat1 is not None  # still held: W calls the node
    stage_backward_weight([w], groups)
    ref_w = w.detach().clone().requires_grad_()
    torch.addmm(torch.zeros(5, 4, dtype=torch.float64), x.detach().tanh(), ref_w.t(), alpha=2.0).backward(
        torch.ones(5, 4, dtype=torch.float64)
    )
    assert torch.equal(w.grad, ref_w.grad)


@_NO_KEPT_GRAPH
def test_taken_input_changed_in_place_is_refused():
    module = _Linears()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    params = list(module.parameters())
    out = module(x)
    mat1 = out.grad_fn._saved_self
    _, groups = stage_backward_input(out, torch.ones_like(out), [x], params)
    with torch.no_grad():
        mat1.add_(1.0)
    with pytest.raises(StageBackwardError, match="saved for its weight gradient"):
        stage_backward_weight(params, groups)
    assert all(p.grad is None for p in params), "nothing may be accumulated"


@_NO_KEPT_GRAPH
def test_written_grads_use_the_formula():
    """A gradient written into ``"grads"`` for a matmul W computes from its taken input: the weight gradient is
    ``g.t() @ mat1`` (and for addmm's bias, ``g`` reduced), as torch's W computes from written gradients."""
    w = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    b = nn.Parameter(torch.randn(4, dtype=torch.float64))
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    h = x.tanh()
    out = F.linear(h, w, b)
    _, groups = stage_backward_input(out, torch.ones_like(out), [x], [w, b])
    (group,) = [gr for gr in groups if gr["intermediates"]]
    written = torch.randn(5, 4, dtype=torch.float64)
    group["grads"] = [(written,)]
    stage_backward_weight([w, b], groups)
    assert torch.equal(w.grad, written.t().mm(h.detach()))
    assert torch.allclose(b.grad, written.sum(0))


def _reordered(calls, taken):
    """A wrong formula (tests only): the same product summed in two halves over the rows, the values equal up to
    rounding, as another kernel or order of accumulation would give."""
    out = []
    for node, grads, edges in calls:
        x, dy = taken[node][0], grads[0]
        k = dy.shape[0] // 2
        nf, seq = node.next_functions, node._sequence_nr()
        for j in edges:
            g = x[:k].t().mm(dy[:k]) + x[k:].t().mm(dy[k:]) if j == mw._MAT1[type(node)][1] else dy
            out.append(Contribution(GradientEdge(*nf[j][:2]), g, seq))
    return out


@_NO_KEPT_GRAPH
def test_negative_control_wrong_formula_caught(monkeypatch):
    import ppbackward._weight_edges as we

    module = _Linears(d=33)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 37, 33, generator=g, dtype=torch.float32) for _ in range(2)]
    gs = [torch.randn(74, 33, generator=g, dtype=torch.float32) for _ in range(2)]
    module = module.float()
    ref = _Linears(d=33).float()
    ref.load_state_dict(module.state_dict())
    for x, gr in zip(xs, gs):
        torch.autograd.backward(ref(x.requires_grad_()), gr)
    monkeypatch.setattr(we, "weight_contributions", _reordered)
    _run(module, [x.detach() for x in xs], gs)
    assert not all(torch.equal(p.grad, r.grad) for p, r in zip(module.parameters(), ref.parameters())), (
        "the bitwise comparison does not tell the formula's branches apart"
    )
