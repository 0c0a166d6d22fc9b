"""Mistakes that used to fail late, deep inside autograd, or silently: each is now a clear error naming the
gradient, parameter, output or index, raised before anything accumulates (issue 21).

Note [captured gradients are checked at W] (``ppbackward._handoff``), Note [anomaly mode names W's
nodes] (``ppbackward._weight_edges``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ppbackward as pb
from ppbackward._saved import HOOKS_VISIBLE


def _stage(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _b(mod: nn.Module, grad: torch.Tensor):
    x = torch.randn(2, 4, requires_grad=True)
    return pb.stage_backward_input((mod(x),), (grad,), [x], mod.parameters())


# -- gradients B captured, changed in place before W --------------------------------------------


def test_an_output_gradient_buffer_zeroed_between_b_and_w_is_a_clear_error():
    """A stage that reuses its receive buffer: W would have accumulated zeros for the last layer's weight."""
    mod = _stage()
    grad = torch.ones(2, 3)
    _, groups = _b(mod, grad)
    grad.zero_()
    with pytest.raises(pb.StageBackwardError) as info:
        pb.stage_backward_weight(mod.parameters(), groups)
    message = str(info.value)
    assert message.startswith(
        "param_groups: the gradient B captured for AddmmBackward0's input 0 (torch.float32 [2, 3])"
    )
    assert "was modified in place after stage_backward_input (version 0 -> 1)" in message
    assert all(p.grad is None for p in mod.parameters())  # nothing accumulated
    assert groups.consumed and len(groups) == 0  # and nothing kept


def test_an_input_gradient_b_returned_changed_in_place_says_so():
    """``x + w``: the gradient reaching the stage input is the one B holds for W, returned as it is; a caller
    that scales it in place before W is told that the input gradients count too (hostile review)."""
    w = torch.nn.Parameter(torch.randn(3, 4))
    x = torch.randn(3, 4, requires_grad=True)
    (gx,), groups = pb.stage_backward_input((x + w,), (torch.randn(3, 4),), [x], [w])
    gx.mul_(0.5)
    with pytest.raises(pb.StageBackwardError, match="the input gradients B returned") as info:
        pb.stage_backward_weight([w], groups)
    assert "was modified in place after stage_backward_input (version 0 -> 1)" in str(info.value)
    assert w.grad is None


def test_a_view_of_the_buffer_changed_in_place_is_caught_too():
    mod = _stage()
    buffer = torch.ones(4, 3)
    _, groups = _b(mod, buffer[:2])  # the gradient is a view of a larger receive buffer
    buffer[3].fill_(5.0)  # another part of the same storage: the version counter is shared
    with pytest.raises(pb.StageBackwardError, match="was modified in place after stage_backward_input"):
        pb.stage_backward_weight(mod.parameters(), groups)


def test_gradients_left_alone_pass_the_check_and_w_is_exact():
    mod, ref = _stage(), _stage()
    x = torch.randn(2, 4, requires_grad=True)
    grad = torch.ones(2, 3)
    _, groups = pb.stage_backward_input((mod(x),), (grad,), [x], mod.parameters())
    pb.stage_backward_weight(mod.parameters(), groups)
    ref(x.detach()).backward(grad)
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_hook_of_an_earlier_chunk_changing_a_later_chunks_gradient_is_caught(monkeypatch):
    """W in chunks (one param group each here): a post-accumulate-grad hook fired by the first chunk changes
    in place a gradient only a later chunk reads; that chunk is checked again before it runs and refused."""
    import ppbackward._handoff as handoff

    monkeypatch.setattr(handoff, "_W_CHUNK_BYTES", 1)
    mod = _stage()
    x = torch.randn(2, 4, requires_grad=True)
    _, groups = pb.stage_backward_input((mod(x),), (torch.ones(2, 3),), [x], mod.parameters())
    assert len(groups) == 2
    first_layer_grad = groups[1]["grads"][0][0]  # what W reads for the first Linear (the later chunk)
    def hostile(_param) -> None:
        first_layer_grad.mul_(100.0)

    mod[2].weight.register_post_accumulate_grad_hook(hostile)
    with pytest.raises(pb.StageBackwardError) as info:
        pb.stage_backward_weight(mod.parameters(), groups)
    message = str(info.value)
    assert "was modified in place during stage_backward_weight (version 0 -> 1)" in message
    assert "this one and the later ones were not" in message
    assert mod[2].weight.grad is not None and mod[0].weight.grad is None  # the first chunk only
    assert groups.consumed and len(groups) == 0


