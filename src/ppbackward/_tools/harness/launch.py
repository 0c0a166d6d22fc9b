"""Private: start the harness worker under torchrun, bounded in time, and read back per-rank verdicts.

:func:`launch` runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m
ppbackward._tools.harness.worker ...`` through ``ppbackward._tools.torchrun`` (the one module that starts torchrun
processes: the current interpreter, a session of its own, ``OMP_NUM_THREADS=1``). torchrun's own output goes to
``<out>/torchrun.log``; every worker writes ``<out>/rank<r>.log``, ``<out>/rank<r>.json`` (its verdict,
rewritten after every case), ``<out>/rank<r>.events.jsonl`` (its events, Note [event stream] in
:mod:`ppbackward._tools.harness.records`) and ``<out>/rank<r>.pid``.

Note [hang clock]: a launch is judged hung by events, never by how long the machine takes to start
processes nor by a fixed time scaled by its speed. Every worker appends a ``started`` event to its event
stream once its process group is up, then an event as each case starts, each measured step ends and each
case ends. The hang clock starts when every rank has written ``started`` and restarts whenever any rank
writes a new event; ``timeout`` seconds without one is a hang. Until every rank has started, only the
generous ``startup_timeout`` applies (a backstop for a rendezvous that never completes).

A hung launch is stopped by ``ppbackward._tools.torchrun.stop`` (Note [killing a hung launch] there): every
worker's stack dumped to its log, then every process of the launch killed.

:class:`LaunchResult` then answers "did every rank report, and did every case pass", and formats what
went wrong as one block per failing case (each failing rank's failures, traceback and log excerpt),
or one block for the whole launch (timeout, crash, missing verdicts) with every rank's log tail.

A worker module other than the harness worker (``launch(module=...)``: the torchtitan test's) keeps the
harness worker's protocol: it takes ``--out DIR --launched-at T`` first, writes ``rank<r>.pid``, the events
of Note [event stream] (``records.EventWriter``) and ``rank<r>.json`` (a ``records.RankVerdict``), and
dumps its stacks on ``SIGUSR1``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ppbackward._tools.harness.records import CaseRecord, EventReader, RankVerdict, read_verdict
from ppbackward._tools.torchrun import alive, dump_stacks, start, stop, tail, terminate_raises, torchrun_command

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


_ERROR_LINES = 10
# argparse's "prog: error: ..." and the last line of a Python traceback ("ModuleNotFoundError: No module ...")
_ERROR_LINE = re.compile(r": error: |^[A-Za-z_][\w.]*(Error|Exception): |: No module named ")


def _errors_before_rank_logs(torchrun_log: Path) -> str:
    """The error lines of ``torchrun_log`` (at most ``_ERROR_LINES``, each once, torch.distributed.elastic's own
    left out): what a worker printed before it had a log of its own (a bad worker argument, an import error),
    which torchrun's tail, its summary, no longer shows."""
    try:
        text = torchrun_log.read_text(errors="replace")
    except OSError:
        return ""
    found: list[str] = []
    for line in text.splitlines():
        if _ERROR_LINE.search(line) and "elastic" not in line and "ChildFailedError" not in line and line not in found:
            found.append(line)
        if len(found) == _ERROR_LINES:
            break
    return "\n".join(found)


