"""B and W run once per microbatch, also under re-entry and threads (Note [W claims param_groups first],
Note [B claims its outputs]): a second call is refused with a clear error before it runs anything, and the
first call's result stays exact.

Threaded tests are deterministic: the first call is held inside one of its own hooks by an event that only
the second thread sets, after its call has returned or raised. A wait that expires fails the test; no
verdict depends on how long anything takes.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import ppbackward as pb
from ppbackward._saved import HOOKS_VISIBLE
from tests.core.stages import Scale

_WAIT = 60.0  # a safety net against a hang; never reached when the code works


def _stage(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _reference(
    mod: nn.Module, x: torch.Tensor, grad: torch.Tensor
) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """Parameter and input grads of one plain backward of a copy of ``mod``."""
    ref = copy.deepcopy(mod)
    rx = x.detach().clone().requires_grad_()
    ref(rx).backward(grad)
    return [p.grad for p in ref.parameters()], rx.grad


def _assert_exact(mod: nn.Module, expected: list[torch.Tensor]) -> None:
    for p, q in zip(mod.parameters(), expected):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q, rtol=0, atol=0)


def _run_in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _race(call, inside: threading.Event, go_on: threading.Event) -> dict[str, object]:
    """Run ``call`` on two threads: the first until a hook of its own sets ``inside`` and waits for
    ``go_on``; the second while the first is held there, setting ``go_on`` when it is done. Returns what
    each returned or raised, under ``"first"`` and ``"second"``."""
    results: dict[str, object] = {}

    def first() -> None:
        try:
            results["first"] = call()
        except BaseException as e:
            results["first"] = e

    def second() -> None:
        try:
            assert inside.wait(_WAIT), "the first call never reached its hook"
            results["second"] = call()
        except BaseException as e:
            results["second"] = e
        finally:
            go_on.set()

    threads = [_run_in_thread(first), _run_in_thread(second)]
    for t in threads:
        t.join(_WAIT)
    return results


# -- W ------------------------------------------------------------------------------------------


def test_w_called_again_from_its_own_post_accumulate_hook_is_refused_and_grads_are_not_doubled():
    """The issue's repro: a post-accumulate-grad hook that calls W on the same param_groups (a silent 2x
    before: ``param_groups`` was marked consumed only when W finished)."""
    mod = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    grad = torch.ones(2, 3)
    expected, _ = _reference(mod, x, grad)
    (_,), groups = pb.stage_backward_input((mod(x),), (grad,), [x], mod.parameters())
    errors: list[BaseException] = []
    calls = []

    def hook(_p: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 1:
            try:
                pb.stage_backward_weight(mod.parameters(), groups)
            except pb.StageBackwardError as e:
                errors.append(e)

    mod.weight.register_post_accumulate_grad_hook(hook)
    pb.stage_backward_weight(mod.parameters(), groups)
    assert len(errors) == 1 and "param_groups: already consumed by an earlier stage_backward_weight" in str(errors[0])
    _assert_exact(mod, expected)
    assert torch.equal(mod.bias.grad, torch.full((3,), 2.0))  # a full backward's value, not 4


def test_two_threads_running_w_on_the_same_param_groups_one_runs_the_other_is_refused():
    mod = _stage()
    x = torch.randn(2, 4, requires_grad=True)
    grad = torch.ones(2, 3)
    expected, _ = _reference(mod, x, grad)
    (_,), groups = pb.stage_backward_input((mod(x),), (grad,), [x], mod.parameters())
    inside, go_on = threading.Event(), threading.Event()
    calls = []

    def hold_the_first(_g: torch.Tensor) -> None:  # a tensor hook of the first W, before accumulation
        calls.append(threading.get_ident())
        if len(calls) == 1:
            inside.set()
            assert go_on.wait(_WAIT), "the second thread never finished its W"

    mod[0].weight.register_hook(hold_the_first)
    results = _race(lambda: pb.stage_backward_weight(mod.parameters(), groups), inside, go_on)
    assert "first" in results and not isinstance(results["first"], BaseException), results
    error = results["second"]
    assert isinstance(error, pb.StageBackwardError), results
    assert "already consumed by an earlier stage_backward_weight call (finished, or still running" in str(error)
    assert len(calls) == 1  # the refused W ran nothing
    _assert_exact(mod, expected)


# -- B ------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not HOOKS_VISIBLE,
    reason="this torch does not expose saved-tensor hooks to Python: B cannot see an earlier B's release",
)
def test_a_refused_second_b_runs_nothing_and_leaves_the_first_microbatchs_w_intact():
    """The issue's repro: a view output cannot be detached in place, so a second B reached the graph; the
    first B's release hooks made it look hooked, it ran without retaining the graph and freed it."""
    mod = _stage()
    x = torch.randn(2, 4, requires_grad=True)
    grad = torch.ones(3)
    ref = copy.deepcopy(mod)
    ref(x.detach().clone().requires_grad_())[0].backward(grad)
    h = mod[1](mod[0](x))
    seen = []
    h.register_hook(lambda g: seen.append(1))
    view = mod[2](h)[0]
    _, groups = pb.stage_backward_input((view,), (grad,), [x], mod.parameters())
    assert len(seen) == 1
    refused = "already backpropagated by an earlier stage_backward_input"
    with pytest.raises(pb.StageBackwardError, match=refused) as info:
        pb.stage_backward_input((view,), (grad,), [x], mod.parameters())
    assert isinstance(info.value, RuntimeError)
    assert len(seen) == 1  # nothing ran: the activation's hook did not fire again
    pb.stage_backward_weight(mod.parameters(), groups)
    _assert_exact(mod, [p.grad for p in ref.parameters()])