# -- tensors the forward saved, changed in place before W (Note [saved tensors W reads are checked]) ------------


class _Einsum(nn.Module):
    """Two einsum layers: W calls their ``BmmBackward0`` nodes again, which saved the stage input and the
    hidden activation (not a linear layer's matmul, whose saved input B takes out and versions)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.randn(d, d))
        self.b = nn.Parameter(torch.randn(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.einsum("bsi,io->bso", x, self.a))
        return torch.einsum("bsi,io->bso", h, self.b)


_NO_HOOKS = pytest.mark.skipif(
    not HOOKS_VISIBLE,
    reason="this torch does not expose saved-tensor hooks to Python: W cannot name the saved tensor autograd refused",
)


@_NO_HOOKS
@pytest.mark.parametrize("check", [True, False], ids=["checked", "negative-control"])
def test_a_stage_input_changed_in_place_between_b_and_w_names_the_group_and_node(check, monkeypatch):
    """The stage input a ``BmmBackward0`` saved, changed in place after B: W refuses naming the group, the node
    and the saved tensor, before anything accumulates. Without the explanation (negative control) autograd's
    own message comes out of W's call of the node."""
    import ppbackward._weight_edges as weight_edges

    if not check:
        monkeypatch.setattr(weight_edges, "unreadable_saved_error", lambda *a: None)
    mod = _Einsum()
    x = torch.randn(2, 3, 4, requires_grad=True)
    _, groups = pb.stage_backward_input((mod(x),), (torch.ones(2, 3, 4),), [x], mod.parameters())
    with torch.no_grad():
        x.add_(1.0)
    if not check:
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as raw:
            pb.stage_backward_weight(mod.parameters(), groups)
        assert not isinstance(raw.value, pb.StageBackwardError)
        return
    with pytest.raises(pb.StageBackwardError) as info:
        pb.stage_backward_weight(mod.parameters(), groups)
    message = str(info.value)
    assert message.startswith("param_groups[")
    assert ": BmmBackward0, an intermediate W calls again for its weight gradients" in message
    assert "cannot read its saved 'self'" in message
    assert "is at version 1; expected version 0 instead" in message and "Hint" not in message
    assert message.endswith("W accumulates nothing")
    assert all(p.grad is None for p in mod.parameters())
    assert groups.consumed and len(groups) == 0


@_NO_HOOKS
def test_a_pinned_activation_changed_in_place_is_named_with_ppbackwards_own_check():
    """Given a loss, B pins the saved inputs of every node W runs (Note [outputs detached after B]): their
    unpack hook is ppbackward's, which checks the version itself. W's explanation reads through it and names
    the node (reading only tensors without any hook would find nothing and re-raise the bare message)."""
    mod = _Einsum()
    x = torch.randn(2, 3, 4, requires_grad=True)
    h = torch.tanh(torch.einsum("bsi,io->bso", x, mod.a))
    loss = torch.einsum("bsi,io->bso", h, mod.b).sum()
    _, groups = pb.stage_backward_input((loss,), None, [x], mod.parameters())
    with torch.no_grad():
        h.mul_(2.0)
    with pytest.raises(pb.StageBackwardError) as info:
        pb.stage_backward_weight(mod.parameters(), groups)
    message = str(info.value)
    assert ": BmmBackward0, an intermediate W calls again for its weight gradients, cannot read its saved" in message
    assert "Checked by ppbackward" in message and message.endswith("W accumulates nothing")
    assert all(p.grad is None for p in mod.parameters())


