"""A hung rank fails in bounded time, readably (layer 5 of ``conftest.py``)."""

from __future__ import annotations

import os
import time

import pytest

from ppbackward._harness.launch import launch

TIMEOUT = 20.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@pytest.mark.timeout(TIMEOUT + 40)
def test_rank_hung_in_a_collective_is_killed_at_the_timeout_and_its_log_is_shown(tmp_path) -> None:
    t0 = time.monotonic()
    result = launch(2, ["--backward", "upstream", "--hang-rank", "1"], tmp_path, timeout=TIMEOUT)
    elapsed = time.monotonic() - t0
    assert result.timed_out
    assert elapsed < TIMEOUT + 15, f"the launcher took {elapsed:.1f}s to give up"
    text = result.format_failures()
    assert f"timed out after {TIMEOUT:.0f}s" in text
    assert "--hang-rank 1: blocking in dist.recv from rank 0" in text  # rank 1's own log line
    # every rank's log ends with the stack it was stuck in (faulthandler, armed by the launcher)
    assert "line" in text and " in recv" in text and " in barrier" in text, text
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a worker survived the launcher's timeout"
