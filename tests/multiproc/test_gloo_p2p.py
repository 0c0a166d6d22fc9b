"""The harness's workaround for torch 2.5-2.7 schedules dropping gloo P2P works (Note [dropped P2P works]).

Real gloo, two ranks: a batch of three sends arrives in full when every ``Work`` is kept
(``gloo_p2p``), and hangs until the process-group timeout when only the last one is (torch 2.5-2.7's
``_batch_p2p``, the negative control). The schedules themselves run with it in ``tests/multiproc`` on
torch 2.5.1 (``nox -s torch-2.5.1``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppbackward._compat import torch_release
from ppbackward._tools.harness import gloo_p2p

PROBE = Path(__file__).resolve().parent / "gloo_p2p_probe.py"
# Seconds gloo waits for the batch, once both ranks are up (the rendezvous itself gets 300 s). The
# dropped receive of the negative control never completes, whatever the machine's speed, so a short wait
# decides nothing there; the positive run gets a long one, so that a slow peer on a busy machine is never
# mistaken for a lost message.
PG_TIMEOUT = {"keep": 300, "pop": 5}


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=0", str(PROBE), mode, str(PG_TIMEOUT[mode])]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=900)  # a backstop only: gloo's own timeout ends both runs
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {mode} did not finish in 900 s:\n{out}")
    return subprocess.CompletedProcess(command, proc.returncode, out)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_keeping_every_work_delivers_the_whole_batch() -> None:
    result = _run("keep")
    assert result.returncode == 0, result.stdout
    assert "rank 1 received [0.0, 1.0, 2.0]" in result.stdout, result.stdout
    assert "rank 0 done" in result.stdout and "rank 1 done" in result.stdout, result.stdout


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_negative_control_keeping_only_the_last_work_hangs_on_gloo() -> None:
    result = _run("pop")
    assert result.returncode != 0, result.stdout
    # Either side's wait may expire first: rank 1's receive or rank 0's send (then rank 1 sees the
    # connection closed); both are the hang of the dropped works, and neither rank got its batch.
    assert re.search(r"Timed out waiting \d+ms for (recv|send) operation", result.stdout), result.stdout
    assert "rank 1 received" not in result.stdout, result.stdout


def _pops_the_last_work(p2p_ops, desc=None):  # the shape of torch 2.5-2.7's _batch_p2p
    return torch.distributed.batch_isend_irecv(p2p_ops).pop()


def test_workaround_is_needed_only_where_batch_p2p_drops_works() -> None:
    assert gloo_p2p.needed(_pops_the_last_work)
    assert not gloo_p2p.needed(gloo_p2p._batch_p2p_keeping_all)
    assert not gloo_p2p.needed(len)  # no Python source
    assert gloo_p2p._batch_p2p_keeping_all([]) is None  # "if work := _batch_p2p(...)" then skips the wait
    release = torch_release()[:2]
    assert gloo_p2p.needed() is (release < (2, 8)), "pytorch/pytorch#152938 first shipped in 2.8"