def _hooked_weight_and_changed_input(explain: bool, monkeypatch) -> tuple[int, BaseException]:
    """B on the einsum stage, then a caller's saved-tensor hooks on the weight each ``BmmBackward0`` saved
    (registered after B) and the stage input changed in place; W's error and how often the unpack hook ran."""
    import ppbackward._weight_edges as weight_edges

    if not explain:
        monkeypatch.setattr(weight_edges, "unreadable_saved_error", lambda *a: None)
    mod = _Einsum()
    x = torch.randn(2, 3, 4, requires_grad=True)
    _, groups = pb.stage_backward_input((mod(x),), (torch.ones(2, 3, 4),), [x], mod.parameters())
    unpacked: list = []

    def unpack(t):
        unpacked.append(t)
        return t

    for group in groups:
        for node in group["intermediates"]:
            node._raw_saved_mat2.register_hooks(lambda t: t, unpack)
    with torch.no_grad():
        x.add_(1.0)
    with pytest.raises(RuntimeError) as info:
        pb.stage_backward_weight(mod.parameters(), groups)
    monkeypatch.undo()
    return len(unpacked), info.value


@_NO_HOOKS
def test_the_explanation_runs_no_unpack_hook_of_a_callers_saved_tensor(monkeypatch):
    """A caller's saved-tensor hooks on one tensor a node W calls saved, another (the stage input) changed in
    place: the explanation names the changed one and runs the caller's unpack hook no more often than W's call
    of the node did without it (the negative control's count)."""
    runs, error = _hooked_weight_and_changed_input(True, monkeypatch)
    runs_without, raw = _hooked_weight_and_changed_input(False, monkeypatch)
    assert isinstance(error, pb.StageBackwardError) and "cannot read its saved 'self'" in str(error)
    assert not isinstance(raw, pb.StageBackwardError)
    assert runs == runs_without


class _LastStage(nn.Module):
    """A last stage whose input needs no grad (B is given the loss, W runs the whole graph): B pins what W's
    nodes saved (Note [outputs detached after B] in ``ppbackward._saved``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.einsum("bsi,io->bso", x, self.a)
        return h, torch.einsum("bsi,io->bso", h, self.b).square().sum()


@_NO_HOOKS
@pytest.mark.parametrize("checked", [True, False], ids=["pinned-after-check", "negative-control"])
def test_an_activation_changed_between_the_forward_and_b_is_refused_as_by_a_full_backward(checked, monkeypatch):
    """The activation ``h`` changed in place after the forward, before B (hostile review). A full backward
    refuses it (autograd's version check); so does W, because B pins a saved tensor only once autograd's check
    passed. Pinned without that check (negative control), the pin records the changed version and W silently
    computes ``b``'s gradient from the changed ``h``."""
    import ppbackward._saved as saved

    if not checked:
        real = saved._pin
        monkeypatch.setattr(saved, "_pin", lambda item, t, node, pack, checked=False: real(item, t, node, pack, True))
    x = torch.randn(2, 3, 4)  # a received activation: needs no grad
    ref = _LastStage()
    h, loss = ref(x)
    with torch.no_grad():
        h.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    mod = _LastStage()
    h, loss = mod(x)
    with torch.no_grad():
        h.mul_(2.0)
    _, groups = pb.stage_backward_input((loss,), None, [x], mod.parameters())
    if not checked:
        pb.stage_backward_weight(mod.parameters(), groups)  # silently: b's gradient from the changed h
        clean = _LastStage()
        clean(x)[1].backward()
        assert not torch.equal(mod.b.grad, clean.b.grad)
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pb.stage_backward_weight(mod.parameters(), groups)
    assert groups.consumed and len(groups) == 0


class _RaisesWhenRunAgain(torch.autograd.Function):
    """Passes both gradients through in B; run again by W from written gradients, raises a RuntimeError of its
    own (one that is not about a saved tensor)."""

    calls = 0

    @staticmethod
    def forward(ctx, a, w):
        return a.view_as(a), w.view_as(w)

    @staticmethod
    def backward(ctx, ga, gw):
        _RaisesWhenRunAgain.calls += 1
        if _RaisesWhenRunAgain.calls > 1:
            raise RuntimeError("a custom backward's own error")
        return ga, gw


@_NO_HOOKS
def test_another_error_of_ws_node_calls_comes_out_as_it_was():
    """W's explanation looks only at the call that raised, and only explains a saved tensor it cannot read: in
    one param group, a custom Function W runs again from written gradients raises its own error before W calls
    an einsum node whose saved activation was changed in place; the custom error comes out unchanged (review:
    looking at every call blamed the einsum node)."""
    _RaisesWhenRunAgain.calls = 0
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 3, 4, requires_grad=True)
    a, w2 = _RaisesWhenRunAgain.apply(x, w)
    h = torch.tanh(x)  # saved by the einsum node below
    y = torch.einsum("bsi,io->bso", h, w)
    for _ in range(6):  # deeper than the custom node: W calls the einsum node after it
        y = y.tanh()
    out = y + torch.einsum("bsi,io->bso", a, w2)
    _, groups = pb.stage_backward_input((out,), (torch.ones(2, 3, 4),), [x], [w])
    (group,) = groups
    custom, einsum = group["intermediates"]
    assert (type(custom).__name__, type(einsum).__name__) == ("_RaisesWhenRunAgainBackward", "BmmBackward0")
    group["grads"] = [tuple(torch.ones(m.shape) for m in custom._input_metadata), None]
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="a custom backward's own error") as info:
        pb.stage_backward_weight([w], groups)
    assert not isinstance(info.value, pb.StageBackwardError)
    assert w.grad is None


