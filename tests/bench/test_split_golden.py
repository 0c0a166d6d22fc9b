"""``ppbackward bench --split``'s printed report, byte for byte, against text kept in ``tests/bench/golden/``.

``golden/split.json`` is what ``ppbackward bench --split --configs 4x16x4,4x64x16 --repeats 2 --json``
wrote (measured on 2 shared cores: the numbers are noise, which does not matter here; its ``argv``
without the temporary path, its targets dropped: the test evaluates them). Each variant below derives a
report from it that takes other branches of the renderers: the real step of ``golden/report.json``
(whose stage shape one configuration is renamed to, so that its replay is shown beside it), a failed
real step with CUDA allocator bytes, a configuration without a node count or a replay and a third split
variant. For each, ``split.targets`` must equal the records kept in ``golden/split-targets.json`` and
``split.format_run`` must equal ``golden/split-<variant>.txt``.

The expected files were written by ``split.py`` as it was before its result became typed records (nested
dicts; commit 567fb08, this module run there as a script with ``--write``), so a refactor that
changes a byte or a figure fails here; rewritten once on purpose since, when the host cost per node moved
from between the split table's heading and its rows to below them (issue 39; the diff: that block's lines
only). To change the output on purpose, rewrite them with
``PYTHONPATH=src python tests/bench/test_split_golden.py --write`` and review the diff.
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
from ppbackward._tools.bench import split as _split
from ppbackward._tools.bench.records import SplitRun

GOLDEN = Path(__file__).resolve().parent / "golden"


def _fixture() -> dict[str, Any]:
    report: dict[str, Any] = json.loads((GOLDEN / "split.json").read_text())
    return report


def _plain(r: dict[str, Any]) -> dict[str, Any]:
    return r


def _schedule(r: dict[str, Any]) -> dict[str, Any]:
    """The made-up real step of ``golden/report.json`` (with one slice per rank: it has none), one
    configuration of its stage shape."""
    sched = json.loads((GOLDEN / "report.json").read_text())["schedule"]
    last = {k: sched.pop(k) for k in ("grads_match", "compile", "regions")}  # the last fields, as written
    sched["slices_ms"] = {name: [[["F", 0.0, 1.0, 0, 0]]] * sched["ranks"] for name in sched["variants"]}
    sched.update(last)
    r["schedule"] = sched
    r["split"]["configs"][1]["name"] = "4x128x16"
    return r


def _odd(r: dict[str, Any]) -> dict[str, Any]:
    """A failed real step; allocator bytes held between B and W; a configuration without a node count
    nor a replay; a third split variant ``old`` (pp's figures, scaled); no commit nor load average."""
    for key in ("ppbackward_commit", "loadavg_start", "loadavg_end", "allocator"):
        del r["meta"][key]
    r["schedule"] = {"error": "schedule benchmark failed with exit code 1\ntorchrun: worker 1 died"}
    first, second = r["split"]["configs"]
    first["held_bytes"] = {"pp": 1024, "torch": 1 << 20}
    second["nodes"] = None
    second["replay"] = {}
    for config in (first, second):
        for regime, times in config["time_ms"].items():
            times.update({f"old_{p}": 1.5 * times[f"pp_{p}"] for p in ("b", "w", "bw")})
            ratios = config["ratios"][regime]
            ratios.update({f"old_{p}": {k: 1.5 * v for k, v in ratios[f"pp_{p}"].items()} for p in ("b", "w", "bw")})
    return r


VARIANTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "plain": _plain, "schedule": _schedule, "odd": _odd,
}


def _variant(name: str) -> dict[str, Any]:
    return VARIANTS[name](copy.deepcopy(_fixture()))


def _targets() -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name in VARIANTS:
        run = SplitRun.from_report(_variant(name))
        out[name] = _split.targets(run.split, run.schedule)
    return out


