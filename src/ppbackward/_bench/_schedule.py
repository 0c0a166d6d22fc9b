"""Launch the schedule benchmark (:mod:`ppbackward._bench._schedule_worker`) under torchrun.

Private module. ``sys.executable -m torch.distributed.run --standalone --nproc-per-node 2`` (its
own rendezvous on a free port, never a fixed one), in a session of its own, with its output going to
``torchrun.log`` in a temporary folder; every worker writes ``rank<r>.pid`` there. torchrun starts
each worker in a session of its own too, so on a timeout the launch is stopped as the harness stops
a hung one (Note [killing a hung launch] in ``ppbackward._harness.launch``): every worker's session
from its pid file, then torchrun's. The output is a file, never a pipe, because a surviving worker
would hold a pipe open and the read would wait for it. A failure or a timeout raises with the command
and the last lines of the output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ppbackward._harness.launch import _stop

__all__: list[str] = []  # private module

WORKER = "ppbackward._bench._schedule_worker"


class ScheduleBenchError(RuntimeError):
    """The torchrun launch failed or timed out; ``pgid`` is torchrun's (killed) process group,
    ``command`` the command line launched."""

    def __init__(self, message: str, pgid: int, command: list[str]) -> None:
        super().__init__(message)
        self.pgid = pgid
        self.command = command


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"<no output at {path}>"
    return "\n".join(text.splitlines()[-lines:])


def _command(tmp: Path, repeats: int, nproc: int) -> list[str]:
    """The torchrun command line; its workers write ``schedule.json`` and ``rank<r>.pid`` into ``tmp``."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", WORKER, "--out", str(tmp / "schedule.json"), "--repeats", str(repeats),
    ]


def run_schedule(repeats: int = 8, timeout_s: float = 300.0, nproc: int = 2, d_model: int = 128) -> dict[str, Any]:
    """Run the worker under torchrun and return rank 0's JSON result.

    Args:
        repeats: timed steps per schedule variant.
        timeout_s: seconds (wall clock, from the launch) before torchrun and every worker are killed.
        nproc: ranks to start, all on this machine.
        d_model: width of every stage's encoder layers.

    Raises:
        ScheduleBenchError: non-zero exit, no result, or ``timeout_s`` exceeded (every worker's session
            and torchrun's are killed first, so no process of the launch is left when it is raised).
    """
    with tempfile.TemporaryDirectory(prefix="ppbackward-bench-") as name:
        tmp = Path(name)
        out, log_path = tmp / "schedule.json", tmp / "torchrun.log"
        cmd = _command(tmp, repeats, nproc) + ([] if d_model == 128 else ["--d-model", str(d_model)])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _stop(proc, tmp, WORKER)
                raise ScheduleBenchError(
                    f"schedule benchmark timed out after {timeout_s:.0f}s (torchrun and every worker killed)\n"
                    f"command: {' '.join(cmd)}\n--- last output ---\n{_tail(log_path)}",
                    proc.pid,
                    cmd,
                ) from None
            except BaseException:  # KeyboardInterrupt, pytest-timeout: never leave processes behind
                _stop(proc, tmp, WORKER)
                raise
        if proc.returncode != 0 or not out.exists():
            raise ScheduleBenchError(
                f"schedule benchmark failed with exit code {proc.returncode}\n"
                f"command: {' '.join(cmd)}\n--- last output ---\n{_tail(log_path)}",
                proc.pid,
                cmd,
            )
        with open(out) as f:
            return json.load(f)
