"""torch 2.13's observable contract of the stage backward: the points ppbackward keeps, and its differences.

Kept (run on torch's functions *and* on ppbackward's, so each point is shown to be torch's own): what B,
W and the full backward return and how it is aligned, which grads are ``None``, where grads accumulate,
that B touches no parameter and detaches its plain outputs in place. A future change that breaks a
caller relying on one of them fails here first.

Differences (docs/api.md, "Differences from torch's functions"): one test per entry, showing torch's
behaviour and ppbackward's side by side. The torch side is pinned for torch 2.13-2.15 (2.13's and
2.14's ``_backward.py`` are identical; 2.15's differs only in accepting ``GradientEdge`` roots and
``None`` entries among the outputs, pinned per release below); on other releases only ppbackward's
side runs.
"""

from __future__ import annotations

import collections.abc
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.pipelining import _backward as upstream

import ppbackward as pb
from ppbackward._compat import torch_release
from ppbackward._saved import HOOKS_VISIBLE
from tests.core.stages import Matmul

TORCH_2_13 = (2, 13) <= torch_release()[:2] <= (2, 15)
EDGE_ROOTS = torch_release()[:2] >= (2, 15)  # torch's _backward.py takes GradientEdge and None outputs
IMPLS = [pytest.param(pb, id="ppbackward"), pytest.param(upstream, id="torch", marks=pytest.mark.skipif(
    not TORCH_2_13, reason="torch's side is pinned for torch 2.13-2.15"))]
torch_2_13_only = pytest.mark.skipif(not TORCH_2_13, reason="torch's side is pinned for torch 2.13-2.15")


def _stage(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))


def _inputs():
    x = torch.randn(3, 4, requires_grad=True)
    return [x, "not a tensor", torch.randn(3, 4), 7]  # a tensor without grad, two non-tensors


# -- kept: torch's contract ----------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_b_returns_input_grads_aligned_with_the_inputs_and_param_groups(impl):
    mod = _stage()
    inputs = _inputs()
    out = mod(inputs[0]) + inputs[2]
    grads, groups = impl.stage_backward_input((out,), (torch.ones(3, 4),), inputs, mod.parameters())
    assert isinstance(grads, tuple) and len(grads) == 4
    assert grads[0] is not None and grads[0].shape == (3, 4)
    assert grads[1] is None and grads[2] is None and grads[3] is None  # non-tensor, no grad, non-tensor
    assert all(p.grad is None for p in mod.parameters())  # B touches no parameter
    assert out.grad_fn is None  # a plain output is detached in place after B
    result = impl.stage_backward_weight(mod.parameters(), groups)
    assert isinstance(result, tuple) and len(result) == len(list(mod.parameters()))


@pytest.mark.parametrize("impl", IMPLS)
def test_b_then_w_equals_plain_autograd_and_w_accumulates_over_microbatches(impl):
    mod, ref = _stage(), _stage()
    for k in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k), requires_grad=True)
        rx = x.detach().clone().requires_grad_()
        loss = mod(x).pow(2).sum()
        (dx,), groups = impl.stage_backward_input((loss,), None, [x], mod.parameters())
        impl.stage_backward_weight(mod.parameters(), groups)
        ref(rx).pow(2).sum().backward()
        torch.testing.assert_close(dx, rx.grad)
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)  # the sum of both microbatches


@pytest.mark.parametrize("impl", IMPLS)
def test_full_backward_returns_aligned_input_grads_and_accumulates_parameters(impl):
    mod, ref = _stage(), _stage()
    inputs = _inputs()
    rx = inputs[0].detach().clone().requires_grad_()
    grads = impl.stage_backward(mod(inputs[0]), torch.ones(3, 4), inputs)
    ref(rx).backward(torch.ones(3, 4))
    assert isinstance(grads, tuple) and len(grads) == 4
    torch.testing.assert_close(grads[0], rx.grad)
    assert grads[1:] == (None, None, None)
    assert inputs[0].grad is None  # the caller's input keeps no gradient
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("impl", IMPLS)
def test_outputs_that_need_no_grad_are_skipped(impl):
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    out = mod(x)
    extra = torch.ones(2)  # needs no grad: skipped whatever its gradient
    grads = impl.stage_backward((out, extra), (torch.ones(3, 4), None), [x])
    assert grads[0] is not None and all(p.grad is not None for p in mod.parameters())


