"""The benchmark's printed report, byte for byte, against text kept in ``tests/bench/golden/``.

``golden/report.json`` is a bench report (measured, with a made-up schedule step; how it was made:
``golden/make_fixture.py``). Each variant below derives a report from it that takes other branches
of the renderers (no commit or load average, a failed schedule, no configuration, a gradient
mismatch, the full scaling sweep). For each, the targets (``report.targets``) must equal the records
kept in ``golden/targets.json`` and the printed text (``report.format_text``, then
``report.summary_line`` where there is one, as ``ppbackward bench`` prints them) must equal
``golden/<variant>.txt``; ``golden/step-parts.txt`` keeps ``report.step_parts_table``'s text with and
without the replayed steps (as ``ppbackward bench --split`` prints it).

The expected files were written by ``report.py`` as it was before its renderers were split (commit
a6cd899, ``format_text`` one function: ``git archive a6cd899 src | tar -x -C /tmp/orig``, then this
module run with ``PYTHONPATH=/tmp/orig/src ... --write``), so a refactor that changes a byte fails
here. To change the output on purpose, rewrite them with
``PYTHONPATH=src python tests/bench/test_report_golden.py --write`` and review the diff.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ppbackward._tools.bench import report as _report

GOLDEN = Path(__file__).resolve().parent / "golden"


def _fixture() -> dict[str, Any]:
    report: dict[str, Any] = json.loads((GOLDEN / "report.json").read_text())
    return report


def _full(r: dict[str, Any]) -> dict[str, Any]:
    return r


def _bare(r: dict[str, Any]) -> dict[str, Any]:
    """No commit nor load average, one configuration without device work, no scaling fit, no
    profile, the schedule step failed."""
    for key in ("ppbackward_commit", "loadavg_start", "loadavg_end"):
        del r["meta"][key]
    r["configs"] = r["configs"][1:]
    del r["configs"][0]["device_work"]
    r["analysis_scaling"]["fit"] = {}
    del r["profile"]
    r["schedule"] = {"error": "schedule benchmark failed with exit code 1\ntorchrun: worker 1 died"}
    return r


def _empty(r: dict[str, Any]) -> dict[str, Any]:
    """No configuration, nothing else measured; a commit but no load average."""
    r["meta"]["loadavg_start"] = None
    return {"meta": r["meta"], "configs": []}


def _mismatch(r: dict[str, Any]) -> dict[str, Any]:
    """Gradients differ on two configurations and in the schedule step; the full scaling sweep; a
    schedule result without the step parts; a commit unknown."""
    r["meta"]["ppbackward_commit"] = None
    r["configs"][0]["grads_match"]["upstream"] = False
    r["configs"][2]["grads_match"]["full"] = False
    points = r["analysis_scaling"]["points"]
    for p in points:
        del p["upstream_us"]
    points += [dict(points[-1], layers=8 * k) for k in (1, 2)]
    del r["schedule"]["parts_ms"]
    r["schedule"]["grads_match"] = False
    return r


VARIANTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "full": _full, "bare": _bare, "empty": _empty, "mismatch": _mismatch,
}


def _variant(name: str) -> dict[str, Any]:
    return VARIANTS[name](copy.deepcopy(_fixture()))


def _printed(report: dict[str, Any]) -> str:
    """What ``ppbackward bench`` prints of ``report`` (stdout)."""
    problem = _report.summary_line(report)
    return _report.format_text(report) + "\n" + (problem + "\n" if problem else "")


def _step_parts() -> str:
    """``step_parts_table`` of the fixture's schedule: without a replay, with none found, with one."""
    sched = _fixture()["schedule"]
    replayed = {name: 30.0 + i / 4 for i, name in enumerate(sched["variants"][2:], 2)}
    return "\n=====\n".join(_report.step_parts_table(sched, r) for r in (None, {}, replayed)) + "\n"


def _targets() -> dict[str, list[dict[str, Any]]]:
    return {name: _report.targets(_variant(name)) for name in VARIANTS}


def _with_targets(name: str, targets: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    report = _variant(name)
    report["targets"] = targets[name]
    return report


@pytest.fixture(scope="module")
def expected_targets() -> dict[str, list[dict[str, Any]]]:
    targets: dict[str, list[dict[str, Any]]] = json.loads((GOLDEN / "targets.json").read_text())
    return targets


@pytest.mark.parametrize("name", VARIANTS)
def test_targets_are_the_golden_records(name, expected_targets):
    assert _report.targets(_variant(name)) == expected_targets[name]


@pytest.mark.parametrize("name", VARIANTS)
def test_printed_report_is_the_golden_text(name, expected_targets):
    expected = (GOLDEN / f"{name}.txt").read_text()
    assert _printed(_with_targets(name, expected_targets)) == expected


def test_step_parts_table_is_the_golden_text():
    assert _step_parts() == (GOLDEN / "step-parts.txt").read_text()


def test_the_variants_take_the_branches_they_are_for(expected_targets):
    """The fixture still holds what the variants rely on (a rewrite of it could lose a section)."""
    full = _printed(_with_targets("full", expected_targets))
    for heading in ("\nTime:", "\nMicrobatch loop:", "\nAllocator:", "\nMemory:", "\nMemory with a user's",
                    "\nDevice work", "\nSaved activations held", "\nGraph analysis", "\nfit:", "\nWhere the time",
                    "\nSchedule step (", "\nStep parts", "\nTargets ("):
        assert full.count(heading) == 1, heading
    assert "1-min load average" not in _printed(_with_targets("bare", expected_targets))
    assert "Schedule step: ERROR" in _printed(_with_targets("bare", expected_targets))
    assert "gradient mismatch against plain autograd on: " in _printed(_with_targets("mismatch", expected_targets))
    wheres = {t["where"] for t in expected_targets["mismatch"]}
    assert "1..32 layers" in wheres and "quick" in {t["where"] for t in expected_targets["full"]}
    assert {t["target"].split(" (")[0] for t in expected_targets["full"]} >= {
        "ppbackward B+W <= 1.15x plain", "ppbackward B+W <= 2.0x plain", "zero-bubble step",
        "zero-bubble step: ppbackward <= 0.9x torch's",
    }


def test_first_microbatch_grad_copies_are_set_aside_only_in_pairs():
    """The first regime's kernel target sets aside the copies into an empty ``.grad`` (one
    ``new_empty_strided`` and one ``copy_`` per gradient B computed: docs/performance.md, "Device work") and
    nothing else; where the two counts differ, every differing kernel counts (the negative control)."""
    aside = _report._without_grad_copies
    assert aside({"copy_": 32, "new_empty_strided": 32}) == {}
    assert aside({"copy_": 2, "mm": 1, "new_empty_strided": 2}) == {"mm": 1}
    assert aside({"copy_": 3, "new_empty_strided": 2}) == {"copy_": 3, "new_empty_strided": 2}
    assert aside({"copy_": -1, "new_empty_strided": -1}) == {"copy_": -1, "new_empty_strided": -1}
    assert aside({"mm": 2}) == {"mm": 2}


def _write() -> None:
    """Rewrite the expected files from the current code (an intended change of the output only)."""
    targets = _targets()
    (GOLDEN / "targets.json").write_text(json.dumps(targets, indent=1) + "\n")
    for name in VARIANTS:
        (GOLDEN / f"{name}.txt").write_text(_printed(_with_targets(name, targets)))
    (GOLDEN / "step-parts.txt").write_text(_step_parts())


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(f"usage: {sys.argv[0]} --write   (rewrites the expected files in {GOLDEN})")
    _write()