@pytest.mark.parametrize("cause", ["second-b", "hook-with-autograd-s-words"])
def test_a_second_b_through_a_custom_function_names_it_and_a_hook_s_own_error_comes_through(cause):
    """Note [a graph freed under a compiled region]: a view output of a custom Function (``Scale``), backpropagated
    by B a second time, gets B's error naming the node (autograd's chained); the first microbatch's W stays exact.
    The negative control: a hook raising a ``RuntimeError`` with autograd's very words on a first B comes through
    as it was raised, not as B's error."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    out = Scale.apply(x, w).view(-1)
    grad = torch.ones(12)
    if cause == "second-b":
        _, groups = pb.stage_backward_input((out,), (grad,), [x], [w])
        with pytest.raises(pb.StageBackwardError, match=r"already backpropagated by an earlier .*\(ScaleBackward"):
            pb.stage_backward_input((out,), (grad,), [x], [w])
        assert w.grad is None
        pb.stage_backward_weight([w], groups)
        torch.testing.assert_close(w.grad, x.detach().sum(0), rtol=0, atol=0)
        return
    words = "Trying to backward through the graph a second time (raised by a hook)"

    def hook(_g: torch.Tensor) -> None:
        raise RuntimeError(words)

    out.register_hook(hook)
    with pytest.raises(RuntimeError, match=r"\(raised by a hook\)") as info:
        pb.stage_backward_input((out,), (grad,), [x], [w])
    assert type(info.value) is RuntimeError and w.grad is None


def test_b_called_again_from_a_hook_it_fires_is_refused():
    mod = _stage()
    x = torch.randn(2, 4, requires_grad=True)
    grad = torch.ones(2, 3)
    expected, expected_dx = _reference(mod, x, grad)
    h = mod[1](mod[0](x))
    out = mod[2](h)
    errors: list[BaseException] = []
    calls = []

    def again(_g: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) > 1:
            return
        try:
            pb.stage_backward_input((out,), (grad,), [x], mod.parameters())
        except pb.StageBackwardError as e:
            errors.append(e)

    h.register_hook(again)
    (dx,), groups = pb.stage_backward_input((out,), (grad,), [x], mod.parameters())
    assert len(errors) == 1 and len(calls) == 1, "the re-entrant B was not refused"
    assert "differentiable output 0 is being backpropagated by another stage_backward_input call" in str(errors[0])
    pb.stage_backward_weight(mod.parameters(), groups)
    torch.testing.assert_close(dx, expected_dx, rtol=0, atol=0)
    _assert_exact(mod, expected)


def test_two_threads_running_b_on_the_same_outputs_one_runs_the_other_is_refused():
    mod = _stage()
    x = torch.randn(2, 4, requires_grad=True)
    grad = torch.ones(2, 3)
    expected, expected_dx = _reference(mod, x, grad)
    h = mod[1](mod[0](x))
    out = mod[2](h)
    inside, go_on = threading.Event(), threading.Event()
    calls = []

    def hold_the_first(_g: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 1:
            inside.set()
            assert go_on.wait(_WAIT), "the second thread never finished its B"

    h.register_hook(hold_the_first)
    results = _race(lambda: pb.stage_backward_input((out,), (grad,), [x], mod.parameters()), inside, go_on)
    error = results["second"]
    assert isinstance(error, pb.StageBackwardError), results
    assert "is being backpropagated by another stage_backward_input call, still running" in str(error)
    assert len(calls) == 1  # the refused B ran nothing
    (dx,), groups = results["first"]
    pb.stage_backward_weight(mod.parameters(), groups)
    torch.testing.assert_close(dx, expected_dx, rtol=0, atol=0)
    _assert_exact(mod, expected)


def test_outputs_are_released_after_b_so_the_next_microbatch_is_not_refused():
    """The claim ends with B (also when B raises): new outputs with a reused id are accepted."""
    mod = _stage()
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        out = mod(x)
        handle = out.register_hook(lambda g: (_ for _ in ()).throw(KeyError("from a user hook")))
        with pytest.raises(KeyError, match="from a user hook"):  # raised inside B's engine call
            pb.stage_backward_input((out,), (torch.ones(2, 3),), [x], mod.parameters())
        handle.remove()
        _, groups = pb.stage_backward_input((out,), (torch.ones(2, 3),), [x], mod.parameters())
        pb.stage_backward_weight(mod.parameters(), groups)
    from ppbackward import backward

    assert backward._IN_B == {}


def test_b_again_after_a_b_that_failed_part_way_says_so():
    """A hook raising in B ends B part-way, and what B's engine call ran is freed (B keeps no graph); B again on
    those outputs is refused naming both causes, without the claim that a W of this microbatch exists. torch's
    B kept the graph (``retain_graph=True``): its retry runs (docs/api.md, the differences; hostile review)."""
    torch.manual_seed(0)
    mod = _stage()
    x = torch.randn(5, 4, requires_grad=True)
    h = mod[0](x)
    calls: list[int] = []

    def hook(_g: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("transient")

    h.register_hook(hook)
    out = mod[2](mod[1](h))
    with pytest.raises(KeyError, match="transient"):
        pb.stage_backward_input((out,), (torch.ones_like(out),), [x], mod.parameters())
    if not HOOKS_VISIBLE:  # torch < 2.13: B keeps the graph where W calls nodes again, so the retry runs, as torch's
        _, groups = pb.stage_backward_input((out,), (torch.ones_like(out),), [x], mod.parameters())
        pb.stage_backward_weight(mod.parameters(), groups)
        ref = copy.deepcopy(mod)
        for p in ref.parameters():
            p.grad = None
        ref(x.detach()).backward(torch.ones_like(out))
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(mod.parameters(), ref.parameters()))
        return
    with pytest.raises(pb.StageBackwardError, match=r"or by a B that failed part-way .*run that microbatch's forward "
                       r"again.*Nothing was run: if an earlier B returned, its W is intact"):
        pb.stage_backward_input((out,), (torch.ones_like(out),), [x], mod.parameters())
    assert all(p.grad is None for p in mod.parameters()) and len(calls) == 1