@pytest.mark.parametrize("impl", IMPLS)
def test_deprecated_outputs_with_grads_idxs_selects_outputs_silently(impl, recwarn):
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    out = mod(x)
    grads = impl.stage_backward([out, out * 2], [torch.ones(3, 4), None], [x], outputs_with_grads_idxs=[0])
    assert grads[0] is not None
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


# -- differences (docs/api.md, "Differences from torch's functions") -----------------------------


def _b(impl, x, mod):
    return impl.stage_backward_input((mod(x).sum(),), None, [x], mod.parameters())


def test_difference_b_leaves_the_inputs_grad_alone():
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    (dx,), _ = _b(pb, x, mod)
    assert x.grad is None and dx is not None  # the returned tuple carries the input gradient
    if TORCH_2_13:
        y = x.detach().clone().requires_grad_()
        (dy,), _ = _b(upstream, y, _stage())
        assert y.grad is dy  # torch's B also writes it into .grad (held until clear_runtime_states)


@pytest.mark.parametrize("impl", IMPLS)
def test_param_groups_read_like_torchs_list_of_dicts(impl):
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    _, groups = _b(impl, x, mod)
    assert len(groups) == 2  # one per linear layer: its weight and bias share the layer's addmm
    shapes = set()
    for group in groups:
        assert {"params", "intermediates", "grads"} <= set(group)
        params, inter, grads = group["params"], group["intermediates"], group["grads"]
        assert all(type(n).__name__ == "AccumulateGrad" for n in params) and len(params) == 2
        assert [type(n).__name__ for n in inter] == ["AddmmBackward0"]
        assert len(grads) == len(inter) == 1
        shapes.add(tuple(grads[0][0].shape))  # the gradient flowing into the layer's addmm
    assert shapes == {(3, 6), (3, 4)}
    assert isinstance(groups, collections.abc.Sequence) and isinstance(groups[0], collections.abc.Mapping)
    assert dict(groups[0].items()).keys() == {"params", "intermediates", "grads"}


@pytest.mark.parametrize("impl", IMPLS)
def test_grads_written_into_param_groups_are_what_w_computes_from(impl):
    """torch's W computes the weight gradients from ``param_group["grads"]``: writing B's own back gives
    the same gradients, writing twice as much gives twice the gradients."""
    results = []
    for scale in (1.0, 2.0):
        mod = _stage()
        _, groups = _b(impl, _fixed_input(), mod)
        for group in groups:
            group["grads"] = [tuple(None if g is None else g * scale for g in entry) for entry in group["grads"]]
        impl.stage_backward_weight(mod.parameters(), groups)
        results.append([p.grad.clone() for p in mod.parameters()])
    reference = _stage()
    reference(_fixed_input()).backward(torch.ones(3, 4))
    for once, twice, ref in zip(*results, [p.grad for p in reference.parameters()]):
        torch.testing.assert_close(once, ref)
        torch.testing.assert_close(twice, 2 * ref)


def _fixed_input() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()


def test_difference_written_grads_are_checked_when_written():
    """torch's W fails inside the engine for a gradient of the wrong shape; ppbackward refuses the write,
    naming the entry, and W afterwards still uses B's own gradients."""
    mod = _stage()
    _, groups = _b(pb, _fixed_input(), mod)
    message = r"param_groups\[0\]\['grads'\]\[0\]\[0\]: grad shape \(3, 5\)"
    with pytest.raises(pb.StageBackwardError, match=message):
        groups[0]["grads"] = [(torch.zeros(3, 5),)]
    with pytest.raises(pb.StageBackwardError, match=r"2 entries for 1 intermediate"):
        groups[0]["grads"] = [None, None]
    with pytest.raises(TypeError, match=r"only 'grads' can be written"):
        groups[0]["params"] = []
    pb.stage_backward_weight(mod.parameters(), groups)
    reference = _stage()
    reference(_fixed_input()).backward(torch.ones(3, 4))
    for p, q in zip(mod.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_difference_a_bad_call_names_the_path_and_is_still_a_runtime_error():
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    message = r"stage_output\[0\]: grad shape \(3, 5\) != output shape \(3, 4\)"
    with pytest.raises(pb.StageBackwardError, match=message) as e:
        pb.stage_backward((mod(x),), (torch.ones(3, 5),), [x])
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, ValueError)
    assert all(p.grad is None for p in mod.parameters())  # raised before anything ran
    with pytest.raises(TypeError, match=r"stage_output\[0\]: gradient must be a torch.Tensor or None, got str"):
        pb.stage_backward((mod(x),), ("no",), [x])
    if TORCH_2_13:
        with pytest.raises(RuntimeError, match="Failed to run stage backward"):  # torch wraps the autograd error
            upstream.stage_backward((mod(x),), (torch.ones(3, 5),), [x])