@dataclasses.dataclass
class LaunchResult:
    """What one torchrun launch left behind; see the module docstring."""

    command: list[str]
    out_dir: Path
    world_size: int
    returncode: int | None
    timeout: float
    seconds: float
    verdicts: dict[int, RankVerdict | None]
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
            for record in verdict.cases if verdict else []:
                seen.setdefault(record.id, None)
        return list(seen)

    def case(self, case_id: str) -> dict[int, CaseRecord | None]:
        """``{rank: record or None}`` for one case (``None``: that rank has no record for it)."""
        found: dict[int, CaseRecord | None] = {}
        for rank, verdict in sorted(self.verdicts.items()):
            found[rank] = next((r for r in (verdict.cases if verdict else []) if r.id == case_id), None)
        return found

    def case_status(self, case_id: str) -> str:
        """``pass``, ``skip`` or ``fail`` for the case across all ranks (missing records fail)."""
        records = self.case(case_id).values()
        if any(r is None for r in records):
            return "fail"
        statuses = {r.status for r in records if r is not None}
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
            elif verdict.fatal:
                problems.append(f"rank {rank} stopped on an exception:\n{_indent(verdict.fatal.rstrip())}")
            elif not verdict.complete:
                problems.append(f"rank {rank} did not finish its cases (last: {self._last_case(verdict)})")
        return problems

    @staticmethod
    def _last_case(verdict: RankVerdict) -> str:
        return verdict.cases[-1].id if verdict.cases else "none started"

    @property
    def complete(self) -> bool:
        return not self.launch_problems()

    @property
    def ok(self) -> bool:
        return self.complete and all(self.case_status(c) != "fail" for c in self.case_ids())

    # -- formatting ------------------------------------------------------------------------------
    def _header(self) -> str:
        backward = next((v.backward for v in self.verdicts.values() if v), "?")
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
        if not all(self.log_path(rank).exists() for rank in range(self.world_size)):
            said = _errors_before_rank_logs(self.out_dir / "torchrun.log")
            if said:
                lines.append("  error lines in torchrun's log (where a rank printed before it had a log of its own):")
                lines.append(_indent(said))
        for rank in range(self.world_size):
            lines.append(f"  rank {rank} log tail ({self.log_path(rank)}):")
            lines.append(_indent(self.log_tail(rank)))
        return "\n".join(lines)

    def _case_log(self, rank: int, case_id: str) -> str:
        """The lines rank ``rank`` logged while running ``case_id`` (bounded): the log's bytes between the
        case's ``case_start`` event and the next event after its last (Note [event stream]); the log's tail
        where the events do not say."""
        try:
            data = self.log_path(rank).read_bytes()
        except OSError:
            return "<no log>"
        reader = EventReader(self.out_dir, rank)
        events = reader.poll()
        start = next((i for i, e in enumerate(events) if e.event == "case_start" and e.case == case_id), None)
        begin = None if start is None else events[start].log_offset
        if start is None or begin is None:
            return "\n".join(data.decode(errors="replace").splitlines()[-_TAIL:])
        end = next((e.log_offset for e in events[start + 1 :] if e.event == "case_start"), None)
        section = data[begin:end].decode(errors="replace").splitlines()
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
            where = f"rank {rank} [stages {','.join(map(str, record.stages))}]"
            lines.append(f"{where}: {record.status}")
            if record.status in ("pass", "skip"):
                if record.reason:
                    lines.append(f"    {record.reason}")
                continue
            lines.extend(f"    {f.text}" for f in record.failures)
            for step in record.steps:
                for chain in (step.garbage.chains if step.garbage else [])[:1]:
                    lines.append(f"    step {step.step} first back-reference chain:")
                    lines.append(_indent(chain, "      "))
            if record.error:
                lines.append("    traceback:")
                lines.append(_indent(record.error.rstrip(), "      "))
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
            times = [f"{r.seconds if r else 0:.2f}" for r in self.case(case_id).values()]
            lines.append(f"{self.case_status(case_id):4}  {case_id}  ({'/'.join(times)} s per rank)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# launching


#: ``on_case(case_id, {rank: record})``: a case every rank has reported, with every rank's record.
OnCase = Callable[[str, dict[int, CaseRecord]], None]
QUIET_S = 10.0  # seconds without a finished case before ``on_wait`` says what is running


class _CaseReporter:
    """Progress of a launch from the ranks' event streams (Note [event stream], Note [progress says what
    runs]), for a command line and for the hang clock.

    Calls ``on_case`` once per case, in rank 0's order, as soon as every rank has written the
    ``case_end`` event of that case (so that the status is the case's over all ranks, as its table row will
    be), with every rank's record from those events, and ``on_wait`` with what is running whenever
    ``quiet_s`` seconds (of ``clock``) pass without one. :attr:`started` and :attr:`events` feed the hang
    clock (Note [hang clock]).
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
        self.nproc = nproc
        self.on_case, self.on_wait = on_case, on_wait
        self.quiet_s, self.clock = quiet_s, clock
        self.readers = [EventReader(out_dir, r) for r in range(nproc)]
        self.reported = 0
        self.quiet_since = clock()

    @property
    def started(self) -> int:
        """Ranks that have written their ``started`` event."""
        return sum(any(e.event == "started" for e in r.events) for r in self.readers)

    @property
    def events(self) -> int:
        """Events read so far, over every rank: the hang clock's progress (Note [hang clock])."""
        return sum(len(r.events) for r in self.readers)

    def poll(self) -> None:
        """Read the ranks' new events; report what finished, or, after ``quiet_s``, what runs."""
        for reader in self.readers:
            reader.poll()
        if self.on_case is not None:
            self._report_cases(self.on_case)
        if self.on_wait is not None and self.clock() - self.quiet_since >= self.quiet_s:
            self.on_wait(self.running())
            self.quiet_since = self.clock()

    def _ended(self, rank: int) -> dict[str, CaseRecord]:
        return {e.case: e.record for e in self.readers[rank].events if e.event == "case_end" and e.case and e.record}

    def _report_cases(self, on_case: OnCase) -> None:
        by_rank = [self._ended(r) for r in range(self.nproc)]
        order = list(by_rank[0])
        for case_id in order[self.reported :]:
            if not all(case_id in cases for cases in by_rank):
                break  # a rank is still on it: report in order, once every rank has
            on_case(case_id, {r: cases[case_id] for r, cases in enumerate(by_rank)})
            self.reported += 1
            self.quiet_since = self.clock()

    def running(self) -> str:
        """``still running ScheduleGPipe/mlp (rank 0; 1 case(s) done)`` or ``starting: ...``."""
        if self.started < self.nproc:
            return f"starting: {self.started}/{self.nproc} ranks have joined the process group"
        current = next((e.case for e in reversed(self.readers[0].events) if e.event == "case_start"), None)
        if current is None:
            return f"all {self.nproc} ranks started; building the first case"
        return f"still running {current} (rank 0; {self.reported} case(s) done)"


# Note [progress says what runs]: a launch prints nothing between two finished cases, and starting torchrun
# on a busy machine or one slow case (a compiled model, a long schedule) can take tens of seconds. The
# reporter therefore says, every QUIET_S seconds without a finished case, what the launch is doing: ranks
# still joining (``started`` events), or the case rank 0 started last (its last ``case_start`` event).


def _wait(
    proc: subprocess.Popen[bytes],
    nproc: int,
    timeout: float,
    startup_timeout: float,
    reporter: _CaseReporter,
) -> str | None:
    """Wait for ``proc`` to exit, reporting cases as they finish; on a hang return its kind,
    ``"startup"`` or ``"progress"`` (Note [hang clock]); ``None`` once ``proc`` exited."""
    t0 = time.monotonic()
    last = -1
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
        if reporter.started < nproc:  # not every rank has started
            if now - t0 >= startup_timeout:
                return "startup"
            continue
        if reporter.events != last:
            last, changed_at = reporter.events, now
        elif now - changed_at >= timeout:
            return "progress"


def _prepare(
    nproc: int, worker_args: Sequence[str], out_dir: str | os.PathLike[str], env: dict[str, str] | None,
    module: str, python: str | None,
) -> tuple[Path, list[str], dict[str, str]]:
    """The output folder (created, emptied of an earlier launch's files), the torchrun command and its
    environment."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("rank*.*"), out / "torchrun.log"]:
        old.unlink(missing_ok=True)
    command = torchrun_command(
        nproc, module, ["--out", str(out), "--launched-at", f"{time.time():.3f}", *worker_args], python=python
    )
    full_env = {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (_src_root(), os.environ.get("PYTHONPATH", "")) if p),
        **(env or {}),
    }
    return out, command, full_env


def _supervise(
    proc: subprocess.Popen[bytes], out: Path, module: str, wait: Callable[[], str | None]
) -> str | None:
    """``wait()`` for the launch; on a hang (its kind returned) or an interruption, every worker's stack
    dumped and every process of the launch killed (Note [killing a hung launch] in ``_tools.torchrun``); a
    ``SIGTERM`` or ``SIGHUP`` is an interruption where the caller holds :func:`terminate_raises` (Note [a
    terminated launcher stops its launch] there)."""
    try:
        hang = wait()
        if hang is not None:
            dump_stacks(out, module)
            stop(proc, out, module)
        return hang
    except BaseException:  # KeyboardInterrupt, SIGTERM, pytest-timeout: never leave processes behind
        dump_stacks(out, module, grace=2.0)
        stop(proc, out, module)
        raise


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
        out_dir: folder for logs, verdicts and events; created, and emptied of an earlier launch's files.
        timeout: seconds without a new event once every rank has started, before every rank's stack is
            dumped and every process of the launch killed (Note [killing a hung launch]). It does not count
            the time the machine takes to start the ranks.
        env: extra environment variables for torchrun and the workers.
        on_case: called in this process as ``on_case(case_id, {rank: record})`` for each case, in rank
            0's order, as soon as every rank has finished it (its ``case_end`` events, polled twice a
            second): progress for a command line.
        startup_timeout: seconds for every rank to start (write its ``started`` event) before the launch
            is killed; default ``max(300, timeout)``: a backstop, never reached on a healthy machine.
        on_wait: called with one line saying what is running whenever ``QUIET_S`` seconds pass without
            a finished case (Note [progress says what runs]).
        module: the worker module torchrun starts (default the harness worker); another keeps its
            protocol (module docstring).
        python: the interpreter that runs torchrun and the workers (default: this one); ppbackward comes
            from this checkout through ``PYTHONPATH`` either way.

    Returns:
        A :class:`LaunchResult`; it raises nothing for a failed, crashed or hung launch.

    Raises:
        SchemaError: a rank wrote a verdict or an event of another schema version (Note [record schema]).
    """
    out, command, full_env = _prepare(nproc, worker_args, out_dir, env, module, python)
    startup = max(300.0, timeout) if startup_timeout is None else startup_timeout
    t0 = time.monotonic()
    progress: list[str] = []

    def seen(case_id: str, per_rank: dict[int, CaseRecord]) -> None:
        progress.append(case_id)
        on_case(case_id, per_rank)  # type: ignore[misc]

    reporter = _CaseReporter(out, nproc, None if on_case is None else seen, on_wait)
    with terminate_raises():  # Note [a terminated launcher stops its launch]
        proc = start(command, out / "torchrun.log", full_env)
        hang = _supervise(proc, out, module, lambda: _wait(proc, nproc, timeout, startup, reporter))
    return LaunchResult(
        command=command, out_dir=out, world_size=nproc, returncode=proc.returncode, timeout=timeout,
        seconds=time.monotonic() - t0, verdicts={r: read_verdict(out / f"rank{r}.json") for r in range(nproc)},
        progress=progress, hang=hang, startup_timeout=startup,
    )
