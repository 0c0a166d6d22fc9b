"""The cycle collector's phases: whether it is running right now (to tell *how* a storage was
freed), and a full collection that surely ran (:func:`full_collect`).

Private module. A weak-reference callback that fires while ``gc`` is collecting means the object
died because a collection broke a reference cycle; one that fires outside a collection means it
died by reference counting. The watcher is a ``gc.callbacks`` entry, installed while at least one
activation tracker is alive and removed after the last one is gone.

Note [freed by gc vs refcount]
The classification is exact for single-threaded code. A weakref callback running during a collection
may release the GIL; a tensor freed by reference counting in *another* thread during that window
is then counted as freed by the collector.

Note [a collection that surely ran]
``gc.collect()`` returns 0 *without collecting* while another collection is in progress: CPython
keeps one ``collecting`` flag per interpreter, and a finaliser or weak-reference callback run by a
collection in another thread may release the GIL mid-collection. A checker that called
``gc.collect()`` there saw none of its block's cycles and reported a leaky block as clean (seen in
CI: a background thread of the test suite was collecting while ``check_tensor_leaks`` exited). So
the leak tools collect through :func:`full_collect`, which watches, through a ``gc.callbacks``
entry, for a full collection *started by the calling thread* and calls again, yielding the GIL in
between, until one ran.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

__all__: list[str] = []  # private module

_FULL_COLLECT_TIMEOUT_S = 60.0  # a hang guard only: a collection takes milliseconds to a few seconds

_lock = threading.Lock()
_users = 0
_depth = 0


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    global _depth
    if phase == "start":
        _depth += 1
    elif phase == "stop":
        _depth = max(0, _depth - 1)


def _collecting() -> bool:
    """``True`` while a ``gc`` collection (automatic or ``gc.collect()``) is in progress."""
    return _depth > 0


def _acquire() -> None:
    """Install the ``gc.callbacks`` watcher (reference counted)."""
    global _users, _depth
    with _lock:
        _users += 1
        if _users == 1 and _on_gc not in gc.callbacks:
            _depth = 0  # a watcher removed mid-collection never saw its "stop"
            gc.callbacks.append(_on_gc)


def _release() -> None:
    """Drop one user of the watcher; remove it from ``gc.callbacks`` after the last one."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0 and _on_gc in gc.callbacks:
            gc.callbacks.remove(_on_gc)


def _yield_gil() -> None:
    """Let another thread's collection go on (a separate function so a test can see the retry)."""
    time.sleep(0.001)


def full_collect() -> int:
    """Run a full (generation 2) collection of this thread; Note [a collection that surely ran].

    Returns:
        What the collection that ran returned: the number of unreachable objects it found.

    Raises:
        RuntimeError: when no collection could start for ``_FULL_COLLECT_TIMEOUT_S`` seconds (60):
            another thread's collection never ended, or this was called from a finaliser or
            weak-reference callback of this thread's own collection.
    """
    me = threading.get_ident()
    ran: list[bool] = []

    def _seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info.get("generation") == 2 and threading.get_ident() == me:
            ran.append(True)

    gc.callbacks.append(_seen)
    try:
        deadline = time.monotonic() + _FULL_COLLECT_TIMEOUT_S
        while True:
            found = gc.collect()
            if ran:
                return found
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"gc.collect() could not start a collection for {_FULL_COLLECT_TIMEOUT_S:.0f} s: "
                    "a collection in progress (another thread's, or this thread's own when called from a "
                    "finaliser) did not end"
                )
            _yield_gil()
    finally:
        gc.callbacks.remove(_seen)
