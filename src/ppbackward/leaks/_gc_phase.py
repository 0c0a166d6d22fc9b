"""The cycle collector's phases: whether this thread is inside a collection right now (to tell *how*
a storage was freed), and a full collection that surely ran (:func:`full_collect`).

Private module. One ``gc.callbacks`` entry, :func:`_on_gc`, appended when this module is first imported
and never removed: adding and removing entries while another thread walks the list (CPython walks it
by index) could make that thread skip an entry, such as the tracker's own "stop".

Note [freed by gc vs refcount]
A weak-reference callback that fires while *its own thread* is inside a collection means the object
died because that collection broke a reference cycle (a collection frees its garbage, and so runs the
callbacks, in the thread that collects); one that fires anywhere else means it died by reference
counting. So the watcher records which thread is collecting, and :func:`collecting` answers for the
calling thread only: a tensor freed by reference counting in one thread while another thread is
inside a collection (any Python code a collection runs, a finaliser or a callback, may let other
threads run) is counted as freed by reference counting, as it was.

Note [a collection that surely ran]
``gc.collect()`` returns 0 *without collecting* while another collection is in progress: CPython
keeps one ``collecting`` flag per interpreter, and Python code run by a collection in another thread
(a finaliser, a weak-reference callback) may let this thread run mid-collection. A checker that
called ``gc.collect()`` there saw none of its block's cycles and reported a leaky block as clean (seen
in CI: a background thread of the test suite was collecting while ``check_tensor_leaks`` exited). So
the leak tools collect through :func:`full_collect`, which counts, through the watcher, the full
collections this thread started, and calls again, yielding the GIL in between, until one ran.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

__all__ = ["collecting", "ensure_watcher", "full_collect"]  # private module: what other modules use

_FULL_COLLECT_TIMEOUT_S = 60.0  # a hang guard only: a collection takes milliseconds to a few seconds

_collector: int | None = None  # the thread inside a collection now, if any
_own = threading.local()  # per thread: ``full``, the full collections this thread has started


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    global _collector
    if phase == "start":
        _collector = threading.get_ident()
        if info.get("generation") == 2:
            _own.full = getattr(_own, "full", 0) + 1
    elif phase == "stop":
        _collector = None


gc.callbacks.append(_on_gc)  # once, at first import


def collecting() -> bool:
    """``True`` while the calling thread is inside a ``gc`` collection (automatic or ``gc.collect()``);
    Note [freed by gc vs refcount]."""
    return _collector == threading.get_ident()


def ensure_watcher() -> None:
    """Put the watcher back should a caller have removed it from ``gc.callbacks``."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def _yield_gil() -> None:
    """Let another thread's collection go on (a separate function so a test can see the retry)."""
    time.sleep(0.001)


def full_collect() -> int:
    """Run a full (generation 2) collection of this thread; Note [a collection that surely ran].

    Returns:
        What the collection that ran returned: the number of unreachable objects it found.

    Raises:
        RuntimeError: at once when called from inside this thread's own collection (a finaliser or a
            weak-reference callback: no collection can start there); or when another thread's
            collection kept any from starting for ``_FULL_COLLECT_TIMEOUT_S`` seconds (60).
    """
    if collecting():
        raise RuntimeError("full_collect: called from inside this thread's own gc collection (a finaliser or callback)")
    ensure_watcher()
    deadline = time.monotonic() + _FULL_COLLECT_TIMEOUT_S
    while True:
        before = getattr(_own, "full", 0)
        found = gc.collect()
        if getattr(_own, "full", 0) > before:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"full_collect: gc.collect() could not start a collection for {_FULL_COLLECT_TIMEOUT_S:g} s: "
                "another thread's collection did not end"
            )
        _yield_gil()