def test_saved_tensors_left_alone_pass_the_check_and_w_is_exact():
    mod, ref = _Einsum(), _Einsum()
    x = torch.randn(2, 3, 4, requires_grad=True)
    grad = torch.randn(2, 3, 4)
    for p in mod.parameters():
        p.grad = torch.ones_like(p)  # accumulating
    _, groups = pb.stage_backward_input((mod(x),), (grad,), [x], mod.parameters())
    pb.stage_backward_weight(mod.parameters(), groups)
    for p in ref.parameters():
        p.grad = torch.ones_like(p)
    ref(x.detach()).backward(grad)
    for p, q in zip(mod.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


@_NO_HOOKS
def test_a_hook_of_an_earlier_chunk_changing_a_later_chunks_saved_tensor_is_caught(monkeypatch):
    """One param group per chunk: a post-accumulate-grad hook of the first chunk changes in place the stage
    input the later chunk's node saved; that chunk is refused before it accumulates, and the error says the
    earlier one was."""
    import ppbackward._handoff as handoff

    monkeypatch.setattr(handoff, "_W_CHUNK_BYTES", 1)
    mod = _Einsum()
    x = torch.randn(2, 3, 4, requires_grad=True)
    out = mod(x)
    _, groups = pb.stage_backward_input((out,), (torch.ones(2, 3, 4),), [x], mod.parameters())
    assert len(groups) == 2
    fired: list = []

    def hostile(param) -> None:
        if not fired:
            fired.append(param)
            with torch.no_grad():
                x.add_(1.0)

    for p in mod.parameters():
        p.register_post_accumulate_grad_hook(hostile)
    with pytest.raises(pb.StageBackwardError) as info:
        pb.stage_backward_weight(mod.parameters(), groups)
    message = str(info.value)
    assert message.startswith("param_groups[1]: BmmBackward0,") and "cannot read its saved 'self'" in message
    assert "the earlier chunks were accumulated, this one and the later ones were not" in message
    assert [p.grad is not None for p in mod.parameters()].count(True) == 1  # the first chunk only
    assert groups.consumed and len(groups) == 0


class _MergedWeight(nn.Module):
    """A weight computed from two parameters (``a @ b``, a merged low-rank update): its ``MmBackward0`` is a
    weight-only node W's accumulating call runs, which saved both parameters; a norm after it gets its
    gradients in B (Note [cheap weight gradients in B]), so W's one accumulating call has them too."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.randn(d, d))
        self.b = nn.Parameter(torch.randn(d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, merged: torch.Tensor | None = None) -> torch.Tensor:
        return self.norm(x @ (self.a @ self.b if merged is None else merged))


def _unchecked(monkeypatch) -> None:
    """The negative control: W reads nothing ahead (every saved tensor looks readable)."""
    import ppbackward._handoff as handoff

    monkeypatch.setattr(handoff, "unreadable_saved", lambda node: None)


@_NO_HOOKS
@pytest.mark.parametrize("check", [True, False], ids=["checked", "negative-control"])
def test_a_weight_changed_in_place_that_a_weight_only_node_saved_is_refused_before_anything_accumulates(
    check, monkeypatch
):
    """``a`` changed in place between B and W: autograd refuses the ``MmBackward0`` inside W's accumulating call,
    after the norm's parameters accumulated there. W reads the weight-only nodes' saved tensors first and refuses
    naming the group, the node and the tensor, every ``.grad`` untouched (torch's split leaves them untouched too).
    Without the check (negative control) autograd's message comes out with the norm's ``.grad`` half of the
    microbatch accumulated."""
    if not check:
        _unchecked(monkeypatch)
    mod = _MergedWeight()
    x = torch.randn(3, 4, requires_grad=True)
    out = mod(x)
    _, groups = pb.stage_backward_input((out,), (torch.ones_like(out),), [x], mod.parameters())
    with torch.no_grad():
        mod.a.mul_(2.0)
    if not check:
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as raw:
            pb.stage_backward_weight(mod.parameters(), groups)
        assert not isinstance(raw.value, pb.StageBackwardError)
        assert mod.norm.weight.grad is not None and mod.a.grad is None  # half of the microbatch
        return
    with pytest.raises(pb.StageBackwardError) as info:
        pb.stage_backward_weight(mod.parameters(), groups)
    message = str(info.value)
    assert message.startswith("param_groups[")
    assert ": MmBackward0, a weight-only node W runs, cannot read its saved 'self'" in message
    assert "is at version 1; expected version 0 instead" in message and message.endswith("W accumulates nothing")
    assert all(p.grad is None for p in mod.parameters())
    assert groups.consumed and len(groups) == 0


@_NO_HOOKS
@pytest.mark.parametrize("check", [True, False], ids=["checked", "negative-control"])
def test_a_weight_only_graph_freed_by_an_earlier_microbatchs_w_is_refused_before_anything_accumulates(
    check, monkeypatch
):
    """One merged weight computed once and used by two microbatches: the first W runs and frees its
    ``MmBackward0`` (as a first full backward would); the second W refuses naming it, every ``.grad`` as the first
    W left it. Without the check (negative control) autograd's "backward through the graph a second time" comes
    out of the second W with the norm's gradients accumulated once more."""
    if not check:
        _unchecked(monkeypatch)
    mod = _MergedWeight()
    merged = mod.a @ mod.b
    groups = []
    for _ in range(2):
        x = torch.randn(3, 4, requires_grad=True)
        out = mod(x, merged)
        groups.append(pb.stage_backward_input((out,), (torch.ones_like(out),), [x], mod.parameters())[1])
    pb.stage_backward_weight(mod.parameters(), groups[0])
    before = [p.grad.clone() for p in mod.parameters()]
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as info:
        pb.stage_backward_weight(mod.parameters(), groups[1])
    changed = [not torch.equal(p.grad, q) for p, q in zip(mod.parameters(), before)]
    if not check:
        assert not isinstance(info.value, pb.StageBackwardError) and any(changed)
        return
    message = str(info.value)
    assert isinstance(info.value, pb.StageBackwardError) and ": MmBackward0, a weight-only node W runs" in message
    assert message.endswith("W accumulates nothing") and not any(changed)


def test_weight_only_nodes_left_alone_pass_the_check_and_w_is_exact():
    mod, ref = _MergedWeight(), _MergedWeight()
    x = torch.randn(3, 4, requires_grad=True)
    grad = torch.randn(3, 4)
    for p, q in zip(mod.parameters(), ref.parameters()):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)  # accumulating
    _, groups = pb.stage_backward_input((mod(x),), (grad,), [x], mod.parameters())
    pb.stage_backward_weight(mod.parameters(), groups)
    ref(x.detach()).backward(grad)
    for p, q in zip(mod.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


# -- calls inside a torch.func transform ------------------------------------------------------------------


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "negative-control"])
def test_w_inside_a_torch_func_transform_is_refused_before_anything_runs(refused, monkeypatch):
    """As ``torch.autograd.backward`` refuses inside ``torch.func.grad`` (hostile review): W refuses before it
    claims ``param_groups``, which then runs exactly outside the transform. Without the refusal (negative
    control) W fails inside with another error, after claiming them."""
    import ppbackward.backward as backward

    if not refused:
        monkeypatch.setattr(backward, "_refuse_in_functorch_transform", lambda name: None)
    mod, ref = _Einsum(), _Einsum()
    x = torch.randn(2, 3, 4, requires_grad=True)
    grad = torch.randn(2, 3, 4)
    _, groups = pb.stage_backward_input((mod(x),), (grad,), [x], mod.parameters())

    def inside(y: torch.Tensor) -> torch.Tensor:
        pb.stage_backward_weight(mod.parameters(), groups)
        return (y * 2).sum()

    with pytest.raises(Exception) as info:  # the negative control's error is torch's, of any kind
        torch.func.grad(inside)(torch.ones(2))
    if not refused:
        assert not isinstance(info.value, pb.StageBackwardError) and groups.consumed
        return
    assert isinstance(info.value, pb.StageBackwardError)
    assert str(info.value).startswith("stage_backward_weight called inside a torch.func transform")
    assert not groups.consumed and all(p.grad is None for p in mod.parameters())
    pb.stage_backward_weight(mod.parameters(), groups)
    ref(x.detach()).backward(grad)
    for p, q in zip(mod.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("which", ["stage_backward", "stage_backward_input"])
def test_b_and_the_full_backward_inside_a_torch_func_transform_are_refused(which):
    mod = _Einsum()
    x = torch.randn(2, 3, 4, requires_grad=True)
    out = mod(x)

    def inside(y: torch.Tensor) -> torch.Tensor:
        if which == "stage_backward":
            pb.stage_backward((out,), (torch.ones_like(out),), [x])
        else:
            pb.stage_backward_input((out,), (torch.ones_like(out),), [x], mod.parameters())
        return (y * 2).sum()

    with pytest.raises(pb.StageBackwardError, match=f"^{which} called inside a torch.func transform"):
        torch.func.grad(inside)(torch.ones(2))
    assert x.grad is None and all(p.grad is None for p in mod.parameters())
    (gx,) = pb.stage_backward((out,), (torch.ones_like(out),), [x])  # nothing ran: the graph is intact
    assert gx is not None


def test_writing_grads_once_w_has_started_is_refused():
    """A hook of W (or another thread) writing ``group["grads"]`` after W checked them: refused."""
    mod = _stage()
    _, groups = _b(mod, torch.ones(2, 3))
    group = groups[1]
    refused = []

    def write(_p):
        try:
            group["grads"] = [None]
        except pb.StageBackwardError as e:
            refused.append(str(e))

    mod[2].weight.register_post_accumulate_grad_hook(write)
    pb.stage_backward_weight(mod.parameters(), groups)
    assert refused and "stage_backward_weight has started on these param groups" in refused[0]


def test_a_written_entry_without_any_gradient_is_refused():
    """``(None,)`` would make W call the node on nothing (it raised a bare StopIteration out of W, which ends a
    caller's loop silently); None keeps what B captured."""
    mod = _stage()
    _, groups = _b(mod, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['grads'\]\[0\]: no gradient for AddmmBackward0"):
        groups[0]["grads"] = [(None,)]
    groups[0]["grads"] = [None]  # keeps B's
    pb.stage_backward_weight(mod.parameters(), groups)
    assert all(p.grad is not None for p in mod.parameters())


def test_changing_an_item_of_a_read_entry_says_to_write_the_whole_key():
    """torch's entries are lists; ours are read-only copies, and changing an item of one says what to do."""
    mod = _stage()
    _, groups = _b(mod, torch.ones(2, 3))
    grads = groups[0]["grads"]
    assert grads == tuple(grads) and isinstance(grads, tuple)
    with pytest.raises(TypeError, match=r"write the whole list, group\['grads'\] = \[\.\.\.\]"):
        grads[0] = None
    pb.stage_backward_weight(mod.parameters(), groups)


def test_writing_grads_of_a_group_b_finished_names_it_and_says_why():
    """A LayerNorm's group has no intermediate W computes from (B computed its gradients): a write into it
    names the group and says there is nothing to write."""
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    _, groups = _b(mod, torch.ones(2, 3))
    finished = [i for i, group in enumerate(groups) if not group["intermediates"]]
    assert finished, "the LayerNorm's group"
    i = finished[0]
    with pytest.raises(ValueError, match=rf"param_groups\[{i}\]\['grads'\]: 1 entries for a group with no "):
        groups[i]["grads"] = [(torch.ones(2, 6),)]
    pb.stage_backward_weight(mod.parameters(), groups)
    assert all(p.grad is not None for p in mod.parameters())


# -- a parameter resized in place between B and W ------------------------------------------------


@pytest.mark.parametrize("grads_before", [False, True], ids=["first-microbatch", "accumulating"])
def test_a_parameter_resized_between_b_and_w_is_named_and_nothing_accumulates(grads_before):
    mod = _stage()
    if grads_before:
        for p in mod.parameters():
            p.grad = torch.zeros_like(p)
    before = [None if p.grad is None else p.grad.clone() for p in mod.parameters()]
    _, groups = _b(mod, torch.ones(2, 3))
    with torch.no_grad():
        mod[2].weight.data = torch.randn(3, 7)
    with pytest.raises(pb.StageBackwardError) as info:
        pb.stage_backward_weight(mod.parameters(), groups)
    assert str(info.value) == (
        "weights[2]: parameter of shape (3, 6) at stage_backward_input now has shape (3, 7) (changed in place "
        "between B and W); W accumulates nothing"
    )
    assert isinstance(info.value, ValueError)
    for p, b in zip(mod.parameters(), before):  # every .grad as it was (the biases used to be accumulated)
        assert (p.grad is None) if b is None else torch.equal(p.grad, b)


# -- output gradients of another layout -----------------------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["full", "split"])
def test_a_sparse_output_gradient_is_refused_naming_the_output(split):
    mod = _stage()
    x = torch.randn(2, 4, requires_grad=True)
    sparse = torch.ones(2, 3).to_sparse()
    with pytest.raises(pb.StageBackwardError) as info:
        if split:
            pb.stage_backward_input((mod(x),), (sparse,), [x], mod.parameters())
        else:
            pb.stage_backward((mod(x),), (sparse,), [x])
    assert str(info.value) == "stage_output[0]: grad layout torch.sparse_coo != output layout torch.strided"
    assert isinstance(info.value, TypeError)
    assert x.grad is None and all(p.grad is None for p in mod.parameters())
    with pytest.raises(NotImplementedError, match="SparseCPU"):  # what plain autograd does with it
        mod(x).backward(sparse)


# -- outputs_with_grads_idxs ----------------------------------------------------------------------


@pytest.mark.parametrize("idx", [5, -4])
def test_outputs_with_grads_idxs_out_of_range_names_the_index_and_length(idx):
    mod = _stage()
    x = torch.randn(2, 4, requires_grad=True)
    out = mod(x)
    with pytest.raises(pb.StageBackwardError) as info:
        pb.stage_backward([out, out * 2, out * 3], [torch.ones(2, 3)] * 3, [x], outputs_with_grads_idxs=[0, idx])
    assert str(info.value) == f"outputs_with_grads_idxs: index {idx} is out of range for stage_output of length 3"
    assert isinstance(info.value, IndexError)  # the type torch's own indexing raises
    assert x.grad is None and all(p.grad is None for p in mod.parameters())
    (gx,) = pb.stage_backward([out, out * 2], [torch.ones(2, 3)] * 2, [x], outputs_with_grads_idxs=[-1])
    assert gx is not None  # a negative index in range still selects, as torch's does


# -- anomaly mode ---------------------------------------------------------------------------------


def test_a_nan_made_in_w_under_detect_anomaly_names_the_op_that_made_it():
    """The weight gradient of a linear layer is ``grad^T @ x``: an ``inf`` in ``x`` under a zero gradient row
    gives NaN there only (B's input gradient ``grad @ W`` stays finite). torch's split names
    AddmmBackward0; W used to blame ``torch::autograd::GraphRoot``."""
    torch.manual_seed(0)
    mod = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    x[1, 2] = float("inf")
    x.requires_grad_()
    grad = torch.ones(2, 3)
    grad[1] = 0
    with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly():
        warnings.simplefilter("always")
        (dx,), groups = pb.stage_backward_input((mod(x),), (grad,), [x], mod.parameters())
        assert torch.isfinite(dx).all()
        with pytest.raises(RuntimeError, match=r"^Function 'AddmmBackward0' returned nan values in its 2th output\.$"):
            pb.stage_backward_weight(mod.parameters(), groups)
    traces = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
    assert traces and traces[-1].startswith("Error detected in AddmmBackward0.")
    assert "test_late_errors.py" in traces[-1]  # the forward call's own line
    assert mod.weight.grad is None  # raised before the accumulating call
