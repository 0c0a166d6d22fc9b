"""torch.profiler without its chatter on the user's terminal.

Private module. Note [quiet profiler]: the bench runs ``torch.profiler`` in its own process only
(``alloc``: the allocator's counts; ``profile``: the node calls and matmuls; the schedule step's ranks
time their slices with a clock and run no profiler), and the profiler talks on the process's stderr from
C++, below Python's ``sys.stderr``: kineto logs every start and stop (``USDT: ... profiler_start``,
``STAGE: ...``) unless ``KINETO_LOG_LEVEL`` says otherwise, and c10's allocator warns once per process
``Memory block of unknown size was allocated before the profiling started, profiler results will not
include the deallocation event`` (``[W... CPUAllocator.cpp:...]``), which ``TORCH_CPP_LOG_LEVEL`` silences
only when set before torch is imported, too late for a command that already imported it. So
:func:`quiet_profiler` points file descriptor 2 at a temporary file while the profiled block runs, then
writes back every line that does not mention the profiler (anything else the block printed still reaches
the terminal, after the block), and ignores the Python warnings that ``torch.profiler`` and
``torch.autograd.profiler`` raise meanwhile. Where descriptor 2 cannot be duplicated (closed), the block
runs unfiltered.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

__all__ = ["NOISE", "quiet_profiler"]  # private module: what other modules use

#: A line of stderr that is the profiler's, not the user's (kineto's and c10's log lines about profiling).
NOISE = re.compile(r"profil", re.IGNORECASE)


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Run the block with the profiler's stderr lines and Python warnings dropped (Note [quiet profiler])."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # kineto reads it when it starts: quiet from the first block
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch\.(autograd\.)?profiler")
        warnings.filterwarnings("ignore", message=r".*profil")  # compiled case-insensitive by warnings
        with _stderr_filtered():
            yield


@contextlib.contextmanager
def _stderr_filtered() -> Iterator[None]:
    """Descriptor 2 into a temporary file for the block; its lines but :data:`NOISE`'s written back after."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no descriptor 2, or a closed/absent sys.stderr
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()  # Python's own buffered writes of the block, while they still go to tmp
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            kept = "".join(line for line in text.splitlines(keepends=True) if not NOISE.search(line))
            if kept:
                os.write(2, kept.encode())
