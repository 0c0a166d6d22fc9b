"""Private: the one place that starts torchrun processes, and the one way a launch is stopped.

Used by every torchrun launch of the package: the harness (``ppbackward._tools.harness.launch``: ``ppbackward
check``, ``tests/multiproc`` and the schedule benchmark, ``ppbackward._tools.harness.schedule_bench``).
:func:`torchrun_command` is ``python -m torch.distributed.run --standalone --nproc-per-node N
--max-restarts=0 -m MODULE ...`` with the *current* interpreter (its own rendezvous on a free port, never
a fixed one); :func:`start` runs it in a session of its own with ``OMP_NUM_THREADS=1``, its output going
to a file, never a pipe (a surviving worker would hold a pipe open and a read would wait for it). Every
worker writes ``<out>/rank<r>.pid`` so that it can be found and killed; :func:`tail` reads a log's end.

Note [killing a hung launch]: on a hang the launcher first sends ``SIGUSR1`` to every worker, whose
``faulthandler`` writes the Python stack of every thread into the worker's log from the signal handler
(it works while the rank is blocked inside a gloo call), and waits until each log holds that dump (or the
worker is gone; ``_DUMP_GRACE`` seconds at most). torchrun starts every worker in a session of its own,
so killing torchrun's process group does not reach them. The launcher therefore (1) ``SIGKILL``\\ s each
worker's process group, found from ``rank<r>.pid`` and checked to run the launch's worker module, (2) ``SIGTERM``\\ s
torchrun's group and (3) ``SIGKILL``\\ s it after a grace period (:func:`stop`, for the harness's
launches and the schedule benchmark's alike). A worker that had not yet written its pid file is stopped
by torchrun itself, which passes the ``SIGTERM`` on to its workers.

Note [a terminated launcher stops its launch]: ``SIGTERM``'s default action (and ``SIGHUP``'s) ends this
process at once, with no exception and no clean-up, so torchrun and its workers, each in a session of its own,
ran on to their end, reparented to init (``timeout``, a CI job cancelled). While a launch is supervised
(:func:`terminate_raises`, from before torchrun starts until it is stopped or has ended), those two signals
raise ``SystemExit(128 + signal)`` instead, where their handler is the default one and only in the main thread
(Python runs handlers there): the supervisor's clean-up then stops every process of the launch as on ``Ctrl-C``
and the process exits with the code the signal gives. The first such signal sets both to be ignored, so that a
second one (a CI runner's ``SIGTERM`` after its ``SIGINT``) cannot cut that clean-up short; the handlers found
are put back when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["alive", "dump_stacks", "start", "stop", "tail", "terminate_raises", "torchrun_command", "write_pid_file"]

_GRACE_S = 5.0  # between SIGTERM and SIGKILL of torchrun
_DUMP_GRACE_S = 30.0  # most a worker gets to write its stack dump (Note [killing a hung launch])
_DUMP_MARK = "(most recent call first)"  # faulthandler's header line of every thread's stack


def torchrun_command(nproc: int, module: str, args: list[str], python: str | None = None) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N --max-restarts=0 -m module *args``,
    with ``python`` the interpreter (default: this one)."""
    return [
        python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "--max-restarts=0", "-m", module, *args,
    ]


def start(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``command`` in a session of its own, stdout and stderr to ``log_path``, stdin closed, with
    ``OMP_NUM_THREADS=1`` and ``env`` over this process's environment."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
            start_new_session=True,
        )


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of the log at ``path`` (``<no log at PATH>`` when it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"<no log at {path}>"
    return "\n".join(text.splitlines()[-lines:])


def _is_worker(pid: int, module: str) -> bool:
    """Whether process ``pid`` runs ``module`` (in its command line): a pid file's pid not yet reused."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return sys.platform != "linux"  # no /proc: trust the pid file written moments ago
    return module.encode() in cmdline


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie waiting for its parent."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return sys.platform != "linux"


def write_pid_file(out_dir: Path, rank: int) -> None:
    """Write this process's pid to ``out_dir/rank<rank>.pid`` whole: written beside it and renamed, so that a reader
    that sees the file (the stop here, a test waiting for the ranks to start) never reads it empty or half-written."""
    part = out_dir / f"rank{rank}.pid.part"
    part.write_text(str(os.getpid()))
    os.replace(part, out_dir / f"rank{rank}.pid")


def _worker_pids(out_dir: Path, module: str) -> dict[int, int]:
    """``{rank: pid}`` of every worker of ``module`` that wrote ``out_dir/rank<r>.pid`` and is still that worker."""
    found = {}
    for pid_file in sorted(out_dir.glob("rank*.pid")):
        try:
            rank, pid = int(pid_file.stem[len("rank") :]), int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if _is_worker(pid, module):
            found[rank] = pid
    return found


def dump_stacks(out_dir: Path, module: str, grace: float = _DUMP_GRACE_S) -> None:
    """``SIGUSR1`` every worker and wait until each log holds its stack dump (Note [killing a hung launch])."""
    pending: dict[int, tuple[int, int]] = {}  # rank -> (pid, log size when the dump was first seen; -1: not yet)
    for rank, pid in _worker_pids(out_dir, module).items():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        pending[rank] = (pid, -1)
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank, (pid, seen_at) in list(pending.items()):
            log = out_dir / f"rank{rank}.log"
            try:
                size = log.stat().st_size
                text = log.read_text(errors="replace") if seen_at < 0 else ""
            except OSError:
                size, text = -1, ""
            if not alive(pid) or (seen_at >= 0 and size == seen_at):
                del pending[rank]  # gone, or its dump is complete (the log stopped growing)
            elif seen_at >= 0 or _DUMP_MARK in text:
                pending[rank] = (pid, size)


def _kill_workers(out_dir: Path, module: str) -> None:
    """SIGKILL the session of every worker of ``module`` that wrote a pid file (Note [killing a hung launch])."""
    for pid in _worker_pids(out_dir, module).values():
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _exit_on(signum: int, _frame: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # once: a second signal must not cut the clean-up short
        if signal.getsignal(sig) is _exit_on:
            signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """``SIGTERM`` and ``SIGHUP`` raise ``SystemExit(128 + signal)`` in the block where their handler is the
    default one, in the main thread only (Note [a terminated launcher stops its launch])."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    found = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            found[sig] = signal.signal(sig, _exit_on)
    try:
        yield
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)


def stop(proc: subprocess.Popen[Any], out_dir: Path, module: str) -> None:
    """Kill torchrun ``proc`` (started in a session of its own) and every worker of ``module`` that wrote
    ``out_dir/rank<r>.pid``; returns once ``proc`` exited, or after ``2 * _GRACE_S`` seconds at most
    (Note [killing a hung launch])."""
    _kill_workers(out_dir, module)
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
    _kill_workers(out_dir, module)  # a worker started while torchrun was being stopped
