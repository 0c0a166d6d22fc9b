"""The replayed schedule step (``ppbackward._tools.bench.replay``, issue 22): exact event arithmetic on
torch's own action lists, checked against values worked out by hand and the invariants of a replay."""

from __future__ import annotations

import dataclasses

import pytest

from ppbackward._tools.bench import replay as _replay
from ppbackward._tools.bench.records import SplitConfig, SplitCosts, SplitResult
from ppbackward._tools.bench.replay import Action, simulate
from ppbackward._tools.harness.records import ScheduleBench


def test_simulate_one_rank_is_the_sum_and_two_ranks_wait_for_each_other():
    costs = {"F": 1.0, "B": 2.0, "I": 1.5, "W": 0.5}
    assert simulate([[Action(0, "F", 0), Action(0, "I", 0), Action(0, "W", 0)]], costs) == 3.0
    # stage 0 on rank 0, stage 1 on rank 1: F0 [0,1], F1 [1,2], B1 [2,4], B0 [4,6]
    lists = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    assert simulate(lists, costs) == 6.0


def test_simulate_refuses_a_deadlock():
    with pytest.raises(RuntimeError, match="deadlocked"):
        simulate([[Action(0, "B", 0), Action(0, "F", 0)]], {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0})


def test_replay_ideal_split_is_never_slower_than_measured_and_merging_a_free_split_changes_nothing():
    r = _replay.replay(SplitCosts(F=1.0, full=2.0, B=1.0, W=1.0))
    ratio = r.ratio_to_1f1b
    for zb in _replay.SCHEDULES[1:]:
        assert ratio[f"{zb}/ideal"] == pytest.approx(ratio[f"{zb}/measured"])
        assert ratio[f"{zb}/ideal"] < 1.0  # the bubble is smaller: that is what zero bubble buys
    slow = _replay.replay(SplitCosts(F=1.0, full=2.0, B=1.5, W=1.5)).ratio_to_1f1b
    for zb in _replay.SCHEDULES[1:]:
        assert slow[f"{zb}/ideal"] == pytest.approx(ratio[f"{zb}/ideal"])
        assert slow[f"{zb}/measured"] > slow[f"{zb}/ideal"]
        assert slow[f"{zb}/merged"] <= slow[f"{zb}/measured"]


def test_the_real_steps_replay_is_the_one_of_its_stage_shape_ranks_and_microbatches():
    """``_split.replayed_steps``: the replay shown beside the real step's parts is that of the split
    configuration with the real step's stage shape and microbatch size, at its ranks and microbatches."""
    from ppbackward._tools.bench.split import replayed_steps

    def config(name: str, scale: float, microbatches: int = 8) -> SplitConfig:
        costs = SplitCosts(F=scale, full=2 * scale, B=1.5 * scale, W=1.5 * scale)
        replay = {"2 ranks": _replay.replay(costs, 2, microbatches)}
        return SplitConfig(name, name, batch=2, nodes=None, repeats=1, limit_bw=None, time_ms={}, ratios={},
                           costs_ms=costs, replay=replay)

    split = SplitResult("cpu", [config("4x64x16", 1.0), config("4x128x16", 10.0)])
    sched = ScheduleBench(ranks=2, stages=4, layers_per_stage=4, d_model=128, seq=16, microbatches=8,
                          microbatch_size=2, repeats=1, variants=[], step_ms={}, ratio_to_1f1b={}, memory={},
                          parts_ms={}, slices_ms={}, grads_match=True)
    got = replayed_steps(split, sched)
    ms = split.configs[1].replay["2 ranks"].step_ms
    assert got == {
        "Interleaved1F1B/upstream": ms["ScheduleInterleaved1F1B"],
        "Interleaved1F1B/ppbackward": ms["ScheduleInterleaved1F1B"],
        "InterleavedZeroBubble/ppbackward": ms["ScheduleInterleavedZeroBubble/measured"],
        "InterleavedZeroBubble/merged": ms["ScheduleInterleavedZeroBubble/merged"],
        "ZBVZeroBubble/ppbackward": ms["ScheduleZBVZeroBubble/measured"],
        "ZBVZeroBubble/merged": ms["ScheduleZBVZeroBubble/merged"],
    }
    # no replay of that shape, rank count, microbatch count or microbatch size: nothing shown
    for other in ({"d_model": 256}, {"ranks": 4}, {"microbatches": 4}, {"microbatch_size": 1}):
        assert replayed_steps(split, dataclasses.replace(sched, **other)) == {}, other
    # a replay at another microbatch count is the one of a real step at that count (not only at 8)
    four = SplitResult("cpu", [config("4x128x16", 10.0, microbatches=4)])
    got = replayed_steps(four, dataclasses.replace(sched, microbatches=4))
    replayed = four.configs[0].replay["2 ranks"].step_ms
    assert got["ZBVZeroBubble/merged"] == replayed["ScheduleZBVZeroBubble/merged"]
