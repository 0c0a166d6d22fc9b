"""Watching a storage (or another object that takes weak references) die without keeping it alive,
and telling how it died.

Private module. One :class:`Watch` per storage (shared by every saved tensor that views it),
fed by a weak reference to the storage's Python object. torch keeps a storage's Python object alive
exactly as long as its C++ ``StorageImpl`` (PyObject preservation), so the weak reference dies when
the memory is released, not when the last Python name for it goes away.

Note [watches form no cycle]
The tracker's map holds the ``WatchRef``; the ref holds its ``Watch``; records hold
watches. Nothing points back, so the bookkeeping itself never becomes cyclic garbage (it would show
up in a surrounding ``check_tensor_leaks`` otherwise). Dead refs stay in the map until their key is
reused or the tracker is cleared.
"""

from __future__ import annotations

import weakref
from typing import Any

from ppbackward.leaks._activations import ALIVE, FREED_BY_GC, FREED_BY_REFCOUNT
from ppbackward.leaks._gc_phase import collecting
from ppbackward.leaks._storage import storage_key, storage_nbytes

__all__ = ["Watch", "WatchMap", "WatchRef", "on_freed"]  # private module: what other modules use


class Watch:
    """Size in bytes and fate of one watched object (a storage here; an autograd node's sentinel or a
    packed tensor in ``_node_watches.py``): ``state`` is ``ALIVE``, ``FREED_BY_GC`` or ``FREED_BY_REFCOUNT``."""

    __slots__ = ("nbytes", "state")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.state = ALIVE


class WatchRef(weakref.ref):
    __slots__ = ("watch",)
    watch: Watch


def on_freed(ref: WatchRef) -> None:
    # Note [freed by gc vs refcount] in _gc_phase.py
    ref.watch.state = FREED_BY_GC if collecting() else FREED_BY_REFCOUNT


class WatchMap:
    """``storage -> Watch``, one watch per live storage."""

    def __init__(self) -> None:
        self._refs: dict[int, WatchRef] = {}

    def watch(self, storage: Any) -> Watch:
        """The watch of ``storage``, created on first sight."""
        key = storage_key(storage)
        ref = self._refs.get(key)
        if ref is not None and ref() is storage:
            return ref.watch
        ref = WatchRef(storage, on_freed)
        ref.watch = Watch(storage_nbytes(storage))
        self._refs[key] = ref
        return ref.watch

    def is_alive(self, storage: Any) -> bool:
        """Whether ``storage`` already has a watch (it was seen before and is the same storage)."""
        ref = self._refs.get(storage_key(storage))
        return ref is not None and ref() is storage

    def clear(self) -> None:
        self._refs.clear()