def test_difference_an_error_raised_inside_the_backward_is_not_wrapped():
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    out = mod(x)
    out.register_hook(lambda g: (_ for _ in ()).throw(KeyError("from a user hook")))
    with pytest.raises(KeyError, match="from a user hook"):
        pb.stage_backward_input((out,), (torch.ones(3, 4),), [x], mod.parameters())


def test_difference_full_backward_restores_the_inputs_previous_grad():
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    previous = torch.full((3, 4), 5.0)
    x.grad = previous
    (dx,) = pb.stage_backward(mod(x), torch.ones(3, 4), [x])
    assert x.grad is previous and dx is not previous
    if TORCH_2_13:
        y = x.detach().clone().requires_grad_()
        y.grad = previous.clone()
        upstream.stage_backward(_stage()(y), torch.ones(3, 4), [y])
        assert y.grad is None  # torch clears it (pytorch/pytorch#164329), the previous value with it


def test_difference_an_input_that_retains_its_grad_keeps_the_grad_it_had():
    """A non-leaf stage input that retains its gradient (torch's stage calls ``retain_grad()`` on a received
    activation that is not a leaf): its ``.grad`` is put back after B and after a full backward, as a leaf's
    is (Note [inputs' grad left as it was]); before, autograd's retain hook left each microbatch's input
    gradient on it. torch's full backward sets it to ``None``, torch's B adds the gradient to it twice."""
    for backward in ("full", "b"):
        mod = _stage()
        base = torch.randn(6, 4, requires_grad=True)
        x = base[:3]  # a microbatch's view: not a leaf
        x.retain_grad()
        before = torch.full((3, 4), 5.0) if backward == "full" else None
        x.grad = before
        if backward == "full":
            (dx,) = pb.stage_backward(mod(x), torch.ones(3, 4), [x])
        else:
            (dx,), groups = pb.stage_backward_input((mod(x),), (torch.ones(3, 4),), [x], mod.parameters())
            pb.stage_backward_weight(mod.parameters(), groups)
        assert x.grad is before and dx is not None, backward
        want = torch.autograd.grad(_stage()(base[:3]), base, torch.ones(3, 4))[0][:3]
        assert torch.equal(dx, want), backward
    if TORCH_2_13:
        y = torch.randn(6, 4, requires_grad=True)[:3]
        y.retain_grad()
        upstream.stage_backward(_stage()(y), torch.ones(3, 4), [y])
        assert y.grad is None
        z = torch.randn(6, 4, requires_grad=True)[:3]
        z.retain_grad()
        (dz,), _ = upstream.stage_backward_input((_stage()(z),), (torch.ones(3, 4),), [z], _stage().parameters())
        assert torch.equal(z.grad, 2 * dz)  # autograd's retain hook wrote it, then torch's B added it again


def test_difference_w_returns_the_grads_after_accumulation():
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    _, groups = _b(pb, x, mod)
    returned = pb.stage_backward_weight(mod.parameters(), groups)
    assert all(r is p.grad and r is not None for r, p in zip(returned, mod.parameters()))
    if TORCH_2_13:
        theirs = _stage()
        _, groups = _b(upstream, x.detach().clone().requires_grad_(), theirs)
        assert upstream.stage_backward_weight(theirs.parameters(), groups) == (None,) * 4  # the values before W


