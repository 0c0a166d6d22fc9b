"""Zero-bubble schedules built under ``ppbackward.install(merge_bw=True)``, under torchrun (issue 22).

Note [merged B and W] in ``ppbackward._merge``: each B directly followed by its own W runs as one full
backward. Every case must pass every check of the unmerged matrix on every rank (grads against the
single-process reference, zero garbage, activations dead on time, hooks once per parameter per
microbatch, DDP replicas identical, FSDP2's sharded grads), and its rank's lowered action list must show
the merge: as many full backwards more and Bs and Ws fewer than the same schedule built without it (the
unmerged launches of ``test_matrix.py`` and ``test_training.py``, whose lists are recorded the same way).
"""

from __future__ import annotations

from typing import Any

import pytest

from ppbackward import UnsupportedTorchError
from ppbackward._merge import lowering
from tests.multiproc import test_matrix, test_training
from tests.multiproc.multiproc_specs import LAUNCH_TEST_TIMEOUT, slow_params

try:  # torch 2.5-2.8 have no lowering to wrap: install(merge_bw=True) refuses them, and no launch is started
    lowering()
except UnsupportedTorchError as e:
    pytest.skip(f"install(merge_bw=True) does not apply to this torch: {e}", allow_module_level=True)

ZB = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
# merged launch -> (the same cases unmerged, how a passing case is checked for vacuity)
PAIRS = {
    "merged-ws2": ("ws2", test_matrix.assert_measured),
    "merged-ws4": ("ws4", test_matrix.assert_measured),
    "merged-training-ws2": ("training-ws2", test_training.assert_measured),
    "merged-training-dp": ("training-dp", test_training.assert_measured),
}


def _zb(ids: list[str]) -> list[str]:
    return [c for c in ids if c.split("/")[0] in ZB]


@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
@pytest.mark.parametrize("name", slow_params(list(PAIRS)))
def test_every_zero_bubble_case_passes_merged(name: str, launches) -> None:
    result = launches(name)
    assert result.complete, result.format_launch()
    ids = result.case_ids()
    assert ids and ids == _zb(ids), result.summary()
    failed = [c for c in ids if result.case_status(c) not in ("pass", "skip")]
    assert not failed, "\n".join(result.format_case(c) for c in failed)
    check = PAIRS[name][1]
    for c in ids:
        if result.case_status(c) == "pass":
            for record in result.case(c).values():
                assert record is not None
                check(record)


def _actions(result: Any, case: str) -> dict[int, dict[str, int]]:
    """Each rank's lowered compute actions by kind (``F``, ``B`` = full backward, ``I`` = B, ``W``)."""
    return {rank: rec.actions["lowered"] for rank, rec in result.case(case).items() if rec is not None}


@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
@pytest.mark.parametrize(("name", "plain"), slow_params([(m, p) for m, (p, _) in PAIRS.items()]))
def test_the_merge_is_what_ran(name: str, plain: str, launches) -> None:
    merged_result, plain_result = launches(name), launches(plain)
    total = 0
    for case in merged_result.case_ids():
        if merged_result.case_status(case) == "skip":
            continue
        for rank, m in _actions(merged_result, case).items():
            p = _actions(plain_result, case)[rank]
            where = f"{case} rank {rank}: merged {m} unmerged {p}"
            assert m["F"] == p["F"], where
            assert m["B"] - p["B"] == p["I"] - m["I"] == p["W"] - m["W"] >= 0, where
            if case.startswith("ScheduleInterleavedZeroBubble") or case.startswith("ScheduleZBVZeroBubble"):
                assert p["B"] == 0, where  # torch's own lowering splits every backward of these
            total += m["B"] - p["B"]
    assert total > 0, f"{name}: no B and W were merged"


@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
def test_check_s_merge_lines_count_what_each_rank_ran(launches) -> None:
    """``ppbackward check --merge-bw`` prints, per case, the pairs merged of the B actions torch planned,
    summed over ranks: here against the same cases launched unmerged (full backwards gained, B actions
    there), DualPipeV (whose own lowering already runs full backwards) included; unmerged cases read 0;
    with no splitting schedule it says so."""
    from ppbackward._tools.cli import cells
    from ppbackward._tools.cli import check as _check
    from ppbackward._tools.harness.scenarios import Scenario

    scenario = Scenario("pp", "pipeline", 2, ("one", "two"))  # two models: rows are whole case ids

    def lines(result: Any, only: list[str] | None) -> list[str]:
        results = {"ppbackward": {c: cells.cell_values(result.case(c)) for c in result.case_ids()}}
        return _check._merge_lines([_check._ScenarioRun(scenario, {}, results)], only)

    def row(case: str, merged: Any) -> str:
        m, p = _actions(merged, case), _actions(plain, case)
        return f"{case} {sum(m[r]['B'] - p[r]['B'] for r in p)}/{sum(p[r]['I'] for r in p)}"

    header = "merge_bw: B/W pairs run as one full backward, of the B actions torch planned (all ranks, one step):"
    merged, plain = launches("merged-ws2"), launches("ws2")
    ran = [c for c in merged.case_ids() if merged.case_status(c) != "skip"]
    assert ran and any(c.startswith("ScheduleDualPipeV") for c in ran), merged.summary()
    assert lines(merged, None) == [header, "  pp: " + ", ".join(row(c, merged) for c in ran)]
    assert all(int(row(c, merged).split()[-1].split("/")[0]) > 0 for c in ran if "ZBV" in c)
    plain_ran = [c for c in plain.case_ids() if c.split("/")[0] in ZB and plain.case_status(c) != "skip"]
    assert lines(plain, list(ZB)) == [header, "  pp: " + ", ".join(row(c, plain) for c in plain_ran)]
    assert all(row(c, plain).split()[-1].startswith("0/") for c in plain_ran)
    assert lines(plain, ["Schedule1F1B"]) == [
        "merge_bw: no schedule run splits its backward into B and W: nothing was merged"
    ]
