"""Launch the schedule benchmark (:mod:`ppbackward._tools.bench.schedule_worker`) under torchrun.

Private module. The launch goes through ``ppbackward._tools.torchrun`` (the one module that starts torchrun
processes): 2 ranks, output to ``torchrun.log`` in a temporary folder, every worker writing
``rank<r>.pid`` there, and on a timeout the one stop path (Note [killing a hung launch] there): every
worker's session from its pid file, then torchrun's. A failure or a timeout raises with the command and
the last lines of the output.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ppbackward._tools.torchrun import start, stop, tail, torchrun_command

__all__: list[str] = []  # private module

WORKER = "ppbackward._tools.bench.schedule_worker"


class ScheduleBenchError(RuntimeError):
    """The torchrun launch failed or timed out; ``pgid`` is torchrun's (killed) process group,
    ``command`` the command line launched."""

    def __init__(self, message: str, pgid: int, command: list[str]) -> None:
        super().__init__(message)
        self.pgid = pgid
        self.command = command


def _command(tmp: Path, repeats: int, nproc: int) -> list[str]:
    """The torchrun command line; its workers write ``schedule.json`` and ``rank<r>.pid`` into ``tmp``."""
    return torchrun_command(nproc, WORKER, ["--out", str(tmp / "schedule.json"), "--repeats", str(repeats)])


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
        proc = start(cmd, log_path)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc, tmp, WORKER)
            raise ScheduleBenchError(
                f"schedule benchmark timed out after {timeout_s:.0f}s (torchrun and every worker killed)\n"
                f"command: {' '.join(cmd)}\n--- last output ---\n{tail(log_path, 30)}",
                proc.pid,
                cmd,
            ) from None
        except BaseException:  # KeyboardInterrupt, pytest-timeout: never leave processes behind
            stop(proc, tmp, WORKER)
            raise
        if proc.returncode != 0 or not out.exists():
            raise ScheduleBenchError(
                f"schedule benchmark failed with exit code {proc.returncode}\n"
                f"command: {' '.join(cmd)}\n--- last output ---\n{tail(log_path, 30)}",
                proc.pid,
                cmd,
            )
        with open(out) as f:
            return json.load(f)
