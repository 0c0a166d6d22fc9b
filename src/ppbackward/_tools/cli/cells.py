"""The cells of ``ppbackward check``'s table: per-rank case records aggregated, judged and formatted.

Private module, used by ``ppbackward._tools.cli.check``. Columns (Note [worst cell]):

* ``garbage``: tensors + autograd nodes found in reference cycles after a step
  (``ppbackward.leaks.check_tensor_leaks``);
* ``gc-only``: bytes of saved activations freed only by a gc run (held by a cycle);
* ``held``: bytes of saved activations still alive after the step, the stage's runtime state
  cleared and a gc run (held by a live reference);
* ``max|dg|``: max |grad - reference| over every parameter, against a single-process reference (of the
  mean of the per-shard losses with data parallelism);
* ``hooks``: post-accumulate-grad hook calls / expected (once per parameter per microbatch) of the
  rank and step furthest from expected;
* ``step``: seconds per step, the slowest rank's mean over its steps (timing is not judged);
* ``finding``: for a failing row, the kind of its first failure (``ppbackward._tools.harness.diagnose``).
"""

from __future__ import annotations

import re
from typing import Any

from ppbackward._tools.harness.diagnose import ORDER, diagnose
from ppbackward._tools.harness.records import CaseRecord, Failure, StepMeasures
from ppbackward._tools.text_table import format_table

__all__ = [  # private module: what other modules use
    "by_kind",
    "cell_ok",
    "cell_values",
    "format_cell",
    "progress_status",
    "progress_status_of",
    "reason",
    "short_reason",
    "table",
]

COLUMNS = ("garbage", "gc-only", "held", "max|dg|", "hooks", "step", "finding")

# Which check (``records.Failure.check``) each column reports.
_CHECKS = {"garbage": "garbage", "gc-only": "lifetime", "held": "lifetime", "max|dg|": "numerics", "hooks": "hooks"}


def _check_name(failure: Failure) -> str:
    """What a progress line calls a failure: its check, or a case's own message."""
    return failure.message if failure.check == "case" else failure.check


def progress_status(status: str, failures: list[Failure]) -> str:
    """``pass``, ``skip``, or ``FAIL`` with why: ``FAIL raised RuntimeError`` (the case stopped on an
    exception) or ``FAIL hooks,numerics`` (the checks that failed)."""
    if status in ("pass", "skip"):
        return status
    if status == "error" and failures and failures[0].raised:
        return "FAIL raised " + failures[0].raised
    checks = dict.fromkeys(_check_name(f) for f in failures)
    return "FAIL " + ",".join(checks) if checks else "FAIL"


def progress_status_of(per_rank: dict[int, CaseRecord]) -> str:
    """:func:`progress_status` of one case over every rank that reported it, so that the progress line
    says what the case's row will: ``pass`` only when every rank passed, ``skip`` when all skipped, else
    the first exception or the union of the failed checks over the ranks."""
    records = [r for _, r in sorted(per_rank.items()) if r]
    statuses = {r.status for r in records}
    if statuses in ({"pass"}, {"skip"}):
        return statuses.pop()
    raised = next((r for r in records if r.status == "error" and r.failures), None)
    if raised is not None:
        return progress_status(raised.status, raised.failures)
    return progress_status("fail", [f for r in records for f in r.failures])


def _step_metrics(step: StepMeasures) -> dict[str, Any]:
    """The value each column compares across ranks and steps (the largest is shown: Note [worst cell])."""
    return {
        "garbage": step.garbage,
        "gc-only": step.bytes_freed_only_by_gc,
        "held": step.bytes_held_after_gc,
        "max|dg|": step.max_abs_grad_err,
        # furthest from expected first; among equals, a rank that expects hook calls over one with no
        # trainable parameter (0/0 says nothing about the hooks): Note [worst cell]
        "hooks": (abs(step.hooks_fired - step.hooks_expected), step.hooks_expected > 0),
    }


def _findings(records: dict[int, CaseRecord]) -> list[dict[str, str]]:
    """The kinds of failure over every rank, most telling first, each with one example ``rank r, ...``."""
    found: dict[str, dict[str, str]] = {}
    for rank, record in records.items():
        for finding in diagnose(record):
            key = finding.kind.key if finding.kind.key != "other" else finding.example
            found.setdefault(
                key,
                {
                    "kind": finding.kind.key,
                    "label": finding.kind.label,
                    "line": finding.line,
                    "example": f"rank {rank}, {finding.example}",
                },
            )
    return sorted(found.values(), key=lambda f: ORDER.get(f["kind"], len(ORDER)))


