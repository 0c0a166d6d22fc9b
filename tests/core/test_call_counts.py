"""B + W enter at most 2 Python frames per autograd node of the stage on the default path (issue #36).

Counted, not timed (Note [counted host cost] in ``ppbackward._tools.bench.calls``): ``sys.setprofile``'s
``"call"`` events while one microbatch's B and W run on a fresh forward of the bench stage, grads
accumulating. A count does not move with the machine's load, so the bound is exact on any machine. What
keeps it low: Note [no frame per node] and Note [one frame per capture] in ``ppbackward.backward``.
"""

from __future__ import annotations

import gc
import sys
from typing import NamedTuple

import pytest

import ppbackward._gc_pause as pause
import ppbackward._tools.bench.calls as calls_module
from ppbackward._tools.bench.calls import CallCounts, count_calls, count_slow_path
from ppbackward._tools.bench.impls import UPSTREAM_B, UPSTREAM_W
from ppbackward._tools.harness.models import Config

# the bench stages of the issue: 4 x d 16 x seq 4 (225 nodes) and 16 x d 64 x seq 16 (897 nodes)
CONFIGS = [Config(4, 16, 4), Config(16, 64, 16)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_b_and_w_enter_at_most_two_python_frames_per_node(cfg):
    counts = count_calls(cfg)
    assert counts.nodes > 200
    assert counts.bw <= 2 * counts.nodes, counts
    assert counts.w <= 100, counts  # W's frames do not grow with the graph: one chunk, two engine calls


def test_negative_control_torchs_split_enters_more_than_two_per_node():
    """The counter sees frames: torch's own split (a Python hook per intermediate, its per-parameter walks)
    is above the bound on the small stage."""
    counts = count_calls(CONFIGS[0], UPSTREAM_B, UPSTREAM_W)
    # torch 2.5's own B+W leaves cycles through the hooks it registers on autograd nodes: collect them here,
    # not inside a later test's leak measurement
    gc.collect()
    assert counts.bw > 2 * counts.nodes, counts


def test_a_tensor_hook_on_an_intermediate_costs_b_and_w_only_the_hooks_own_frames():
    """The slow path that is not one: B captures by node pre-hook on every graph (Note [capturing
    intermediates]), so a tensor hook on every linear layer's output adds to B+W exactly the frames it adds
    to a full backward (its own calls)."""
    base = count_calls(CONFIGS[0])
    hooked = count_slow_path(CONFIGS[0], "tensor hook")
    assert hooked.full > base.full
    assert hooked.bw - base.bw == hooked.full - base.full, (base, hooked)


_REAL_GC_DISABLE = gc.disable
# the code of the counter's profiler (a function defined inside ``_counted``): how the gc callback tells it from a
# profiler some other test left on
_COUNTER_PROFILER = next(c for c in calls_module._counted.__code__.co_consts if getattr(c, "co_name", "") == "prof")


class _Disturbed(NamedTuple):
    """A count of the small stage with collections due all the time, and what the gc callback saw."""

    counts: CallCounts
    automatic: int  # young collections the collector started by itself (an explicit gc.collect() is of 2)
    while_counted: int  # collections that started while the counter's profiler was set (inside B, W or full)
    was_on: bool  # whether the collector was switched on when the count began


def _count_with_collections() -> _Disturbed:
    """``count_calls`` of the small stage with a gc callback registered (as the leak tools register ``_on_gc``),
    the young threshold at 1 and the collector switched on for the run, whatever an earlier test left (Note [each
    test leaves the process as it found it] in tests/conftest.py): a collection would start inside B and inside W
    but for the counter's pause. The switch and the threshold are put back after."""
    seen = {"automatic": 0, "while_counted": 0}

    def on_gc(phase, info):
        if phase == "start":
            seen["automatic"] += info["generation"] == 0
            seen["while_counted"] += getattr(sys.getprofile(), "__code__", None) is _COUNTER_PROFILER

    assert pause._depth == 0, f"ppbackward's gc pause is held ({pause._depth} blocks): no collection could be due"
    was_on = gc.isenabled()
    threshold = gc.get_threshold()
    gc.enable()
    gc.callbacks.append(on_gc)
    gc.set_threshold(1)
    try:
        counts = count_calls(CONFIGS[0])
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_gc)
        if not was_on:
            _REAL_GC_DISABLE()  # not gc.disable: the negative control below patches it
    return _Disturbed(counts, seen["automatic"], seen["while_counted"], was_on)


def test_a_collection_during_the_count_adds_no_frames():
    """The count is B's and W's frames only: with a gc callback registered (as the leak tools register
    ``_on_gc``) and collections due all the time, none starts while B, W or the full backward is counted, and
    the counts equal an undisturbed run's (a full-suite CI run once counted the callback's start/stop frames)."""
    base = count_calls(CONFIGS[0])
    disturbed = _count_with_collections()
    assert disturbed.automatic > 0, f"no automatic collection ran: the check would be vacuous ({disturbed})"
    assert disturbed.while_counted == 0, disturbed
    assert disturbed.counts == base, disturbed


def test_negative_control_without_the_pause_a_collection_adds_frames(monkeypatch):
    """The check above can fail: with the counter's gc pause taken out, collections start while B, W and the full
    backward are counted, and the same disturbed run counts the callback's frames (with the collector switched off
    before it, no collection is due and the counts are equal: why ``_count_with_collections`` switches it on; Note
    [each test leaves the process as it found it] in tests/conftest.py)."""
    base = count_calls(CONFIGS[0])
    monkeypatch.setattr(calls_module.gc, "disable", lambda: None)
    disturbed = _count_with_collections()
    assert disturbed.while_counted > 0, disturbed
    assert disturbed.counts != base, (base, disturbed)
