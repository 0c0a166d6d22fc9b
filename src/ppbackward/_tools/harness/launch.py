"""Private: start the harness worker under torchrun, bounded in time, and read back per-rank verdicts.

:func:`launch` runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m
ppbackward._tools.harness.worker ...`` through ``ppbackward._tools.torchrun`` (the one module that starts torchrun
processes: the current interpreter, a session of its own, ``OMP_NUM_THREADS=1``). torchrun's own output goes to
``<out>/torchrun.log``; every worker writes ``<out>/rank<r>.log``, ``<out>/rank<r>.json`` (its verdict,
rewritten after every case) and ``<out>/rank<r>.pid``.

Note [hang clock]: a launch is judged hung by events, never by how long the machine takes to start
processes. Every worker writes ``rank<r>.json`` once its process group is up and again after every case.
The hang clock starts when every rank has written it (all started) and restarts whenever any rank's file
changes; ``timeout`` seconds without such progress is a hang. Until every rank has started, only the
generous ``startup_timeout`` applies (a backstop for a rendezvous that never completes).

A hung launch is stopped by ``ppbackward._tools.torchrun.stop`` (Note [killing a hung launch] there): every
worker's stack dumped to its log, then every process of the launch killed.

:class:`LaunchResult` then answers "did every rank report, and did every case pass", and formats what
went wrong as one block per failing case (each failing rank's failures, traceback and log excerpt),
or one block for the whole launch (timeout, crash, missing verdicts) with every rank's log tail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ppbackward._tools.torchrun import alive, dump_stacks, start, stop, tail, torchrun_command

__all__ = ["LaunchResult", "alive", "launch"]

WORKER_MODULE = "ppbackward._tools.harness.worker"
_TAIL = 40  # log lines shown per rank
_CASE_LOG = 20  # log lines shown per rank for one case
_POLL_S = 0.5


def _src_root() -> str:
    import ppbackward

    return str(Path(ppbackward.__file__).resolve().parents[1])


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


@dataclasses.dataclass
class LaunchResult:
    """What one torchrun launch left behind; see the module docstring."""

    command: list[str]
    out_dir: Path
    world_size: int
    returncode: int | None
    timeout: float
    seconds: float
    verdicts: dict[int, dict[str, Any] | None]
    progress: list[str] = dataclasses.field(default_factory=list)  # case ids passed to ``on_case``, in order
    hang: str | None = None  # "startup" or "progress" when timed out (Note [hang clock])
    startup_timeout: float = 0.0

    @property
    def timed_out(self) -> bool:
        """Whether the launch was judged hung and killed (``hang`` says which clock ran out)."""
        return self.hang is not None

    # -- reading --------------------------------------------------------------------------------
    def log_path(self, rank: int) -> Path:
        return self.out_dir / f"rank{rank}.log"

    def log_tail(self, rank: int, lines: int = _TAIL) -> str:
        return tail(self.log_path(rank), lines)

    def case_ids(self) -> list[str]:
        """Case ids in run order, as reported by any rank."""
        seen: dict[str, None] = {}
        for verdict in self.verdicts.values():
            for record in (verdict or {}).get("cases", []):
                seen.setdefault(record["id"], None)
        return list(seen)

    def case(self, case_id: str) -> dict[int, dict[str, Any] | None]:
        """``{rank: record or None}`` for one case (``None``: that rank has no record for it)."""
        found: dict[int, dict[str, Any] | None] = {}
        for rank, verdict in sorted(self.verdicts.items()):
            found[rank] = next((r for r in (verdict or {}).get("cases", []) if r["id"] == case_id), None)
        return found

    def case_status(self, case_id: str) -> str:
        """``pass``, ``skip`` or ``fail`` for the case across all ranks (missing records fail)."""
        records = self.case(case_id).values()
        if any(r is None for r in records):
            return "fail"
        statuses = {r["status"] for r in records if r is not None}
        if statuses == {"skip"}:
            return "skip"
        return "pass" if statuses <= {"pass"} else "fail"

    # -- launch-level problems ----------------------------------------------------------------
    def launch_problems(self) -> list[str]:
        """Why the launch itself is broken (timeout, exit code, missing or incomplete verdicts)."""
        problems = []
        if self.timed_out and self.hang == "startup":
            missing = [str(r) for r in range(self.world_size) if self.verdicts.get(r) is None]
            problems.append(
                f"timed out: rank(s) {', '.join(missing) or '?'} had not started {self.startup_timeout:.0f}s after "
                "the launch; the process groups of torchrun and of every worker were killed"
            )
        elif self.timed_out:
            problems.append(
                f"timed out: no rank made progress for {self.timeout:.0f}s after every rank had started; each "
                "worker's stack was dumped to its log, then the process groups of torchrun and of every worker "
                "were killed"
            )
        elif self.returncode != 0:
            problems.append(f"torchrun exited with code {self.returncode}")
        for rank in range(self.world_size):
            verdict = self.verdicts.get(rank)
            if verdict is None:
                problems.append(f"rank {rank} wrote no verdict ({self.out_dir / f'rank{rank}.json'})")
            elif verdict.get("fatal"):
                problems.append(f"rank {rank} stopped on an exception:\n{_indent(verdict['fatal'].rstrip())}")
            elif not verdict.get("complete"):
                problems.append(f"rank {rank} did not finish its cases (last: {self._last_case(verdict)})")
        return problems

    @staticmethod
    def _last_case(verdict: dict[str, Any]) -> str:
        cases = verdict.get("cases") or []
        return cases[-1]["id"] if cases else "none started"

    @property
    def complete(self) -> bool:
        return not self.launch_problems()

    @property
    def ok(self) -> bool:
        return self.complete and all(self.case_status(c) != "fail" for c in self.case_ids())

    # -- formatting ------------------------------------------------------------------------------
    def _header(self) -> str:
        backward = next((v.get("backward") for v in self.verdicts.values() if v), "?")
        return f"world size {self.world_size}, backward={backward}"

    def format_launch(self) -> str:
        """One block: launch-level problems, the command, torchrun's log tail and every rank's log tail."""
        lines = [f"=== torchrun launch ({self._header()}, {self.seconds:.1f}s) ==="]
        for problem in self.launch_problems():
            first, *rest = problem.splitlines()
            lines.append(f"  {first}")
            lines.extend(rest)
        lines.append(f"  command: {' '.join(self.command)}")
        lines.append(f"  output: {self.out_dir}")
        lines.append("  torchrun log tail:")
        lines.append(_indent(tail(self.out_dir / "torchrun.log", 15)))
        for rank in range(self.world_size):
            lines.append(f"  rank {rank} log tail ({self.log_path(rank)}):")
            lines.append(_indent(self.log_tail(rank)))
        return "\n".join(lines)

    def _case_log(self, rank: int, case_id: str) -> str:
        """The lines rank ``rank`` logged while running ``case_id`` (bounded)."""
        try:
            text = self.log_path(rank).read_text(errors="replace").splitlines()
        except OSError:
            return "<no log>"
        start = next((i for i, line in enumerate(text) if line.endswith(f">>> {case_id}")), None)
        if start is None:
            return "\n".join(text[-_TAIL:])
        end = next((i for i in range(start + 1, len(text)) if ">>> " in text[i]), len(text))
        section = text[start:end]
        return "\n".join(section if len(section) <= _CASE_LOG else ["...", *section[-_CASE_LOG:]])

    def format_case(self, case_id: str) -> str:
        """One block for one case: every rank's status, and each failing rank's details and log."""
        records = self.case(case_id)
        lines = [f"=== {case_id} ({self._header()}) ==="]
        for rank, record in records.items():
            if record is None:
                lines.append(f"rank {rank}: no record for this case")
                lines.append(_indent(self.log_tail(rank)))
                continue
            where = f"rank {rank} [stages {','.join(map(str, record.get('stages', [])))}]"
            lines.append(f"{where}: {record['status']}")
            if record["status"] in ("pass", "skip"):
                if record.get("reason"):
                    lines.append(f"    {record['reason']}")
                continue
            lines.extend(f"    {f}" for f in record.get("failures", []))
            for step in record.get("steps", []):
                for chain in step.get("garbage", {}).get("chains", [])[:1]:
                    lines.append(f"    step {step['step']} first back-reference chain:")
                    lines.append(_indent(chain, "      "))
            if record.get("error"):
                lines.append("    traceback:")
                lines.append(_indent(record["error"].rstrip(), "      "))
            lines.append(f"    log ({self.log_path(rank)}):")
            lines.append(_indent(self._case_log(rank, case_id), "      "))
        return "\n".join(lines)

    def format_failures(self) -> str:
        """Every problem of the launch: the launch block (if any), then one block per failing case."""
        blocks = []
        if self.launch_problems():
            blocks.append(self.format_launch())
        blocks += [self.format_case(c) for c in self.case_ids() if self.case_status(c) == "fail"]
        return "\n\n".join(blocks)

    def summary(self) -> str:
        """One line per case: status and time per rank."""
        lines = []
        for case_id in self.case_ids():
            times = [f"{(r or {}).get('seconds', 0):.2f}" for r in self.case(case_id).values()]
            lines.append(f"{self.case_status(case_id):4}  {case_id}  ({'/'.join(times)} s per rank)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# launching


def _read_verdict(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


#: ``on_case(case_id, {rank: record})``: a case every rank has reported, with every rank's record.
OnCase = Callable[[str, dict[int, dict[str, Any]]], None]
QUIET_S = 10.0  # seconds without a finished case before ``on_wait`` says what is running


class _CaseReporter:
    """Progress of a launch, for a command line (Note [progress says what runs]).

    Calls ``on_case`` once per case, in rank 0's order, as soon as every rank has written its record of
    that case (so that the status is the case's over all ranks, as its table row will be), and
    ``on_wait`` with what is running whenever ``quiet_s`` seconds (of ``clock``) pass without one.
    """

    def __init__(
        self,
        out_dir: Path,
        nproc: int,
        on_case: OnCase | None,
        on_wait: Callable[[str], None] | None = None,
        quiet_s: float = QUIET_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out_dir, self.nproc = out_dir, nproc
        self.on_case, self.on_wait = on_case, on_wait
        self.quiet_s, self.clock = quiet_s, clock
        self.reported = 0
        self.quiet_since = clock()

    def poll(self) -> None:
        if self.on_case is not None:
            self._report_cases(self.on_case)
        if self.on_wait is not None and self.clock() - self.quiet_since >= self.quiet_s:
            self.on_wait(self.running())
            self.quiet_since = self.clock()

    def _report_cases(self, on_case: OnCase) -> None:
        verdicts = {r: _read_verdict(self.out_dir / f"rank{r}.json") or {} for r in range(self.nproc)}
        by_rank = {r: {c["id"]: c for c in v.get("cases", [])} for r, v in verdicts.items()}
        order = [c["id"] for c in verdicts[0].get("cases", [])]
        for case_id in order[self.reported :]:
            if not all(case_id in cases for cases in by_rank.values()):
                break  # a rank is still on it: report in order, once every rank has
            on_case(case_id, {r: cases[case_id] for r, cases in by_rank.items()})
            self.reported += 1
            self.quiet_since = self.clock()

    def running(self) -> str:
        """``running ScheduleGPipe/mlp (rank 0's log), 2/2 ranks started`` or ``starting: ...``."""
        started = sum((self.out_dir / f"rank{r}.json").exists() for r in range(self.nproc))
        if started < self.nproc:
            return f"starting: {started}/{self.nproc} ranks have joined the process group"
        current = _current_case(self.out_dir / "rank0.log")
        if current is None:
            return f"all {self.nproc} ranks started; building the first case"
        return f"still running {current} (rank 0's log; {self.reported} case(s) done)"


# Note [progress says what runs]: a launch prints nothing between two finished cases, and starting torchrun
# on a busy machine or one slow case (a compiled model, a long schedule) can take tens of seconds. The
# reporter therefore says, every QUIET_S seconds without a finished case, what the launch is doing: ranks
# still joining, or the case rank 0's log names last (each worker logs ``>>> <case id>`` as a case starts).


def _current_case(log: Path) -> str | None:
    """The case id of the last ``>>> <case id>`` line of a worker's log, ``None`` before the first."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.split(">>> ", 1)[1] for line in reversed(lines) if ">>> " in line), None)


def _progress_marks(out_dir: Path, nproc: int) -> tuple[tuple[int, int] | None, ...]:
    """``(mtime_ns, size)`` of every rank's verdict file, ``None`` where it does not exist yet."""
    marks: list[tuple[int, int] | None] = []
    for rank in range(nproc):
        try:
            st = (out_dir / f"rank{rank}.json").stat()
        except OSError:
            marks.append(None)
            continue
        marks.append((st.st_mtime_ns, st.st_size))
    return tuple(marks)


def _wait(
    proc: subprocess.Popen[bytes],
    out_dir: Path,
    nproc: int,
    timeout: float,
    startup_timeout: float,
    reporter: _CaseReporter,
) -> str | None:
    """Wait for ``proc`` to exit, reporting cases as they finish; on a hang return its kind,
    ``"startup"`` or ``"progress"`` (Note [hang clock]); ``None`` once ``proc`` exited."""
    t0 = time.monotonic()
    last: tuple[tuple[int, int] | None, ...] = ()
    changed_at = t0
    while True:
        try:
            proc.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        reporter.poll()
        if proc.returncode is not None:
            return None
        now = time.monotonic()
        marks = _progress_marks(out_dir, nproc)
        if None in marks:  # not every rank has started
            if now - t0 >= startup_timeout:
                return "startup"
            continue
        if marks != last:
            last, changed_at = marks, now
        elif now - changed_at >= timeout:
            return "progress"


def launch(
    nproc: int,
    worker_args: Sequence[str],
    out_dir: str | os.PathLike[str],
    timeout: float,
    env: dict[str, str] | None = None,
    on_case: OnCase | None = None,
    startup_timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
    module: str = WORKER_MODULE,
    python: str | None = None,
) -> LaunchResult:
    """Run the harness worker on ``nproc`` ranks; a hang is stopped in bounded time (Note [hang clock]).

    Args:
        nproc: processes (ranks) to start, all on this machine.
        worker_args: arguments of ``python -m ppbackward._tools.harness.worker`` besides ``--out`` and
            ``--launched-at`` (e.g. ``["--backward", "ppbackward", "--schedules", "Schedule1F1B"]``).
        out_dir: folder for logs and verdicts; created, and emptied of earlier verdicts and logs.
        timeout: seconds without progress (no rank finishing a case) once every rank has started, before
            every rank's stack is dumped and every process of the launch killed (Note [killing a hung
            launch]). It does not count the time the machine takes to start the ranks.
        env: extra environment variables for torchrun and the workers.
        on_case: called in this process as ``on_case(case_id, {rank: record})`` for each case, in rank
            0's order, as soon as every rank has finished it (polled from the verdict files twice a
            second): progress for a command line.
        startup_timeout: seconds for every rank to start (write its first verdict) before the launch is
            killed; default ``max(300, timeout)``: a backstop, never reached on a healthy machine.
        on_wait: called with one line saying what is running whenever ``QUIET_S`` seconds pass without
            a finished case (Note [progress says what runs]).
        module: the worker module torchrun starts (default the harness worker). Another module must keep
            the harness worker's protocol: take ``--out DIR --launched-at T`` first, write
            ``rank<r>.pid``, ``rank<r>.json`` (``{"cases": [...], "complete", "fatal"}``) once started and
            after every case, and dump its stacks on ``SIGUSR1`` (the torchtitan test's worker does).
        python: the interpreter that runs torchrun and the workers (default: this one); ppbackward comes
            from this checkout through ``PYTHONPATH`` either way.

    Returns:
        A :class:`LaunchResult`; it raises nothing for a failed, crashed or hung launch.
    """
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("rank*.*"), out / "torchrun.log"]:
        old.unlink(missing_ok=True)
    startup = max(300.0, timeout) if startup_timeout is None else startup_timeout
    command = torchrun_command(
        nproc, module, ["--out", str(out), "--launched-at", f"{time.time():.3f}", *worker_args], python=python
    )
    full_env = {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (_src_root(), os.environ.get("PYTHONPATH", "")) if p),
        **(env or {}),
    }
    t0 = time.monotonic()
    progress: list[str] = []

    def seen(case_id: str, per_rank: dict[int, dict[str, Any]]) -> None:
        progress.append(case_id)
        on_case(case_id, per_rank)  # type: ignore[misc]

    reporter = _CaseReporter(out, nproc, None if on_case is None else seen, on_wait)
    proc = start(command, out / "torchrun.log", full_env)
    try:
        hang = _wait(proc, out, nproc, timeout, startup, reporter)
        if hang is not None:
            dump_stacks(out, module)
            stop(proc, out, module)
    except BaseException:  # KeyboardInterrupt, pytest-timeout: never leave processes behind
        dump_stacks(out, module, grace=2.0)
        stop(proc, out, module)
        raise
    return LaunchResult(
        command=command,
        out_dir=out,
        world_size=nproc,
        returncode=proc.returncode,
        timeout=timeout,
        seconds=time.monotonic() - t0,
        verdicts={r: _read_verdict(out / f"rank{r}.json") for r in range(nproc)},
        progress=progress,
        hang=hang,
        startup_timeout=startup,
    )
