"""Launch the schedule benchmark (:mod:`ppbackward._bench._schedule_worker`) under torchrun.

Private module. ``sys.executable -m torch.distributed.run --standalone --nproc-per-node 2`` (its
own rendezvous on a free port, never a fixed one), in a new session so that a timeout kills the
whole process group: torchrun and both ranks. A failure or a timeout raises with the command and
the last lines of the output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

__all__: list[str] = []  # private module

WORKER = "ppbackward._bench._schedule_worker"


class ScheduleBenchError(RuntimeError):
    """The torchrun launch failed or timed out; ``pgid`` is the (killed) process group."""

    def __init__(self, message: str, pgid: int) -> None:
        super().__init__(message)
        self.pgid = pgid


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_schedule(repeats: int = 8, timeout_s: float = 300.0, nproc: int = 2) -> dict[str, Any]:
    """Run the worker under torchrun and return rank 0's JSON result.

    Raises:
        ScheduleBenchError: non-zero exit, no result, or ``timeout_s`` exceeded (the process group
            is killed first).
    """
    with tempfile.TemporaryDirectory(prefix="ppbackward-bench-") as tmp:
        out = os.path.join(tmp, "schedule.json")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", WORKER, "--out", out, "--repeats", str(repeats),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise ScheduleBenchError(
                f"schedule benchmark timed out after {timeout_s:.0f}s (process group killed)\n"
                f"command: {' '.join(cmd)}\n--- last output ---\n{_tail(log or '')}",
                proc.pid,
            ) from None
        if proc.returncode != 0 or not os.path.exists(out):
            raise ScheduleBenchError(
                f"schedule benchmark failed with exit code {proc.returncode}\n"
                f"command: {' '.join(cmd)}\n--- last output ---\n{_tail(log or '')}",
                proc.pid,
            )
        with open(out) as f:
            return json.load(f)
