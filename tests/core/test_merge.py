"""``install(merge_bw=True)``: a B directly followed by its own W runs as one full backward (issue 22).

Note [merged B and W] in ``ppbackward._merge``. The action lists are torch's own planner's
(``_schedule_visualizer.get_schedule_ops`` builds each schedule, lowering included, on its mock stages);
that merged schedules train exactly is shown under torchrun (``tests/multiproc/test_merged.py``).
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as s
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

import ppbackward
from ppbackward._install import merge_bw_enabled
from ppbackward._merge import merge_actions

A = s._Action
I, W, B, F = s.BACKWARD_INPUT, s.BACKWARD_WEIGHT, s.FULL_BACKWARD, s.FORWARD
SPLIT = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@pytest.fixture(autouse=True)
def _restore():
    was = ppbackward.is_installed()
    yield
    if not was:
        ppbackward.uninstall()


def test_merges_only_a_b_directly_followed_by_its_own_w_idle_slots_skipped():
    acts = [A(0, F, 0), A(0, I, 0), None, A(0, W, 0), A(0, I, 1), A(1, W, 1), A(0, W, 1), A(1, I, 2), A(1, W, 3)]
    merged, n = merge_actions(acts)
    assert n == 1
    assert merged == [A(0, F, 0), A(0, B, 0), None, A(0, I, 1), A(1, W, 1), A(0, W, 1), A(1, I, 2), A(1, W, 3)]
    assert merge_actions([A(0, I, 0)]) == ([A(0, I, 0)], 0)  # a B at the end
    assert merge_actions([]) == ([], 0)


def test_an_overlapped_action_is_never_merged_into():
    overlap = A(0, s.OVERLAP_F_B, None, (A(0, F, 1), A(0, W, 0)))
    acts = [A(0, I, 0), overlap, A(0, W, 0)]
    assert merge_actions(acts) == (acts, 0)


@pytest.mark.parametrize("name", SPLIT)
def test_every_backward_runs_once_and_nothing_else_moves(name: str):
    for rank_ops in get_schedule_ops(getattr(s, name), 2, 8, 2):
        merged, n = merge_actions(rank_ops)
        kinds = [a.computation_type for a in merged if a is not None]
        assert kinds.count(B) - [a.computation_type for a in rank_ops if a is not None].count(B) == n
        flat = [sub for a in merged if a is not None for sub in (a.sub_actions or (a,))]
        done = {(a.stage_index, a.microbatch_index, a.computation_type) for a in flat}
        for st, mb, kind in list(done):
            if kind == F:  # each forward has exactly one full backward or one B and one W
                assert ((st, mb, B) in done) != ((st, mb, I) in done and (st, mb, W) in done), (st, mb)
        # with the merged pairs put back, the list is the planner's
        unmerged = []
        for a in merged:
            unmerged += [a._replace(computation_type=I), a._replace(computation_type=W)] if a in _pairs(rank_ops) else [a]
        assert [a for a in unmerged if a is not None] == [a for a in rank_ops if a is not None]


def _pairs(rank_ops):
    ops = [a for a in rank_ops if a is not None]
    return {
        a._replace(computation_type=B)
        for a, b in zip(ops, ops[1:])
        if a.computation_type == I and b == a._replace(computation_type=W)
    }


def _lowered_kinds(name: str) -> list[dict]:
    ops = get_schedule_ops(getattr(s, name), 2, 8, 2, with_comms=True)
    return [{k: sum(a.computation_type == k for a in r) for k in (B, I, W)} for r in ops]


@pytest.mark.parametrize("name", SPLIT)
def test_a_schedule_built_while_installed_with_merge_bw_runs_the_merged_list(name: str):
    plain = _lowered_kinds(name)
    if name != "ScheduleDualPipeV":  # DualPipeV plans some full backwards itself
        assert all(r[B] == 0 for r in plain)
    ppbackward.install(merge_bw=True)
    merged = _lowered_kinds(name)
    for p, m in zip(plain, merged):
        assert m[B] - p[B] == p[W] - m[W] == p[I] - m[I]  # a merged pair: one B and one W fewer, one full more
    assert sum(r[B] - p[B] for r, p in zip(merged, plain)) > 0
    ppbackward.install()  # a later plain install() leaves the switch as it is
    assert _lowered_kinds(name) == merged
    ppbackward.install(merge_bw=False)
    assert _lowered_kinds(name) == plain


def test_uninstall_puts_back_exactly_torchs_lowering():
    cls = s._PipelineScheduleRuntime
    original = cls.__dict__["_prepare_schedule_with_comms"]
    ppbackward.install(merge_bw=True)
    assert merge_bw_enabled() and cls.__dict__["_prepare_schedule_with_comms"] is not original
    ppbackward.install(merge_bw=True)  # idempotent: wrapped once
    assert cls.__dict__["_prepare_schedule_with_comms"].__wrapped__ is original
    ppbackward.uninstall()
    assert not merge_bw_enabled() and cls.__dict__["_prepare_schedule_with_comms"] is original


def test_installed_context_restores_the_switch():
    cls = s._PipelineScheduleRuntime
    original = cls.__dict__["_prepare_schedule_with_comms"]
    with ppbackward.installed(merge_bw=True):
        assert merge_bw_enabled()
    assert not ppbackward.is_installed() and cls.__dict__["_prepare_schedule_with_comms"] is original
    ppbackward.install()
    with ppbackward.installed(merge_bw=True):
        assert merge_bw_enabled()
    assert ppbackward.is_installed() and not merge_bw_enabled()
