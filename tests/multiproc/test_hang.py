"""A hung rank fails in bounded time, readably (layer 5 of ``conftest.py``).

Nothing here depends on how fast the machine is (Note [hang clock] in ``ppbackward._tools.harness.launch``):
the hang clock starts once both ranks have started, and the launcher waits for each rank's stack dump
before it kills the launch.
"""

from __future__ import annotations

import time

import pytest

from ppbackward._tools.harness.launch import alive, launch

HANG_TIMEOUT = 3.0  # seconds without progress once every rank has started


@pytest.mark.slow
@pytest.mark.timeout(600)  # a backstop only: the launcher itself bounds the launch
def test_rank_hung_in_a_collective_is_killed_and_every_rank_s_stack_is_shown(tmp_path) -> None:
    result = launch(2, ["--backward", "upstream", "--hang-rank", "1"], tmp_path, timeout=HANG_TIMEOUT)
    assert result.timed_out and result.hang == "progress", result.format_launch()
    text = result.format_failures()
    assert f"no rank made progress for {HANG_TIMEOUT:.0f}s after every rank had started" in text
    assert "--hang-rank 1: blocking in dist.recv from rank 0" in text  # rank 1's own log line
    # every rank's log ends with the stack it was stuck in (faulthandler, on the launcher's SIGUSR1)
    for rank, where in ((0, " in barrier"), (1, " in recv")):
        log = result.log_tail(rank)
        assert "(most recent call first)" in log and where in log, f"rank {rank}:\n{log}"
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2
    # the launcher SIGKILLed them; only their reaping by the dying torchrun can still be pending
    while any(alive(p) for p in pids):
        time.sleep(0.2)