def _grads_why(records: dict[int, CaseRecord]) -> str | None:
    """Why ``max|dg|`` fails where no difference was measured: ``grad None`` (a grad the reference has is
    None in the pipeline), ``grad set`` (the reverse), ``loss``, ``losses`` (their count) or ``replicas``,
    from the numerics records of the ranks with a numerics or replicas failure; ``None`` for none."""
    steps = [s.numerics for r in records.values() if any(f.check in ("numerics", "replicas") for f in r.failures)
             for s in r.steps if s.numerics is not None]
    for why, found in (("grad None", any(n.grads_none for n in steps)),
                       ("grad set", any(n.grads_unexpected for n in steps)),
                       ("loss", any(n.losses_wrong for n in steps)),
                       ("losses", any(n.losses_miscounted for n in steps)),
                       ("replicas", any(n.replicas_diverged for n in steps))):
        if found:
            return why
    return None


def cell_values(per_rank: dict[int, CaseRecord | None]) -> dict[str, Any]:
    """Aggregate one case's per-rank records into the table's metrics.

    Note [worst cell]: every column shows the worst rank and step for that column (the largest value;
    for ``hooks``, the rank and step whose count is furthest from expected, shown as fired/expected of
    that rank and step), and ``worst`` remembers which (rank, step) each column came from, so that the
    footnote of a failing case quotes the failure behind the first failing cell. A rank with no trainable
    parameter (a frozen stage: 0 hook calls expected) is the ``hooks`` cell only when every rank is one.
    """
    records = {rank: r for rank, r in per_rank.items() if r}
    failures = [f"rank {rank}, {f.text}" for rank, r in records.items() for f in r.failures]
    # what each failure is, in the order of ``failures``: [rank, step or None, check, kind]
    failed = [[rank, f.step, f.check, f.kind] for rank, r in records.items() for f in r.failures]
    status = {r.status for r in records.values()}
    steps = [(rank, StepMeasures.from_record(s)) for rank, r in records.items() for s in r.steps]
    findings = _findings(records)
    if not steps:
        if status == {"skip"}:
            return {"status": "skip", "failures": sorted({r.reason or "" for r in records.values()})}
        return {"status": "fail", "failures": failures or ["no verdict"], "failed": failed, "findings": findings}
    worst: dict[str, tuple[int, int]] = {}
    best: dict[str, Any] = {}
    for rank, step in steps:
        for column, value in _step_metrics(step).items():
            if column not in best or value > best[column]:
                best[column], worst[column] = value, (rank, step.step)
    hooks_rank, hooks_step = worst["hooks"]
    hooks = next(s for r, s in steps if r == hooks_rank and s.step == hooks_step)
    seconds: dict[int, list[float]] = {}
    for rank, step in steps:
        seconds.setdefault(rank, []).append(step.seconds)
    return {
        "status": "pass" if status == {"pass"} else "fail",
        "garbage": best["garbage"],
        "bytes_freed_only_by_gc": best["gc-only"],
        "bytes_held_after_step": best["held"],
        "max_abs_grad_err": best["max|dg|"],
        "hooks_fired": hooks.hooks_fired,
        "hooks_expected": hooks.hooks_expected,
        "step_seconds": max(sum(s) / len(s) for s in seconds.values()),
        "worst": {column: list(where) for column, where in worst.items()},
        "wrap": next((r.wrap for r in records.values()), "none"),
        "actions": _summed_actions(records),
        "failures": failures,
        "failed": failed,
        "grads_why": _grads_why(records),
        "findings": findings,
    }


def _summed_actions(records: dict[int, CaseRecord]) -> dict[str, dict[str, int]]:
    """The ranks' compute actions for one step (``{"lowered": {kind: n}, "planned": {kind: n}}``, kinds
    ``F``, ``B`` = full backward, ``I`` = B, ``W``; see the worker's ``action_counts``), summed over ranks;
    ``{}`` where no rank recorded them (a schedule without a lowered list)."""
    total: dict[str, dict[str, int]] = {}
    for record in records.values():
        for which, counts in record.actions.items():
            into = total.setdefault(which, {})
            for kind, n in counts.items():
                into[kind] = into.get(kind, 0) + n
    return total


def cell_ok(values: dict[str, Any]) -> dict[str, bool]:
    """Whether each column of a measured row passes (``step`` is not judged)."""
    checks = {check for _, _, check, _ in values["failed"]}
    return {
        "garbage": values["garbage"] == 0,
        "gc-only": values["bytes_freed_only_by_gc"] == 0,
        "held": values["bytes_held_after_step"] == 0,
        "max|dg|": "numerics" not in checks and "replicas" not in checks,
        "hooks": values["hooks_fired"] == values["hooks_expected"],
        "step": True,
        "finding": values["status"] == "pass",
    }