def test_difference_leaves_outside_weights_are_accumulated_in_w():
    """Given only the first layer's parameters as ``weights``, torch's split leaves the last layer without a
    gradient; ppbackward accumulates every leaf the outputs reach, as a full backward does."""
    mod = _stage()
    first = list(mod[0].parameters())
    x = torch.randn(3, 4, requires_grad=True)
    _, groups = pb.stage_backward_input((mod(x),), (torch.ones(3, 4),), [x], first)
    pb.stage_backward_weight(first, groups)
    ref = _stage()
    ref(x.detach()).backward(torch.ones(3, 4))
    for p, q in zip(mod.parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
    if TORCH_2_13:
        theirs = _stage()
        theirs_first = list(theirs[0].parameters())
        y = x.detach().clone().requires_grad_()
        _, groups = upstream.stage_backward_input((theirs(y),), (torch.ones(3, 4),), [y], theirs_first)
        upstream.stage_backward_weight(theirs_first, groups)
        assert [p.grad is not None for p in theirs.parameters()] == [True, True, False, False]


def test_difference_a_view_output_is_left_attached():
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    out = mod(x).view(12)
    pb.stage_backward_input((out,), (torch.ones(12),), [x], mod.parameters())
    assert out.grad_fn is not None  # a view cannot be detached in place: left as it is
    if TORCH_2_13:
        with pytest.raises(RuntimeError, match="Failed to run stage backward input"):
            upstream.stage_backward_input((mod(x).view(12),), (torch.ones(12),), [x], mod.parameters())


def test_difference_gradient_edge_outputs_are_accepted():
    mod, ref = _stage(), _stage()
    x = torch.randn(3, 4, requires_grad=True)
    rx = x.detach().clone().requires_grad_()
    edge = get_gradient_edge(mod(x))  # the output tensor itself is gone
    (dx,), groups = pb.stage_backward_input([edge], [torch.ones(3, 4)], [x], mod.parameters())
    pb.stage_backward_weight(mod.parameters(), groups)
    ref(rx).backward(torch.ones(3, 4))
    torch.testing.assert_close(dx, rx.grad)
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    if TORCH_2_13 and not EDGE_ROOTS:  # 2.13-2.14's B reads .requires_grad of each output
        with pytest.raises(AttributeError, match="'GradientEdge' object has no attribute 'requires_grad'"):
            upstream.stage_backward_input([get_gradient_edge(mod(x))], [torch.ones(3, 4)], [x], mod.parameters())


def test_difference_none_outputs_are_skipped_by_b():
    """A ``None`` among the outputs (torch 2.15's stage hands one over for a released output that needs
    no grad) is skipped, as torch's full backward skips any non-tensor; 2.13-2.14's B fails on it."""
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    (dx,), _ = pb.stage_backward_input([mod(x), None], [torch.ones(3, 4), None], [x], mod.parameters())
    assert dx is not None
    if TORCH_2_13 and not EDGE_ROOTS:
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'requires_grad'"):
            upstream.stage_backward_input([mod(x), None], [torch.ones(3, 4), None], [x], mod.parameters())


@pytest.mark.parametrize("impl", [IMPLS[0], pytest.param(upstream, id="torch", marks=pytest.mark.skipif(
    not EDGE_ROOTS, reason="torch's B and full backward take GradientEdge and None outputs from 2.15"))])
def test_edge_and_none_outputs_give_the_grads_of_the_tensors(impl):
    """torch 2.15's contract: a ``GradientEdge`` root stands for its released output, ``None`` is
    skipped; B+W and the full backward give plain autograd's grads."""
    ref = _stage()
    rx = torch.randn(3, 4, requires_grad=True)
    ref(rx).backward(torch.ones(3, 4))
    for split in (True, False):
        mod = _stage()
        x = rx.detach().clone().requires_grad_()
        roots, grads = [get_gradient_edge(mod(x)), None], [torch.ones(3, 4), None]
        if split:
            (dx,), groups = impl.stage_backward_input(roots, grads, [x], mod.parameters())
            impl.stage_backward_weight(mod.parameters(), groups)
        else:
            (dx,) = impl.stage_backward(roots, grads, [x])
        torch.testing.assert_close(dx, rx.grad)
        for p, q in zip(mod.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def test_difference_w_with_dtensor_weights_checks_only_their_number():
    """Note [FSDP2 swaps parameters]: with DTensors on either side, W accepts other parameter objects of
    the same number (FSDP2 swaps sharded and unsharded parameters between B and W), and refuses another
    number; with plain tensors it still refuses another stage's weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        mod = _stage()
        sharded = [nn.Parameter(DTensor.from_local(p.detach(), mesh, [Replicate()])) for p in mod.parameters()]
        x = torch.randn(3, 4, requires_grad=True)
        _, groups = _b(pb, x, mod)
        pb.stage_backward_weight(sharded, groups)  # the other form of the same four parameters
        assert all(p.grad is not None for p in mod.parameters())  # accumulated where B found them
        _, groups = _b(pb, x, mod)
        with pytest.raises(pb.StageBackwardError, match=r"weights: 3 parameter\(s\) given to stage_backward_weight, 4"):
            pb.stage_backward_weight(sharded[:3], groups)
        with pytest.raises(pb.StageBackwardError, match="was not among the weights given to stage_backward_input"):
            pb.stage_backward_weight(_stage(1).parameters(), groups)
    finally:
        if owned:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "kept",
    [pytest.param(False, marks=pytest.mark.skipif(not HOOKS_VISIBLE, reason="torch < 2.13: B keeps the graph")), True],
    ids=["graph-released", "graph-kept"],
)
def test_difference_a_users_own_backward_through_the_stage_graph_after_b_fails(kept, monkeypatch):
    """B keeps no graph where W computes the matmuls from their taken inputs (Note [weight matmuls from their
    saved input]): a backward through it fails as after a full backward; where it keeps one it releases the
    saved tensors W never reads (Note [release unread saved tensors]). torch's B retains the whole graph, so a
    backward of the caller's own through it still runs there."""
    if kept:
        monkeypatch.setattr("ppbackward.backward.take_saved_inputs", lambda *args: None)
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    h = mod[1](mod[0](x))  # an activation of the stage, not an output
    pb.stage_backward_input((mod[2](h),), (torch.ones(3, 4),), [x], mod.parameters())
    expected = "ppbackward released this saved tensor" if kept else "Trying to backward through the graph a second time"
    with pytest.raises(RuntimeError, match=expected):
        h.sum().backward()
    if TORCH_2_13:
        theirs = _stage()
        y = x.detach().clone().requires_grad_()
        g = theirs[1](theirs[0](y))
        upstream.stage_backward_input((theirs[2](g),), (torch.ones(3, 4),), [y], theirs.parameters())
        g.sum().backward()
        assert theirs[0].weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64, torch.float64])
