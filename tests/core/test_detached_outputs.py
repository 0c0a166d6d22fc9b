"""W never depends on a tensor the caller may detach in place after B (Note [outputs detached after B]).

torch's ``PipelineStage`` detaches the last stage's non-view outputs in place right after B; torch's own
B detached every output. Here every stage shape is run the way a pipeline runs it -- B, the caller
detaching every output in place, then W -- and compared with plain autograd: first, middle and last
stages, loss and non-loss outputs, stages whose inputs need no grad (a frozen prefix before a LoRA
adapter: the whole graph is W's), a loss with its own parameter, an output another op consumed; then
random stages (hypothesis).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ppbackward as pb
from tests.core.helpers import assert_grads_equal, assert_param_grads, clone_inputs, flat_pairs, output_grads
from tests.core.stages import DTYPE, _x
from tests.core.test_random_stages import RandomStage, stage_st


def _detach_every_output(out) -> None:
    """What a caller may do after B: detach every non-view tensor output in place."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None and not t._is_view():
            t.detach_()


class LoRALinear(nn.Module):
    """A frozen base linear layer plus a trainable low-rank adapter ``b(a(x))``."""

    def __init__(self, d: int = 8, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.a = nn.Linear(d, rank, bias=False)
        self.b = nn.Linear(rank, d, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.b(self.a(x)))


class LoRAStack(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class LearnableLossScale(nn.Module):
    """A loss with a parameter of its own: its node saved the stage output and is an intermediate."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=DTYPE))

    def forward(self, out, target):
        return ((out * self.scale - target) ** 2).sum()


class Consumed(nn.Module):
    """Returns ``h`` and ``h @ v``: a later op of the stage saved the output ``h``; with a frozen
    prefix that op is W's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=DTYPE))
        self.v = nn.Parameter(torch.randn(4, 4, dtype=DTYPE))

    def forward(self, x):
        h = torch.tanh(x @ self.w)
        return h, h * (h @ self.v)


def _run_last_stage(stage, loss_fn, xs, target):
    """Last stage as torch's PipelineStage runs it: B on the loss, outputs detached, then W."""
    out = stage(*xs)
    loss = loss_fn(out, target)
    grads, groups = pb.stage_backward_input((loss,), None, xs, list(stage.parameters()) + list(loss_fn.parameters()))
    _detach_every_output(out)
    pb.stage_backward_weight(list(stage.parameters()) + list(loss_fn.parameters()), groups)
    return grads


def _run_middle_stage(stage, xs, grads_out):
    out = stage(*xs)
    got, groups = pb.stage_backward_input(out, grads_out(out), xs, stage.parameters())
    _detach_every_output(out)
    pb.stage_backward_weight(stage.parameters(), groups)
    return got


def _reference_last(stage, loss_fn, xs, target):
    ref_stage, ref_loss = copy.deepcopy(stage), copy.deepcopy(loss_fn)
    ref_x = clone_inputs(xs)
    ref_loss(ref_stage(*ref_x), target).backward()
    return ref_stage, ref_loss, ref_x


def _mse(out, target):
    return F.mse_loss(out, target, reduction="sum")


_mse.parameters = lambda: []  # type: ignore[attr-defined]


@pytest.mark.parametrize("input_grad", [False, True], ids=["frozen-prefix", "trainable-input"])
@pytest.mark.parametrize(
    "stage, loss_fn",
    [
        (LoRALinear, _mse),
        (LoRAStack, _mse),
        (lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), _mse),
        (LoRAStack, LearnableLossScale),
    ],
    ids=["lora", "lora-stack", "mlp", "learnable-loss"],
)
def test_last_stage_with_a_loss_survives_the_caller_detaching_its_outputs(stage, loss_fn, input_grad):
    torch.manual_seed(0)
    module = stage().to(DTYPE)
    loss = loss_fn() if isinstance(loss_fn, type) else loss_fn
    x, target = [_x(1, 4, 8, requires_grad=input_grad)], _x(2, 4, 8, requires_grad=False)
    ref_stage, ref_loss, ref_x = _reference_last(module, loss, x, target)
    got = _run_last_stage(module, loss, x, target)
    assert_grads_equal(got[0], ref_x[0].grad if input_grad else None, "input")
    assert_param_grads(module, {n: p.grad for n, p in ref_stage.named_parameters()}, "stage")
    if isinstance(loss, nn.Module):
        assert_param_grads(loss, {n: p.grad for n, p in ref_loss.named_parameters()}, "loss")


@pytest.mark.parametrize("input_grad", [False, True], ids=["frozen-prefix", "trainable-input"])
@pytest.mark.parametrize("stage", [LoRAStack, Consumed], ids=["lora-stack", "output-consumed"])
def test_middle_stage_survives_the_caller_detaching_its_outputs(stage, input_grad):
    torch.manual_seed(0)
    module = stage().to(DTYPE)
    d = 8 if stage is LoRAStack else 4
    x = [_x(3, 4, d, requires_grad=input_grad)]
    ref = copy.deepcopy(module)
    ref_x = clone_inputs(x)
    ref_out = ref(*ref_x)
    outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    torch.autograd.backward(list(outs), list(output_grads(outs, 7)))
    got = _run_middle_stage(
        module, x, lambda out: output_grads(out, 7) if isinstance(out, tuple) else output_grads((out,), 7)[0]
    )
    assert_grads_equal(got[0], ref_x[0].grad if input_grad else None, "input")
    assert_param_grads(module, {n: p.grad for n, p in ref.named_parameters()}, "stage")


def test_first_stage_whose_batch_needs_no_grad_with_every_output_detached():
    """Stage 0 of torch 2.13 runs a full backward, but a direct B/W on it must work as well."""
    torch.manual_seed(0)
    module = LoRAStack().to(DTYPE)
    x = [_x(4, 4, 8, requires_grad=False)]
    ref = copy.deepcopy(module)
    g = output_grads(ref(*x), 9)
    ref(*x).backward(g)
    got = _run_middle_stage(module, x, lambda out: g)
    assert got == (None,)
    assert_param_grads(module, {n: p.grad for n, p in ref.named_parameters()}, "stage")


def test_pinned_saved_tensors_are_released_when_w_is_done():
    """The pins keep nothing alive after W: an activation an intermediate saved (pinned in B, since B
    got a loss) is freed when W is done, although a view output keeps the graph alive after W."""
    import weakref

    torch.manual_seed(0)
    module = LoRALinear().to(DTYPE)
    x = _x(5, 4, 8)
    h = module.a(x)  # saved by b's matmul: an intermediate (input path through h), called by W
    out = torch.tanh(module.base(x) + module.b(h))
    keep = out.view(-1)  # a view: not detachable, keeps the graph alive after W
    loss = _mse(out, torch.zeros(4, 8, dtype=DTYPE))
    _, groups = pb.stage_backward_input((loss,), None, [x], module.parameters())
    saved = weakref.ref(h.untyped_storage())
    del h
    assert saved() is not None  # W still needs it
    pb.stage_backward_weight(module.parameters(), groups)
    assert module.b.weight.grad is not None and keep.grad_fn is not None
    assert saved() is None


def test_a_saved_input_modified_in_place_before_w_still_raises_autograd_s_error():
    torch.manual_seed(0)
    module = LoRALinear().to(DTYPE)
    x = _x(6, 4, 8, requires_grad=False)
    out = module(x)
    loss = _mse(out, torch.zeros(4, 8, dtype=DTYPE))
    _, groups = pb.stage_backward_input((loss,), None, [x], module.parameters())
    out.mul_(2)  # the loss saved ``out``: W must refuse to use the modified value
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pb.stage_backward_weight(module.parameters(), groups)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**stage_st, as_loss=st.booleans())
def test_random_stages_survive_the_caller_detaching_every_output(
    program, n_mat, n_vec, frozen, outputs, input_grad, as_loss
):
    torch.manual_seed(0)
    module = RandomStage(program, n_mat, n_vec, frozen, outputs)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 4, generator=g, dtype=torch.float64).requires_grad_(r) for r in input_grad]

    def backward_args(out):
        if as_loss:  # the last stage: B gets a loss computed from the stage outputs
            loss = sum((o * o).sum() for o in out if o.requires_grad)
            return ((loss,), None) if isinstance(loss, torch.Tensor) else ((), None)
        return out, output_grads(out, 11)

    ref, ref_x = copy.deepcopy(module), clone_inputs(xs)
    roots, grads = backward_args(ref(*ref_x))
    pairs = [(r, None) for r in roots] if grads is None else flat_pairs(roots, grads)
    if pairs:
        torch.autograd.backward([r for r, _ in pairs], [gg for _, gg in pairs] if grads is not None else None)
    split, split_x = copy.deepcopy(module), clone_inputs(xs)
    out = split(*split_x)
    roots, grads = backward_args(out)
    got, groups = pb.stage_backward_input(roots, grads, split_x, split.parameters())
    _detach_every_output(out)
    pb.stage_backward_weight(split.parameters(), groups)
    for i, x in enumerate(ref_x):
        assert_grads_equal(got[i], x.grad if x.requires_grad else None, f"input[{i}]")
    assert_param_grads(split, {n: p.grad for n, p in ref.named_parameters()}, "split")
