"""Knowing whether the cycle collector is running right now (to tell *how* a storage was freed).

Private module. A weak-reference callback that fires while ``gc`` is collecting means the object
died because a collection broke a reference cycle; one that fires outside a collection means it
died by reference counting. The watcher is a ``gc.callbacks`` entry, installed while at least one
activation tracker is alive and removed after the last one is gone.

Note [freed by gc vs refcount]
The classification is exact for single-threaded code. A weakref callback running during a collection
may release the GIL; a tensor freed by reference counting in *another* thread during that window
is then counted as freed by the collector.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

__all__: list[str] = []  # private module

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
