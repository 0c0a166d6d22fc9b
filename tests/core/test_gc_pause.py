"""Note [no collection inside B and W] (``ppbackward._gc_pause``): B and W start no automatic gc
collection, and leave the collector as they found it, on every path and across threads."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Iterator
from types import FrameType

import pytest
import torch
import torch.nn as nn

import ppbackward as pb
import ppbackward._handoff as _handoff
import ppbackward._weight_edges as _weight_edges
import ppbackward.backward as backward
from ppbackward._gc_pause import automatic_gc_paused
from ppbackward.leaks._gc_phase import full_collect


def _stage() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(16)]
    return nn.Sequential(*layers), torch.randn(2, 8, 16, requires_grad=True)


# B's and W's work: B's after its argument checks; W's chunks as they are made and run
_WORK = {backward._backward_input.__code__, _handoff._weight_work.__code__, _weight_edges.run_weight_work.__code__}


def _inside_work() -> bool:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _WORK:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _collections_started() -> Iterator[list[int]]:
    """Count the collections started inside B's and W's work (``_backward_input``, ``_weight_work``,
    ``run_weight_work``) in the block, with the collector enabled and a young-generation threshold of 50
    allocations (CPython's default is 700: W, down to the weight matmuls and little Python, makes about 300
    objects in one microbatch of this stage; at 200 the control's count in W was one, or none where the count B
    left made the collection start just before W's work), from allocation counts of 0 (a collection first). What
    B keeps for W may start one just after B returns: not counted."""
    started = [0]

    def count(phase: str, _info: dict) -> None:
        started[0] += phase == "start" and _inside_work()

    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(50, 10, 10)
    gc.enable()
    full_collect()  # every generation's count starts from 0
    gc.callbacks.append(count)
    try:
        yield started
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()


def _b_then_w(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Collections started inside B's work, then inside W's, of one microbatch."""
    out = model(x)
    with _collections_started() as in_b:
        _, groups = pb.stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
    del out
    with _collections_started() as in_w:
        pb.stage_backward_weight(model.parameters(), groups)
    return in_b[0], in_w[0]


def test_b_and_w_start_no_collection_where_they_used_to_start_several(monkeypatch):
    model, x = _stage()
    _b_then_w(model, x)  # warm-up
    assert _b_then_w(model, x) == (0, 0)
    monkeypatch.setattr(backward, "automatic_gc_paused", contextlib.nullcontext)  # the control
    in_b, in_w = _b_then_w(model, x)
    assert in_b >= 1 and in_w >= 1  # a 16-layer stage's analysis alone holds thousands of short-lived objects


def test_hooks_inside_b_and_w_see_the_collector_off_and_a_disable_there_is_undone():
    model, x = _stage()
    seen: list[tuple[str, bool]] = []
    out = model(x)
    out.register_hook(lambda g: seen.append(("B", gc.isenabled())) or gc.disable())
    weight = model[0].linear1.weight
    handle = weight.register_post_accumulate_grad_hook(lambda p: seen.append(("W", gc.isenabled())))
    was = gc.isenabled()
    gc.enable()
    try:
        _, groups = pb.stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
        assert gc.isenabled()  # the hook's gc.disable() was undone when B returned
        pb.stage_backward_weight(model.parameters(), groups)
        assert seen == [("B", False), ("W", False)] and gc.isenabled()
    finally:
        handle.remove()
        (gc.enable if was else gc.disable)()


def test_the_opt_out_leaves_the_collector_alone(monkeypatch):
    """``PPBACKWARD_PAUSE_GC=0`` (read at import) is ``_gc_pause.PAUSE``."""
    import ppbackward._gc_pause as pause

    monkeypatch.setattr(pause, "PAUSE", False)
    model, x = _stage()
    seen: list[bool] = []
    out = model(x)
    out.register_hook(lambda g: seen.append(gc.isenabled()))
    was = gc.isenabled()
    gc.enable()
    try:
        pb.stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
        assert seen == [True]
    finally:
        (gc.enable if was else gc.disable)()


def test_a_leak_checker_entered_on_another_thread_during_a_pause_restores_enabled():
    """A checker entered on another thread while a B paused the collector, and left after that B
    returned, used to restore "disabled" for good (it had saved gc.isenabled())."""
    from ppbackward.leaks import check_tensor_leaks

    was = gc.isenabled()
    gc.enable()
    paused, in_checker, b_done, checked = (threading.Event() for _ in range(4))

    def other() -> None:
        assert paused.wait(60)
        with check_tensor_leaks():
            in_checker.set()
            assert b_done.wait(60)
        checked.set()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        with automatic_gc_paused():  # what a B on this thread does
            paused.set()
            assert in_checker.wait(60)
        b_done.set()
        assert checked.wait(60)
        assert gc.isenabled()
    finally:
        paused.set()
        b_done.set()
        thread.join(60)
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False], ids=["gc-enabled", "gc-disabled"])
def test_the_collector_is_left_as_found_after_b_w_and_a_b_or_w_that_raised(enabled):
    model, x = _stage()
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        out = model(x)
        _, groups = pb.stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
        assert gc.isenabled() is enabled
        pb.stage_backward_weight(model.parameters(), groups)
        assert gc.isenabled() is enabled
        out = model(x)
        out.register_hook(lambda g: (_ for _ in ()).throw(KeyError("a hook's own error")))
        with pytest.raises(KeyError):
            pb.stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
        assert gc.isenabled() is enabled
        out = model(x)
        _, groups = pb.stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
        weight = model[0].linear1.weight
        handle = weight.register_post_accumulate_grad_hook(lambda p: (_ for _ in ()).throw(KeyError("in W")))
        try:
            with pytest.raises(KeyError):
                pb.stage_backward_weight(model.parameters(), groups)
        finally:
            handle.remove()
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_overlapping_pauses_of_two_threads_end_with_the_last_one():
    was = gc.isenabled()
    gc.enable()
    inside, first_left, done = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def other() -> None:
        with automatic_gc_paused():
            inside.set()
            first_left.wait(60)
            seen.append(gc.isenabled())  # the main thread left its pause: still paused for this one
        done.set()

    thread = threading.Thread(target=other)
    try:
        with automatic_gc_paused():
            thread.start()
            assert inside.wait(60)
        first_left.set()
        assert done.wait(60)
        thread.join(60)
        assert seen == [False] and gc.isenabled()
    finally:
        first_left.set()
        thread.join(60)
        (gc.enable if was else gc.disable)()
