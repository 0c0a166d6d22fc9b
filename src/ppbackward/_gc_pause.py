"""The automatic cycle collector paused while B and W run (Note [no collection inside B and W]).

Private module.

Note [no collection inside B and W]
B's graph analysis holds a stage graph's worth of short-lived Python objects at once (a wrapper per
autograd node, its ``next_functions`` tuples, the analysis' lists and dicts; thousands at 16 layers),
and W a smaller set. All of them die by reference counting before the call returns (Note [no closure
cycle] in ``ppbackward.backward``), but while they live they push the collector's allocation count
over its threshold: young collections start inside B and W, each promoting the live temporaries to an
older generation, and so, now and then, a full collection (in a process that imported torch, a long
one, during which this rank, and so the pipeline, stands still; counts and times: docs/performance.md,
"The automatic gc inside B and W"). So B and W run
with the automatic collector paused and put it back as they found it: none of their own work needs a
collection. What B keeps for W (the param groups) still counts, and may start one collection after B.

Process-wide, as the collector's switch is: B and W may run on several threads at once (a schedule's
custom ``OVERLAP_F_B`` function, autograd's device threads running W's hooks), so a counter under a
lock: the first B or W to enter disables an enabled collector, the last to leave enables it again.
Meanwhile other threads' allocations only count (their collection runs at their first allocation
after), ``gc.isenabled()`` reads ``False`` on every thread, and a ``gc.disable()`` made on any thread
is undone when the last B or W leaves. ppbackward's own leak tools read the switch through
:func:`collector_enabled`, so that a checker entered on another thread during a B does not restore
"disabled" for good. ``PPBACKWARD_PAUSE_GC=0`` in the environment (read at import) switches the pause
off (docs/api.md, Differences). The leak tools' heap scans pause the collector through the same counter,
whatever that setting (``always=True``: Note [heap scans beside other threads] in
``ppbackward.leaks._heap``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

# private module: what other modules use
__all__ = ["automatic_gc_paused", "collector_enabled", "fork_generation", "restore_collector"]

PAUSE = os.environ.get("PPBACKWARD_PAUSE_GC", "1").strip() != "0"  # the opt-out, read once

_lock = threading.RLock()  # re-entrant: a finaliser run by a collection could in principle call B
_depth = 0  # B and W calls inside the pause now, all threads together
_disabled_here = False  # whether the outermost of them disabled the collector


# Note [a fork inside a pause]: ``os.fork`` copies the counter and the switch into the child but none of the
# threads that hold the pause, and a ``multiprocessing`` or ``DataLoader`` worker forked meanwhile (a leak checker
# around a step that starts workers; a B on another thread) never leaves the blocks it was forked in: it ran with
# the automatic collector off for its whole life. So the child starts with no pause held: the counter at 0, the
# collector switched back on where the pause had switched it off, a new fork generation (a block entered before the
# fork and left in the child, on whichever thread, then changes nothing), a new lock. The lock is held across the
# fork itself (``before``/``after_in_parent``), so that the child never copies an update half made by another
# thread. The leak checker does the same for its debug flags (Note [a fork inside a checker] in
# ``ppbackward.leaks._checker``).
_generation = 0


def fork_generation() -> int:
    """How many forks this process came through (Note [a fork inside a pause]): a block that records it on entry
    and finds another on exit was entered before a fork and is left in the child."""
    return _generation


def _after_fork_in_child() -> None:
    global _lock, _depth, _disabled_here, _generation
    _lock = threading.RLock()
    _generation += 1
    _depth = 0
    if _disabled_here:
        _disabled_here = False
        gc.enable()


if hasattr(os, "register_at_fork"):  # POSIX; looked up at each fork, so a test can take it out
    os.register_at_fork(
        before=lambda: _lock.acquire(),
        after_in_parent=lambda: _lock.release(),
        after_in_child=lambda: _after_fork_in_child(),
    )


def collector_enabled() -> bool:
    """``gc.isenabled()``, but ``True`` while the collector is off only because B or W paused it."""
    with _lock:
        return gc.isenabled() or (_depth > 0 and _disabled_here)


def restore_collector(enabled: bool) -> None:
    """Put the collector's switch back to ``enabled`` (what :func:`collector_enabled` read earlier), without
    undoing a pause still held: while a B, W or leak tool holds the counter, the collector stays off and the
    last one out switches it to ``enabled``. The leak tools' exits use it (a nested checker, a tracker's report
    inside an armed checker: Note [one collection decides] in ``ppbackward.leaks._checker``)."""
    global _disabled_here
    with _lock:
        if _depth > 0:
            _disabled_here = enabled
            gc.disable()
        elif enabled:
            gc.enable()
        else:
            gc.disable()


@contextlib.contextmanager
def automatic_gc_paused(always: bool = False) -> Iterator[None]:
    """The automatic collector off for the block, then as it was (Note [no collection inside B and W]);
    nothing with ``PPBACKWARD_PAUSE_GC=0`` unless ``always`` (the leak tools' heap scans, Note [heap
    scans beside other threads] in ``ppbackward.leaks._heap``, need the pause whatever the setting)."""
    global _depth, _disabled_here
    if not (PAUSE or always):
        yield
        return
    entered: int | None = None  # the fork generation it entered in (Note [a fork inside a pause])
    try:
        with _lock:
            _depth += 1
            entered = _generation
            if _depth == 1:
                _disabled_here = gc.isenabled()
                gc.disable()
        yield
    finally:
        # a block entered before a fork and left in the child: the child counts it as never held
        if entered is not None and entered == _generation:
            with _lock:
                _depth -= 1
                if _depth == 0 and _disabled_here:
                    _disabled_here = False
                    gc.enable()
