"""torch.profiler's chatter stays off the terminal, and nothing else the block prints is lost (Note [quiet
profiler] in ``ppbackward._tools.bench.quiet``). A newcomer's ``ppbackward bench`` printed the allocator's
``Memory block of unknown size was allocated before the profiling started`` among its progress lines."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import ppbackward
from ppbackward._tools.bench.quiet import quiet_profiler

SRC = str(Path(ppbackward.__file__).resolve().parents[1])


def test_the_profilers_lines_are_dropped_and_every_other_line_is_kept(capfd):
    with quiet_profiler():
        os.write(2, b"[W1202 10:08:05.99 CPUAllocator.cpp:245] Memory block of unknown size was allocated "
                    b"before the profiling started, profiler results will not include the deallocation event\n")
        os.write(2, b"USDT:2026-12-02 10:08:50 4262:4262 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a line of the user's\n")
        print("and one through sys.stderr", file=sys.stderr)
        warnings.warn("the profiler says something", UserWarning, stacklevel=1)  # dropped too
    os.write(2, b"after the block\n")
    err = capfd.readouterr().err  # (capfd takes sys.stderr's writes apart from descriptor 2's: order aside)
    assert sorted(err.splitlines()) == ["a line of the user's", "after the block", "and one through sys.stderr"]
    assert err.index("a line of the user's") < err.index("after the block")


def test_the_bench_profilers_print_nothing_in_a_fresh_process():
    """In a fresh interpreter (the allocator warns once per process) without ``KINETO_LOG_LEVEL``: the
    allocator's counts and the profile's event counts run torch.profiler, and stderr stays empty."""
    code = textwrap.dedent(
        """
        from ppbackward._tools.bench import alloc, profile
        from ppbackward._tools.harness.models import Config, build
        alloc.measure(build(Config(2, 16, 4)))
        profile._events(lambda: None)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