def format_cell(column: str, values: dict[str, Any], ok: bool) -> str:
    """One cell's text: the value and ``ok``/``FAIL`` (``step`` is not judged). A failing ``max|dg|`` with
    nothing measured says why instead of a misleading ``0.0e+00`` (``grads_why``, :func:`_grads_why`)."""
    if column == "max|dg|" and not ok and values["max_abs_grad_err"] == 0 and values.get("grads_why"):
        return f"{values['grads_why']} FAIL"
    if column == "finding":
        findings = values.get("findings") or []
        return "-" if values["status"] == "pass" or not findings else findings[0]["label"]
    text = {
        "garbage": lambda v: f"{v['garbage']}",
        "gc-only": lambda v: f"{v['bytes_freed_only_by_gc']} B",
        "held": lambda v: f"{v['bytes_held_after_step']} B",
        "max|dg|": lambda v: f"{v['max_abs_grad_err']:.1e}",
        "hooks": lambda v: f"{v['hooks_fired']}/{v['hooks_expected']}",
        "step": lambda v: f"{v['step_seconds'] * 1e3:.0f} ms",
    }[column](values)
    return text if column == "step" else f"{text} {'ok' if ok else 'FAIL'}"


def _behind(values: dict[str, Any]) -> int | None:
    """The index in ``values["failures"]`` of the failure behind the first failing cell (Note [worst
    cell]): the failure of that column's check at the cell's rank and step; the first failure when no
    cell fails (an exception, caches); ``None`` for a row without failures."""
    failed = values.get("failed") or []
    if "garbage" in values:
        oks = cell_ok(values)
        for column, check in _CHECKS.items():
            if oks[column]:
                continue
            rank, step = values["worst"][column]
            match = next((i for i, f in enumerate(failed) if f[:3] == [rank, step, check]), None)
            if match is not None:
                return match
    return 0 if values.get("failures") else None


def reason(values: dict[str, Any] | None) -> str:
    """The failure behind the first failing cell of a case (:func:`_behind`), one line:
    ``rank 1, step 0: hooks: ...``."""
    if values is None:
        return "no verdict"
    index = _behind(values)
    if index is None:
        return "no measurement"
    return values["failures"][index].replace("exception: ", "", 1).splitlines()[0]


def by_kind(failing: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Footnotes for failing rows ``(row name, values)``: one block per kind of failure, in
    ``ppbackward._tools.harness.diagnose.KINDS`` order, with its reason and public report, the rows that show it,
    and one failure as recorded (the one behind a row's first failing cell, Note [worst cell], when it
    is of that kind)."""
    blocks: dict[str, dict[str, Any]] = {}
    for name, values in failing:
        findings = values.get("findings") or [{"kind": "other", "label": "", "line": reason(values), "example": ""}]
        behind, index, failed = reason(values), _behind(values), values.get("failed") or []
        for finding in findings:
            key = finding["kind"] if finding["kind"] != "other" else finding["line"]
            block = blocks.setdefault(key, {"line": finding["line"], "rows": [], "example": ""})
            block["rows"].append(name)
            if not block["example"]:
                # the failure behind the first failing cell, as :func:`reason` shows it, where it is a
                # check's of this kind; an exception is quoted as recorded (``exception: ...``)
                same = (index is not None and index < len(failed) and failed[index][3] == finding["kind"]
                        and failed[index][2] != "exception")
                block["example"] = (behind if same else finding["example"]).splitlines()[0]
    lines: list[str] = []
    for _kind, block in sorted(blocks.items(), key=lambda item: ORDER.get(item[0], len(ORDER))):
        lines.append(f"- {block['line']}")
        lines.append(f"    in: {', '.join(block['rows'])}")
        shown = re.sub(r"^rank \d+, (exception: )?", "", block["example"])
        if block["example"] and shown != block["line"]:
            lines.append(f"    e.g. {block['example']}")
    return lines


def short_reason(values: dict[str, Any] | None) -> str:
    """A row that has no measurement: ``skipped: why`` or ``FAIL: <kind>`` (the raw message for an
    unknown kind, cut at 90 characters)."""
    if values is not None and values["status"] == "skip":
        return "skipped: " + (values.get("failures") or [""])[0]
    findings = (values or {}).get("findings") or []
    if findings and findings[0]["kind"] != "other":
        return f"FAIL: {findings[0]['label']}"
    first = re.sub(r"^rank \d+, (step \d+: )?", "", reason(values)).split(" (", 1)[0]
    return "FAIL: " + (first if len(first) <= 90 else first[:87] + "...")


def table(
    results: dict[str, dict[str, dict[str, Any]]], rows: list[tuple[str, str]], backwards: tuple[str, ...],
    markdown: bool = False,
) -> str:
    """The table: one row per ``(case id, row label)`` and backward; a row without measurement spans the
    metric columns with :func:`short_reason`. ``markdown``: GitHub-flavoured markdown (``check --markdown``)."""
    header = ["case", "backward", *COLUMNS]
    lines_: list[list[str]] = []
    for case, label in rows:
        for backward in backwards:
            values = results[backward].get(case)
            if values is None or "garbage" not in values:
                lines_.append([label, backward, short_reason(values)])
                continue
            oks = cell_ok(values)
            lines_.append([label, backward, *(format_cell(c, values, oks[c]) for c in COLUMNS)])
    return format_table(header, lines_, markdown=markdown)
