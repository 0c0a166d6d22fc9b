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
* ``finding``: for a failing row, the kind of its first failure (``ppbackward._tools.harness.diagnose``);
* ``split`` (only in a table with a model of torch.compile'd regions: ``ModelSpec.regions_per_b``): the
  regions each B call split into B and W, the fewest (``-most`` where they differ) over the ranks and
  steps, ``ok`` when every B call split every region of its stage (Note [regions counted] in
  ``ppbackward._tools.harness.probes``); ``no B`` where the schedule ran none, ``-`` where B's param groups
  do not say (torch's own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ppbackward._tools.harness.diagnose import ORDER, Finding, diagnose
from ppbackward._tools.harness.records import CaseRecord, Failure, RegionsRecord, StepMeasures
from ppbackward._tools.text_table import format_table

__all__ = [  # private module: what other modules use
    "Cell",
    "Footnote",
    "Measures",
    "RankFailure",
    "RankFinding",
    "by_kind",
    "cell_ok",
    "cell_values",
    "footnotes",
    "format_cell",
    "format_footnotes",
    "progress_status",
    "progress_status_of",
    "reason",
    "short_reason",
    "table",
]

COLUMNS = ("garbage", "gc-only", "held", "max|dg|", "hooks", "step", "finding")
#: The column of compiled regions split per B, after ``step`` where a table has it (:func:`table`).
SPLIT_COLUMN = "split"

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


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """One failure of a case with the rank that recorded it.

    Attributes:
        rank (int): the rank.
        failure (Failure): the failure, as recorded.
    """

    rank: int
    failure: Failure

    @property
    def text(self) -> str:
        """``rank 1, step 0: hooks: ...`` or ``rank 0, exception: ...`` (str): as ``--json`` lists it."""
        return f"rank {self.rank}, {self.failure.text}"

    @property
    def shown(self) -> str:
        """The first line of the failure without its rank, an exception without ``exception: `` (str)."""
        f = self.failure
        return (f.message if f.check == "exception" else f.text).splitlines()[0]

    @property
    def bare(self) -> str:
        """The first line without rank nor step (str): ``hooks: ...``, an exception's or a case's message."""
        f = self.failure
        return (f.message if f.check in ("exception", "case") else f"{f.check}: {f.message}").splitlines()[0]


@dataclasses.dataclass(frozen=True)
class RankFinding:
    """A kind of failure found in a case (``diagnose.Finding``) with the rank of its example.

    Attributes:
        rank (int): the rank whose failure is the example.
        finding (Finding): the kind and its first failure on that rank.
    """

    rank: int
    finding: Finding

    @property
    def example(self) -> RankFailure:
        """The failure that shows the kind, with its rank (RankFailure)."""
        return RankFailure(self.rank, self.finding.failure)

    def to_json(self) -> dict[str, str]:
        """``{"kind", "label", "line", "example"}`` (dict[str, str]), as ``--json`` writes it."""
        kind = self.finding.kind
        return {"kind": kind.key, "label": kind.label, "line": self.finding.line, "example": self.example.text}


def _findings(records: dict[int, CaseRecord]) -> tuple[RankFinding, ...]:
    """The kinds of failure over every rank, most telling first, each with one example and its rank; an
    ``other`` failure is a kind of its own, told apart by its text."""
    found: dict[str, RankFinding] = {}
    for rank, record in records.items():
        for finding in diagnose(record):
            key = finding.kind.key if finding.kind.key != "other" else finding.example
            found.setdefault(key, RankFinding(rank, finding))
    return tuple(sorted(found.values(), key=lambda f: ORDER.get(f.finding.kind.key, len(ORDER))))


def _grads_why(records: dict[int, CaseRecord]) -> str | None:
    """Why ``max|dg|`` fails where its number does not: ``grad None`` (a grad the reference has is None in the
    pipeline), ``grad set`` (the reverse), ``grad shape`` (another shape than the reference's), ``loss``,
    ``losses`` (their count) or ``replicas``, from the numerics records of the ranks with a numerics or replicas
    failure; ``None`` where none, or where a grad compared was outside the tolerance (the number is then the
    failure shown)."""
    steps = [s.numerics for r in records.values() if any(f.check in ("numerics", "replicas") for f in r.failures)
             for s in r.steps if s.numerics is not None]
    if any(n.grads_outside for n in steps):
        return None
    for why, found in (("grad None", any(n.grads_none for n in steps)),
                       ("grad set", any(n.grads_unexpected for n in steps)),
                       ("grad shape", any(n.grads_misshaped for n in steps)),
                       ("loss", any(n.losses_wrong for n in steps)),
                       ("losses", any(n.losses_miscounted for n in steps)),
                       ("replicas", any(n.replicas_diverged for n in steps))):
        if found:
            return why
    return None


@dataclasses.dataclass(frozen=True)
class Measures:
    """A measured row's values (Note [worst cell]): each column's worst over the ranks and steps.

    Attributes:
        garbage (int): tensors + autograd nodes in reference cycles.
        bytes_freed_only_by_gc (int): bytes of saved activations freed only by a gc run.
        bytes_held_after_step (int): bytes of saved activations alive after the step and a gc run.
        max_abs_grad_err (float): max |grad - reference|.
        hooks_fired, hooks_expected (int): the hook calls of the rank and step furthest from expected.
        step_seconds (float): the slowest rank's mean step.
        worst (dict[str, tuple[int, int]]): the (rank, step) each judged column comes from.
        wrap (str): the case's wrapper.
        actions (dict[str, dict[str, int]]): the compute actions of one step, summed over ranks.
        grads_why (str | None): why ``max|dg|`` fails where its number passes (:func:`_grads_why`).
        regions (RegionsRecord | None): the compiled regions B split, over the ranks and steps
            (``RegionsRecord.summed``); ``None`` where they were not counted.
    """

    garbage: int
    bytes_freed_only_by_gc: int
    bytes_held_after_step: int
    max_abs_grad_err: float
    hooks_fired: int
    hooks_expected: int
    step_seconds: float
    worst: dict[str, tuple[int, int]]
    wrap: str
    actions: dict[str, dict[str, int]]
    grads_why: str | None
    regions: RegionsRecord | None = None


@dataclasses.dataclass(frozen=True)
class Cell:
    """One case and backward of the table (one row's cells), typed; text only when rendered.

    Attributes:
        status (str): ``pass``, ``fail`` or ``skip``.
        failures (tuple[RankFailure, ...]): every rank's failures, ranks in order.
        findings (tuple[RankFinding, ...]): the kinds of failure, most telling first.
        measures (Measures | None): the columns; ``None`` where no rank measured a step.
        skipped (tuple[str, ...]): why the case was skipped (``status == "skip"``), sorted.
    """

    status: str
    failures: tuple[RankFailure, ...] = ()
    findings: tuple[RankFinding, ...] = ()
    measures: Measures | None = None
    skipped: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The row as ``--json``'s ``results`` hold it (dict[str, Any]; keys unchanged since the dicts)."""
        if self.status == "skip":
            return {"status": "skip", "failures": list(self.skipped)}
        failed = [[f.rank, f.failure.step, f.failure.check, f.failure.kind] for f in self.failures]
        findings = [f.to_json() for f in self.findings]
        texts = [f.text for f in self.failures]
        m = self.measures
        if m is None:
            return {"status": self.status, "failures": texts or ["no verdict"], "failed": failed, "findings": findings}
        return {
            "status": self.status, "garbage": m.garbage, "bytes_freed_only_by_gc": m.bytes_freed_only_by_gc,
            "bytes_held_after_step": m.bytes_held_after_step, "max_abs_grad_err": m.max_abs_grad_err,
            "hooks_fired": m.hooks_fired, "hooks_expected": m.hooks_expected, "step_seconds": m.step_seconds,
            "worst": {column: list(where) for column, where in m.worst.items()}, "wrap": m.wrap,
            "actions": m.actions, "failures": texts, "failed": failed, "grads_why": m.grads_why,
            "findings": findings, **({} if m.regions is None else {"regions": dataclasses.asdict(m.regions)}),
        }


def cell_values(per_rank: dict[int, CaseRecord | None]) -> Cell:
    """Aggregate one case's per-rank records into its row (:class:`Cell`).

    Note [worst cell]: every column shows the worst rank and step for that column (the largest value;
    for ``hooks``, the rank and step whose count is furthest from expected, shown as fired/expected of
    that rank and step), and ``worst`` remembers which (rank, step) each column came from, so that the
    footnote of a failing case quotes the failure behind the first failing cell. A rank with no trainable
    parameter (a frozen stage: 0 hook calls expected) is the ``hooks`` cell only when every rank is one.
    """
    records = {rank: r for rank, r in per_rank.items() if r}
    failures = tuple(RankFailure(rank, f) for rank, r in records.items() for f in r.failures)
    status = {r.status for r in records.values()}
    steps = [(rank, StepMeasures.from_record(s)) for rank, r in records.items() for s in r.steps]
    if not steps and status == {"skip"}:
        return Cell("skip", skipped=tuple(sorted({r.reason or "" for r in records.values()})))
    findings = _findings(records)
    if not steps:
        return Cell("fail", failures, findings)
    return Cell("pass" if status == {"pass"} else "fail", failures, findings, _measures(records, steps))


def _measures(records: dict[int, CaseRecord], steps: list[tuple[int, StepMeasures]]) -> Measures:
    """The columns of a row from its ranks' measured ``steps`` ``(rank, measures)`` (Note [worst cell])."""
    worst: dict[str, tuple[int, int]] = {}
    best: dict[str, Any] = {}
    for rank, step in steps:
        for column, value in _step_metrics(step).items():
            if column not in best or value > best[column]:
                best[column], worst[column] = value, (rank, step.step)
    hooks = next(s for r, s in steps if (r, s.step) == worst["hooks"])
    seconds: dict[int, list[float]] = {}
    for rank, step in steps:
        seconds.setdefault(rank, []).append(step.seconds)
    return Measures(
        garbage=best["garbage"], bytes_freed_only_by_gc=best["gc-only"], bytes_held_after_step=best["held"],
        max_abs_grad_err=best["max|dg|"], hooks_fired=hooks.hooks_fired, hooks_expected=hooks.hooks_expected,
        step_seconds=max(sum(s) / len(s) for s in seconds.values()), worst=worst,
        wrap=next((r.wrap for r in records.values()), "none"), actions=_summed_actions(records),
        grads_why=_grads_why(records), regions=RegionsRecord.summed([s.regions for _, s in steps]),
    )


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


def _measured(cell: Cell) -> Measures:
    """``cell.measures``, for a row that has them (Measures)."""
    if cell.measures is None:
        raise ValueError("a row without measurement has no cells to judge")
    return cell.measures


def cell_ok(cell: Cell) -> dict[str, bool]:
    """Whether each column of a measured row passes (``step`` is not judged): dict[str, bool] by column."""
    m, checks = _measured(cell), {f.failure.check for f in cell.failures}
    return {
        "garbage": m.garbage == 0,
        "gc-only": m.bytes_freed_only_by_gc == 0,
        "held": m.bytes_held_after_step == 0,
        "max|dg|": "numerics" not in checks and "replicas" not in checks,
        "hooks": m.hooks_fired == m.hooks_expected,
        "step": True,
        "finding": cell.status == "pass",
        SPLIT_COLUMN: "regions" not in checks,
    }


def format_cell(column: str, cell: Cell, ok: bool) -> str:
    """One cell's text (str): the value and ``ok``/``FAIL`` (``step`` is not judged). A failing ``max|dg|``
    whose number is within the tolerance says why instead (``grads_why``, :func:`_grads_why`): ``grad None
    FAIL``, not a passing ``1.2e-07`` or ``0.0e+00`` marked FAIL."""
    m = _measured(cell)
    if column == "max|dg|" and not ok and m.grads_why:
        return f"{m.grads_why} FAIL"
    if column == "finding":
        return "-" if cell.status == "pass" or not cell.findings else cell.findings[0].finding.kind.label
    if column == SPLIT_COLUMN:
        return _split_text(m.regions, ok)
    text = {
        "garbage": f"{m.garbage}",
        "gc-only": f"{m.bytes_freed_only_by_gc} B",
        "held": f"{m.bytes_held_after_step} B",
        "max|dg|": f"{m.max_abs_grad_err:.1e}",
        "hooks": f"{m.hooks_fired}/{m.hooks_expected}",
        "step": f"{m.step_seconds * 1e3:.0f} ms",
    }[column]
    return text if column == "step" else f"{text} {'ok' if ok else 'FAIL'}"


def _split_text(regions: RegionsRecord | None, ok: bool) -> str:
    """The ``split`` cell: regions per B call (``2/B``, ``1-2/B``), judged ``ok``/``FAIL`` where an expected
    count applies; ``-`` where not counted (torch's B), ``no B`` where the case ran no B call."""
    if regions is None or not regions.counted:
        return "-"
    if not regions.b_calls:
        return "no B"
    per = f"{regions.fewest}" if regions.fewest == regions.most else f"{regions.fewest}-{regions.most}"
    return f"{per}/B" + ((" ok" if ok else " FAIL") if regions.expected else "")


def _behind(cell: Cell) -> RankFailure | None:
    """The failure behind the first failing cell (Note [worst cell]): the failure of that column's check at
    the cell's rank and step; the first failure when no cell fails (an exception, caches); ``None`` for a
    row without failures."""
    if cell.measures is not None:
        oks = cell_ok(cell)
        for column, check in _CHECKS.items():
            if oks[column]:
                continue
            where = (*cell.measures.worst[column], check)
            match = next((f for f in cell.failures if (f.rank, f.failure.step, f.failure.check) == where), None)
            if match is not None:
                return match
    return cell.failures[0] if cell.failures else None


def reason(cell: Cell | None) -> str:
    """The failure behind the first failing cell of a case (:func:`_behind`), one line (str):
    ``rank 1, step 0: hooks: ...``; an exception without its ``exception: ``."""
    behind = None if cell is None else _behind(cell)
    if behind is None:
        return "no verdict" if cell is None or cell.measures is None else "no measurement"
    return f"rank {behind.rank}, {behind.shown}"


@dataclasses.dataclass
class Footnote:
    """One kind of failure under the verdict: its ``line`` (str: label and reason, or an ``other``
    failure's message), the ``rows`` that show it (list[str]) and one ``example`` (RankFailure | None)."""

    line: str
    rows: list[str]
    example: RankFailure | None = None

    @property
    def quoted(self) -> RankFailure | None:
        """The example where it says more than :attr:`line` (RankFailure | None): the one printed."""
        return self.example if self.example is not None and self.example.shown != self.line else None


def footnotes(failing: list[tuple[str, Cell | None]]) -> list[Footnote]:
    """Footnotes for failing rows ``(row name, cell)``: one per kind of failure, in
    ``ppbackward._tools.harness.diagnose.KINDS`` order, the rows that show it, and one failure as recorded
    (the one behind a row's first failing cell, Note [worst cell], when it is a check's of that kind)."""
    notes: dict[str, Footnote] = {}
    for name, cell in failing:
        behind = None if cell is None else _behind(cell)
        kinds: list[tuple[str, str, RankFailure | None]] = [
            (f.finding.kind.key, f.finding.line, f.example) for f in (cell.findings if cell else ())]
        for key, line, example in kinds or [("other", reason(cell), None)]:
            note = notes.setdefault(key if key != "other" else line, Footnote(line, []))
            note.rows.append(name)
            if note.example is None:
                same = behind is not None and behind.failure.kind == key and behind.failure.check != "exception"
                note.example = behind if same else example
    return [note for _, note in sorted(notes.items(), key=lambda item: ORDER.get(item[0], len(ORDER)))]


def format_footnotes(notes: list[Footnote], markdown: bool = False) -> list[str]:
    """The footnotes' lines (list[str]): ``- line``, ``    in: rows``, ``    e.g. rank r, ...``.

    ``markdown``: ``in:`` and ``e.g.`` as items of a list nested in the kind's item (``  - in: rows``,
    ``  - e.g. ...``), so that they render on lines of their own; indented plain lines continue the kind's
    paragraph in Markdown and render as one run-on line (``check --markdown``)."""
    sub = "  - " if markdown else "    "
    lines: list[str] = []
    for note in notes:
        lines += [f"- {note.line}", f"{sub}in: {', '.join(note.rows)}"]
        if note.quoted is not None:
            lines.append(f"{sub}e.g. {note.quoted.text.splitlines()[0]}")
    return lines


def by_kind(failing: list[tuple[str, Cell | None]], markdown: bool = False) -> list[str]:
    """:func:`format_footnotes` of :func:`footnotes` (list[str]); ``markdown`` as there."""
    return format_footnotes(footnotes(failing), markdown=markdown)


def short_reason(cell: Cell | None) -> str:
    """A row that has no measurement (str): ``skipped: why`` or ``FAIL: <kind>`` (the failure as recorded,
    without rank, step and any parenthesis, for an unknown kind, cut at 90 characters)."""
    if cell is not None and cell.status == "skip":
        return "skipped: " + (cell.skipped[0] if cell.skipped else "")
    if cell is not None and cell.findings and cell.findings[0].finding.kind.key != "other":
        return f"FAIL: {cell.findings[0].finding.kind.label}"
    behind = None if cell is None else _behind(cell)
    first = (reason(cell) if behind is None else behind.bare).split(" (", 1)[0]
    return "FAIL: " + (first if len(first) <= 90 else first[:87] + "...")


def table(
    results: dict[str, dict[str, Cell]], rows: list[tuple[str, str]], backwards: tuple[str, ...],
    markdown: bool = False,
) -> str:
    """The table (str): one row per ``(case id, row label)`` and backward; a row without measurement spans
    the metric columns with :func:`short_reason`. The ``split`` column comes after ``step`` where a row
    counted compiled regions. ``markdown``: GitHub-flavoured markdown (``check --markdown``)."""
    shown = [results[b].get(case) for case, _ in rows for b in backwards]
    split = any(c is not None and c.measures is not None and c.measures.regions is not None for c in shown)
    columns = (*COLUMNS[:-1], SPLIT_COLUMN, COLUMNS[-1]) if split else COLUMNS
    header = ["case", "backward", *columns]
    lines_: list[list[str]] = []
    for case, label in rows:
        for backward in backwards:
            cell = results[backward].get(case)
            if cell is None or cell.measures is None:
                lines_.append([label, backward, short_reason(cell)])
                continue
            oks = cell_ok(cell)
            lines_.append([label, backward, *(format_cell(c, cell, oks[c]) for c in columns)])
    return format_table(header, lines_, markdown=markdown)
