"""The replayed schedule step (``ppbackward._bench._replay``, issue 22): exact event arithmetic on
torch's own action lists, checked against values worked out by hand and the invariants of a replay."""

from __future__ import annotations

import pytest

from ppbackward._bench import _replay
from ppbackward._bench._replay import Action, simulate


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
    r = _replay.replay({"F": 1.0, "full": 2.0, "B": 1.0, "W": 1.0})
    ratio = r["ratio_to_1f1b"]
    for zb in _replay.SCHEDULES[1:]:
        assert ratio[f"{zb}/ideal"] == pytest.approx(ratio[f"{zb}/measured"])
        assert ratio[f"{zb}/ideal"] < 1.0  # the bubble is smaller: that is what zero bubble buys
    slow = _replay.replay({"F": 1.0, "full": 2.0, "B": 1.5, "W": 1.5})["ratio_to_1f1b"]
    for zb in _replay.SCHEDULES[1:]:
        assert slow[f"{zb}/ideal"] == pytest.approx(ratio[f"{zb}/ideal"])
        assert slow[f"{zb}/measured"] > slow[f"{zb}/ideal"]
        assert slow[f"{zb}/merged"] <= slow[f"{zb}/measured"]
