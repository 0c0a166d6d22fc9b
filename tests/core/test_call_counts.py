"""B + W enter at most 2 Python frames per autograd node of the stage on the default path (issue #36).

Counted, not timed (Note [counted host cost] in ``ppbackward._tools.bench.calls``): ``sys.setprofile``'s
``"call"`` events while one microbatch's B and W run on a fresh forward of the bench stage, grads
accumulating. A count does not move with the machine's load, so the bound is exact on any machine. What
keeps it low: Note [no frame per node] and Note [one frame per capture] in ``ppbackward.backward``.
"""

from __future__ import annotations

import gc

import pytest

from ppbackward._tools.bench.calls import count_calls, count_slow_path
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


def _count_with_collections(on_gc):
    """``count_calls`` of the small stage with ``on_gc`` among the gc callbacks and the young threshold at 1,
    so that a collection would start inside B and inside W."""
    threshold = gc.get_threshold()
    gc.callbacks.append(on_gc)
    gc.set_threshold(1)
    try:
        return count_calls(CONFIGS[0])
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_gc)


def test_a_collection_during_the_count_adds_no_frames():
    """The count is B's and W's frames only: with a gc callback registered (as the leak tools register
    ``_on_gc``) and collections due all the time, the counts equal an undisturbed run's (a full-suite CI run
    once counted the callback's start/stop frames)."""
    base = count_calls(CONFIGS[0])
    calls: list = []
    disturbed = _count_with_collections(lambda phase, info: calls.append(phase))
    assert calls, "no collection ran during the counted run: the check would be vacuous"
    assert disturbed == base


def test_negative_control_without_the_pause_a_collection_adds_frames(monkeypatch):
    """The check above can fail: with the counter's gc pause taken out, the same disturbed run counts the
    callback's frames."""
    import ppbackward._tools.bench.calls as calls_module

    base = count_calls(CONFIGS[0])
    monkeypatch.setattr(calls_module.gc, "disable", lambda: None)
    assert _count_with_collections(lambda phase, info: None) != base