def _printed(name: str, targets: dict[str, list[dict[str, Any]]]) -> str:
    report = _variant(name)
    report["targets"] = targets[name]
    return _split.format_run(SplitRun.from_report(report), _report) + "\n"


@pytest.fixture(scope="module")
def expected_targets() -> dict[str, list[dict[str, Any]]]:
    targets: dict[str, list[dict[str, Any]]] = json.loads((GOLDEN / "split-targets.json").read_text())
    return targets


@pytest.mark.parametrize("name", VARIANTS)
def test_split_targets_are_the_golden_records(name, expected_targets):
    assert _targets()[name] == expected_targets[name]


@pytest.mark.parametrize("name", VARIANTS)
def test_printed_split_report_is_the_golden_text(name, expected_targets):
    assert _printed(name, expected_targets) == (GOLDEN / f"split-{name}.txt").read_text()


@pytest.mark.parametrize("name", VARIANTS)
def test_the_json_written_is_the_json_read(name, expected_targets):
    """``--json``'s object read into records and written back is the same text, keys in the same order."""
    report = _variant(name)
    report["targets"] = expected_targets[name]
    assert json.dumps(SplitRun.from_report(report).to_report(), indent=1) == json.dumps(report, indent=1)


def test_a_split_result_of_another_shape_is_refused_naming_the_field():
    from ppbackward._tools.bench.records import SchemaError

    report = _fixture()
    del report["split"]["configs"][1]["ratios"]["first"]["pp_b"]["q3"]
    with pytest.raises(SchemaError, match=r"split\.configs\[1\]\.ratios\.first\.pp_b: missing field 'q3'"):
        SplitRun.from_report(report)


@pytest.mark.parametrize("name", VARIANTS)
def test_each_heading_sits_directly_above_its_own_rows(name, expected_targets):
    """A newcomer read the host cost per node as the split table: it stood between that table's heading and
    its rows. Each heading is now followed by its own rows, and an empty line parts the sections."""
    lines = _printed(name, expected_targets).splitlines()
    split = next(i for i, line in enumerate(lines) if line.startswith("Split cost per microbatch-stage: "))
    assert lines[split + 1].startswith("L4 d16 s4     first ") and " full " in lines[split + 1]
    host = lines.index("Host cost per autograd node (accumulating, us per node of the stage graph)")
    assert lines[host - 1] == "" and " nodes  full " in lines[host + 1]
    replay = next(i for i, line in enumerate(lines) if line.startswith("Replayed step (Note [replayed step]"))
    assert lines[replay - 1] == "" and " 2 ranks, 8 mb:  InterleavedZB ideal " in lines[replay + 1]


def test_the_split_variants_take_the_branches_they_are_for(expected_targets):
    """The fixture and the variants still hold what the expected text relies on."""
    plain, sched, odd = (_printed(name, expected_targets) for name in VARIANTS)
    assert "Host cost per autograd node" in plain and plain.count(" nodes  full ") == 2
    assert "\nReal step (torchrun 2 ranks" in sched and "\nStep parts" in sched
    (zbv,) = [line.split() for line in sched.splitlines() if line.startswith("ZBVZeroBubble/ppbackward ")]
    assert len(zbv) == 10  # its replayed step shown: the configuration of the real step's shape was found
    assert "real step: ZBVZeroBubble (ppbackward)" in sched
    assert "Real step: ERROR" in odd and "freed by W): pp 1024, torch 1048576" in odd
    assert odd.count(" nodes  full ") == 1 and "  old: B " in odd


def _write() -> None:
    """Rewrite the expected files from the current code (an intended change of the output only)."""
    targets = _targets()
    (GOLDEN / "split-targets.json").write_text(json.dumps(targets, indent=1) + "\n")
    for name in VARIANTS:
        (GOLDEN / f"split-{name}.txt").write_text(_printed(name, targets))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(f"usage: {sys.argv[0]} --write   (rewrites the expected files in {GOLDEN})")
    _write()
