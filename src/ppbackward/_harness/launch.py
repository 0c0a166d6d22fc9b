"""Private: start the harness worker under torchrun, bounded in time, and read back per-rank verdicts.

:func:`launch` runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m
ppbackward._harness.worker ...`` with the *current* interpreter, in its own session
(``start_new_session=True``), with ``OMP_NUM_THREADS=1``. torchrun's own output goes to
``<out>/torchrun.log``; every worker writes ``<out>/rank<r>.log``, ``<out>/rank<r>.json`` (its verdict,
rewritten after every case) and ``<out>/rank<r>.pid``.

Note [killing a hung launch]: torchrun starts every worker in a session of its own, so killing
torchrun's process group does not reach them. On timeout the launcher therefore (1) ``SIGKILL``\\ s each
worker's process group, found from ``rank<r>.pid`` and checked to be a harness worker, (2) ``SIGTERM``\\ s
torchrun's group and (3) ``SIGKILL``\\ s it after a grace period. Workers arm
``faulthandler.dump_traceback_later`` a few seconds before the launcher's timeout, so each hung
rank's log ends with the Python stack it was stuck in.

:class:`LaunchResult` then answers "did every rank report, and did every case pass", and formats what
went wrong as one block per failing case (each failing rank's failures, traceback and log excerpt),
or one block for the whole launch (timeout, crash, missing verdicts) with every rank's log tail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["LaunchResult", "launch"]

WORKER_MODULE = "ppbackward._harness.worker"
_TAIL = 40  # log lines shown per rank
_CASE_LOG = 20  # log lines shown per rank for one case
_GRACE_S = 5.0  # between SIGTERM and SIGKILL of torchrun


def _src_root() -> str:
    import ppbackward

    return str(Path(ppbackward.__file__).resolve().parents[1])


def _tail(path: Path, lines: int = _TAIL) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"<no log at {path}>"
    return "\n".join(text.splitlines()[-lines:])


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


@dataclasses.dataclass
class LaunchResult:
    """What one torchrun launch left behind; see the module docstring."""

    command: list[str]
    out_dir: Path
    world_size: int
    returncode: int | None
    timed_out: bool
    timeout: float
    seconds: float
    verdicts: dict[int, dict[str, Any] | None]
    progress: list[str] = dataclasses.field(default_factory=list)  # case ids passed to ``on_case``, in order

    # -- reading --------------------------------------------------------------------------------
    def log_path(self, rank: int) -> Path:
        return self.out_dir / f"rank{rank}.log"

    def log_tail(self, rank: int, lines: int = _TAIL) -> str:
        return _tail(self.log_path(rank), lines)

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
        if self.timed_out:
            problems.append(
                f"timed out after {self.timeout:.0f}s: the process groups of torchrun and of every worker "
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
        lines.append(_indent(_tail(self.out_dir / "torchrun.log", 15)))
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


def _is_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return sys.platform != "linux"  # no /proc: trust the pid file written moments ago
    return WORKER_MODULE.encode() in cmdline


def _kill_workers(out_dir: Path) -> None:
    """SIGKILL the session of every harness worker that wrote a pid file (Note [killing a hung launch])."""
    for pid_file in sorted(out_dir.glob("rank*.pid")):
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if not _is_worker(pid):
            continue
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stop(proc: subprocess.Popen[bytes], out_dir: Path) -> None:
    _kill_workers(out_dir)
    for sig, wait in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, _GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _kill_workers(out_dir)  # a worker started while torchrun was being stopped


def _read_verdict(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait(
    proc: subprocess.Popen[bytes],
    deadline: float,
    progress: Path,
    on_case: Callable[[dict[str, Any]], None] | None,
) -> bool:
    """Wait for ``proc`` until ``deadline`` (monotonic); report new cases; ``False`` on timeout."""
    reported = 0

    def report() -> None:
        nonlocal reported
        cases = (_read_verdict(progress) or {}).get("cases", [])
        for record in cases[reported:]:
            on_case(record)  # type: ignore[misc]
        reported = max(reported, len(cases))

    while True:
        try:
            proc.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if on_case is not None:
                report()
            if time.monotonic() >= deadline:
                return False
            continue
        if on_case is not None:
            report()
        return True


def launch(
    nproc: int,
    worker_args: Sequence[str],
    out_dir: str | os.PathLike[str],
    timeout: float,
    env: dict[str, str] | None = None,
    on_case: Callable[[dict[str, Any]], None] | None = None,
) -> LaunchResult:
    """Run the harness worker on ``nproc`` ranks; never takes (much) longer than ``timeout`` seconds.

    Args:
        nproc: processes (ranks) to start, all on this machine.
        worker_args: arguments of ``python -m ppbackward._harness.worker`` besides ``--out`` (e.g.
            ``["--backward", "ppbackward", "--schedules", "Schedule1F1B"]``).
        out_dir: folder for logs and verdicts; created, and emptied of earlier verdicts and logs.
        timeout: seconds before every process of the launch is killed (Note [killing a hung launch]).
        env: extra environment variables for torchrun and the workers.
        on_case: called in this process with rank 0's record of each case as soon as rank 0 finished
            it (polled from ``rank0.json`` twice a second): progress for a command line.

    Returns:
        A :class:`LaunchResult`; it raises nothing for a failed, crashed or hung launch.
    """
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("rank*.*"), out / "torchrun.log"]:
        old.unlink(missing_ok=True)
    dump_after = max(1.0, timeout - 6.0)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        WORKER_MODULE,
        "--out",
        str(out),
        "--dump-after",
        f"{dump_after:.0f}",
        *worker_args,
    ]
    full_env = dict(os.environ)
    full_env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (_src_root(), full_env.get("PYTHONPATH", "")) if p),
    )
    full_env.update(env or {})
    t0 = time.monotonic()
    timed_out = False
    progress: list[str] = []

    def seen(record: dict[str, Any]) -> None:
        progress.append(record["id"])
        on_case(record)  # type: ignore[misc]
    with open(out / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
            start_new_session=True,
        )
        try:
            timed_out = not _wait(proc, t0 + timeout, out / "rank0.json", None if on_case is None else seen)
            if timed_out:
                _stop(proc, out)
        except BaseException:  # KeyboardInterrupt, pytest-timeout: never leave processes behind
            _stop(proc, out)
            raise
    return LaunchResult(
        command=command,
        out_dir=out,
        world_size=nproc,
        returncode=proc.returncode,
        timed_out=timed_out,
        timeout=timeout,
        seconds=time.monotonic() - t0,
        verdicts={r: _read_verdict(out / f"rank{r}.json") for r in range(nproc)},
        progress=progress,
    )