def test_difference_an_output_gradient_of_another_dtype_is_refused(dtype):
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    grad = torch.ones(3, 4, dtype=dtype)
    with pytest.raises(TypeError, match=rf"stage_output\[0\]: grad dtype {dtype} != output dtype torch.float32"):
        pb.stage_backward((mod(x),), (grad,), [x])
    with pytest.raises(TypeError, match=rf"stage_output\[0\]: grad dtype {dtype} != output dtype torch.float32"):
        pb.stage_backward_input((mod(x),), (grad,), [x], mod.parameters())
    assert all(p.grad is None for p in mod.parameters())
    (mine,) = pb.stage_backward((mod(x),), (grad.to(torch.float32),), [x])  # what a caller does instead
    if TORCH_2_13:
        theirs = _stage()
        (dx,) = upstream.stage_backward((theirs(x),), (grad,), [x])  # the engine casts it
        assert dx.dtype == torch.float32
        torch.testing.assert_close(dx, mine, rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_mappings_that_are_not_dicts_are_skipped_as_torch_does(impl):
    """Listed among the differences because it surprises: a ``UserDict`` (any non-dict mapping) is an opaque
    leaf for both, so its tensors get no gradient, silently."""
    from collections import UserDict

    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    grads = impl.stage_backward((UserDict(h=mod(x)),), (UserDict(h=torch.ones(3, 4)),), [x])
    assert grads == (None,) and all(p.grad is None for p in mod.parameters())
    (dx,) = impl.stage_backward(({"h": mod(x)},), ({"h": torch.ones(3, 4)},), [x])  # a dict takes part
    assert dx is not None and all(p.grad is not None for p in mod.parameters())


class _NormScaleCustom(nn.Module):
    """A norm (weights B computes), an elementwise scale, a linear (deferred) and a custom Function."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(4), nn.Linear(4, 4)
        self.scale, self.w = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return Matmul.apply(self.lin(self.norm(x)) * self.scale, self.w)


def test_writing_back_what_was_read_gives_the_gradients_of_no_write():
    torch.manual_seed(0)
    stage, reference = _NormScaleCustom(), None
    reference = copy.deepcopy(stage)
    x = torch.randn(3, 4, requires_grad=True)
    _, groups = pb.stage_backward_input((stage(x).sum(),), None, [x], stage.parameters())
    for group in groups:
        group["grads"] = group["grads"]  # custom Function entries read None: B's outputs are kept
    pb.stage_backward_weight(stage.parameters(), groups)
    reference(x.detach()).sum().backward()
    for (name, p), q in zip(stage.named_parameters(), reference.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


def test_a_written_tuple_recomputes_the_nodes_bias_too_and_none_keeps_bs():
    mod = _stage()
    _, groups = _b(pb, _fixed_input(), mod)
    first = groups[0]["grads"]  # the output layer's addmm (reached first from the outputs)
    groups[0]["grads"] = [tuple(g * 0 for g in first[0])]
    groups[1]["grads"] = [None]
    pb.stage_backward_weight(mod.parameters(), groups)
    reference = _stage()
    reference(_fixed_input()).backward(torch.ones(3, 4))
    (w0, b0, w1, b1), (r0, rb0, _, _) = list(mod.parameters()), list(reference.parameters())
    assert torch.equal(w0.grad, r0.grad) and torch.equal(b0.grad, rb0.grad)  # kept: what B had
    assert not w1.grad.any() and not b1.grad.any()  # written zeros: weight and bias both recomputed


# -- direct calls: differences a pipeline never meets (docs/api.md, "Direct calls") -------------------------


def test_difference_the_full_backward_returns_this_calls_gradient_only():
    """A leaf input that had a ``.grad``: torch returns ``.grad`` after its engine call, so the old value is
    added in (an unused input returns the old value); ppbackward returns this call's gradient (``None`` for
    the unused one)."""
    mod = _stage()
    x, unused = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    x.grad, unused.grad = torch.ones(3, 4), torch.ones(3, 4)
    dx, du = pb.stage_backward(mod(x), torch.ones(3, 4), [x, unused])
    want = torch.autograd.grad(_stage()(x), x, torch.ones(3, 4))[0]
    assert torch.equal(dx, want) and du is None
    if TORCH_2_13:
        y, unused = x.detach().clone().requires_grad_(), torch.randn(3, 4, requires_grad=True)
        y.grad, unused.grad = torch.ones(3, 4), torch.ones(3, 4)
        dy, du = upstream.stage_backward(_stage()(y), torch.ones(3, 4), [y, unused])
        assert torch.equal(dy, want + 1) and torch.equal(du, torch.ones(3, 4))


def test_difference_the_same_input_twice_gets_its_gradient_at_both_places():
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    want = torch.autograd.grad(_stage()(x), x, torch.ones(3, 4))[0]
    d1, d2 = pb.stage_backward(mod(x), torch.ones(3, 4), [x, x])
    assert torch.equal(d1, want) and torch.equal(d2, want)
    (d1, d2), _ = pb.stage_backward_input((mod(x),), (torch.ones(3, 4),), [x, x], mod.parameters())
    assert torch.equal(d1, want) and torch.equal(d2, want) and x.grad is None
    if TORCH_2_13:
        y = x.detach().clone().requires_grad_()
        d1, d2 = upstream.stage_backward(_stage()(y), torch.ones(3, 4), [y, y])
        assert torch.equal(d1, want) and d2 is None  # it cleared .grad after the first
        (d1, d2), _ = upstream.stage_backward_input((_stage()(y),), (torch.ones(3, 4),), [y, y], mod.parameters())
        assert d1 is d2 and d1 is y.grad and torch.equal(d1, 2 * want)  # added into the tensor it returns


def test_difference_a_non_leaf_input_gets_its_gradient_returned(recwarn):
    """A stage input that is not a leaf and does not retain its gradient: torch's full backward reads its
    ``.grad`` (``None``, with autograd's warning about non-leaf ``.grad``); ppbackward returns the gradient.
    (torch's stage calls ``retain_grad()`` on such a received activation.)"""
    base = torch.randn(6, 4, requires_grad=True)
    (dx,) = pb.stage_backward(_stage()(base[:3]), torch.ones(3, 4), [base[:3]])
    assert dx is None  # a different view object than the forward's: not on the graph
    x = base[:3]
    (dx,) = pb.stage_backward(_stage()(x), torch.ones(3, 4), [x])
    assert torch.equal(dx, torch.autograd.grad(_stage()(base[:3]), base, torch.ones(3, 4))[0][:3])
    assert not [w for w in recwarn if "not a leaf" in str(w.message)]
    if TORCH_2_13:
        x = base[:3]
        with pytest.warns(UserWarning, match="not a leaf"):
            assert upstream.stage_backward(_stage()(x), torch.ones(3, 4), [x]) == (None,)


def test_difference_b_without_output_grads_needs_one_element_outputs():
    """``output_grads=None`` means a loss: ppbackward's B refuses an output of more than one element, as its
    full backward and ``torch.autograd.backward`` do; torch's B backpropagates ``ones_like`` (a sum)."""
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(pb.StageBackwardError, match=r"output_grads is None but the output has shape \(3, 4\)"):
        pb.stage_backward_input((mod(x),), None, [x], mod.parameters())
    assert all(p.grad is None for p in mod.parameters())
    if TORCH_2_13:
        (dx,), _ = upstream.stage_backward_input((mod(x),), None, [x], mod.parameters())
        assert torch.equal(dx, torch.autograd.grad(mod(x).sum(), x)[0])


def test_difference_more_output_gradients_than_outputs_are_refused():
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(pb.StageBackwardError, match="gradient has 2"):
        pb.stage_backward_input((mod(x),), (torch.ones(3, 4), torch.ones(3, 4)), [x], mod.parameters())
    if TORCH_2_13:  # torch pairs them by position and ignores the rest
        (dx,), _ = upstream.stage_backward_input((mod(x),), (torch.ones(3, 4), torch.ones(3, 4)), [x], mod.parameters())
        assert dx is not None


def test_difference_w_after_a_b_with_no_input_needing_grad_accumulates_every_weight():
    """No stage input requires grad (a frozen prefix, a first stage called through B): torch's B finds no
    input path, builds no param group, and its W gives no weight a gradient; ppbackward's W accumulates
    them all, as a full backward. (torch's schedules run a full backward on stage 0.)"""
    mod, ref = _stage(), _stage()
    x = torch.randn(3, 4)
    grads, groups = pb.stage_backward_input((mod(x),), (torch.ones(3, 4),), [x], mod.parameters())
    pb.stage_backward_weight(mod.parameters(), groups)
    ref(x).backward(torch.ones(3, 4))
    assert grads == (None,)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(mod.parameters(), ref.parameters()))
    if TORCH_2_13:
        theirs = _stage()
        _, groups = upstream.stage_backward_input((theirs(x),), (torch.ones(3, 4),), [x], theirs.parameters())
        upstream.stage_backward_weight(theirs.parameters(), groups)
        assert groups == [] and all(p.grad is None for p in theirs.parameters())


def test_difference_a_loss_in_a_tuple_without_output_grads_is_backpropagated():
    """``stage_backward((loss,), None, ...)``: torch's full backward skips a tuple whose gradient is ``None``
    and computes nothing, silently (its stage passes the loss itself); ppbackward takes ``None`` as the
    loss's implicit gradient, as for a bare loss."""
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    (dx,) = pb.stage_backward((mod(x).sum(),), None, [x])
    assert dx is not None and all(p.grad is not None for p in mod.parameters())
    if TORCH_2_13:
        theirs = _stage()
        assert upstream.stage_backward((theirs(x).sum(),), None, [x]) == (None,)
        assert all(p.grad is None for p in theirs.parameters())


def test_difference_param_groups_order_and_params_and_the_list_itself():
    """torch's groups follow ``weights`` (the first group holds the first weight) and ``group["params"]`` is
    a ``set``; ppbackward's groups follow the graph from the outputs and ``params`` is a tuple; torch's list
    can be changed (``pop``, ``del``), ppbackward's cannot: write zeros into a group's ``grads`` to drop it."""
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    _, groups = _b(pb, x, mod)
    first = {p.variable for p in groups[0]["params"]}
    assert any(q is mod[2].weight for q in first) and isinstance(groups[0]["params"], tuple)
    with pytest.raises(AttributeError):
        groups.pop()
    with pytest.raises(TypeError):
        del groups[0]
    if TORCH_2_13:
        _, theirs = _b(upstream, x.detach().clone().requires_grad_(), mod)
        assert any(p.variable is mod[0].weight for p in theirs[0]["params"])
        assert isinstance(theirs[0]["params"], set) and isinstance(theirs, list)


def test_difference_w_twice_raises_a_stage_backward_error():
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    _, groups = _b(pb, x, mod)
    pb.stage_backward_weight(mod.parameters(), groups)
    with pytest.raises(pb.StageBackwardError):
        pb.stage_backward_weight(mod.parameters(), groups)
    if TORCH_2_13:
        _, groups = _b(upstream, x.detach().clone().requires_grad_(), mod)
        upstream.stage_backward_weight(mod.parameters(), groups)
        with pytest.raises(KeyError, match="grads"):
            upstream.stage_backward_weight(mod.parameters(), groups)


def test_difference_weights_given_as_one_tensor_are_refused():
    """``weights=param`` (one tensor, not an iterable of them): torch iterates the tensor's rows, finds no
    weight and builds no group; ppbackward names it."""
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(TypeError, match="weights"):
        pb.stage_backward_input((mod(x),), (torch.ones(3, 4),), [x], mod[0].weight)
    if TORCH_2_13:
        _, groups = upstream.stage_backward_input((mod(x),), (torch.ones(3, 4),), [x], mod[0].weight)
        assert groups == []


def test_difference_b_takes_nested_outputs():
    """B on outputs nested as the full backward takes them (a dict in a tuple): torch's B takes a flat list of
    tensors; 2.13's fails on the dict, 2.15's skips it and computes nothing."""
    mod = _stage()
    x = torch.randn(3, 4, requires_grad=True)
    out = mod(x)
    nested, grads = ({"h": out, "n": 3},), ({"h": torch.ones(3, 4), "n": None},)
    (dx,), groups = pb.stage_backward_input(nested, grads, [x], mod.parameters())
    pb.stage_backward_weight(mod.parameters(), groups)
    ref = _stage()
    y = x.detach().requires_grad_()
    ref(y).backward(torch.ones(3, 4))
    assert torch.equal(dx, y.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(mod.parameters(), ref.parameters()))
    if TORCH_2_13 and not EDGE_ROOTS:
        with pytest.raises(AttributeError):
            upstream.stage_backward_input(({"h": mod(x)},), ({"h": torch.ones(3, 4)},), [x], mod.parameters())
    elif TORCH_2_13:  # 2.15 skips it: no input gradient, no param group, so its W gives no weight a gradient
        theirs = _stage()
        grads, groups = upstream.stage_backward_input(
            ({"h": theirs(x)},), ({"h": torch.ones(3, 4)},), [x], theirs.parameters()
        )
        upstream.stage_backward_weight(theirs.parameters(), groups)
        assert grads == (None,) and groups == [] and all(p.grad is None for p in theirs.parameters())


class _SharedBias(nn.Module):
    """A stage whose bias ``b * s`` is computed once and used by every microbatch (a weight-only node B runs:
    Note [cheap weight gradients in B])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4, bias=False)
        self.b = nn.Parameter(torch.randn(4))
        self.s = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + bias


@pytest.mark.skipif(not HOOKS_VISIBLE, reason="saved tensors are read for the refusal on torch 2.13+ only")
def test_difference_a_bias_computed_once_for_several_microbatches_is_refused_by_the_next_b():
    """A weight-only product taken once and used by two microbatches, W with ``retain_graph=True``: torch's B
    runs no weight-only node, so both microbatches run and the grads are a plain backward's; ppbackward's B
    computes the bias gradient itself and frees that node (Note [a weight-only node B runs was freed before]),
    so the second B refuses, naming the node, before anything runs: its input's ``.grad`` and every weight's
    ``.grad`` are as the first microbatch left them."""
    xs = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    mod = _SharedBias()
    bias = mod.b * mod.s
    outs = [mod(x, bias) for x in xs]
    _, groups = pb.stage_backward_input((outs[0],), (torch.ones(3, 4),), [xs[0]], mod.parameters())
    pb.stage_backward_weight(mod.parameters(), groups, retain_graph=True)
    before = [p.grad.clone() for p in mod.parameters()]
    fired: list[str] = []
    outs[1].register_hook(lambda g: fired.append("output"))
    refused = (r"MulBackward0, a weight-only node B runs .* cannot read its saved 'other': Trying to backward "
               r"through the graph a second time.*parametrize\.cached\(\).* Nothing was run")
    with pytest.raises(pb.StageBackwardError, match=refused):
        pb.stage_backward_input((outs[1],), (torch.ones(3, 4),), [xs[1]], mod.parameters())
    assert fired == [] and all(torch.equal(p.grad, g) for p, g in zip(mod.parameters(), before))
    with pytest.raises(pb.StageBackwardError, match=refused):  # the outputs were not left claimed
        pb.stage_backward_input((outs[1],), (torch.ones(3, 4),), [xs[1]], mod.parameters())
    # nothing was run: the input path of the graph is intact, its gradient a plain one's
    ref = _SharedBias()
    (dx,) = torch.autograd.grad(outs[1], xs[1], torch.ones(3, 4))
    (dx_ref,) = torch.autograd.grad(ref(xs[1], (ref.b * ref.s).detach()), xs[1], torch.ones(3, 4))
    assert fired == ["output"] and torch.equal(dx, dx_ref)
    if TORCH_2_13:
        theirs, ref = _SharedBias(), _SharedBias()
        bias, ref_bias = theirs.b * theirs.s, ref.b * ref.s
        for x in xs:
            _, groups = upstream.stage_backward_input(
                (theirs(x, bias),), (torch.ones(3, 4),), [x], theirs.parameters())
            upstream.stage_backward_weight(theirs.parameters(), groups, retain_graph=True)
            ref(x.detach(), ref_bias).backward(torch.ones(3, 4), retain_graph=True)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(theirs.parameters(), ref.parameters()))
