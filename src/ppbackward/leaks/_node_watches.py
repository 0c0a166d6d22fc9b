"""Watching autograd nodes and packed saved tensors die, without keeping them alive.

Private module, used by :class:`ppbackward.leaks.ActivationTracker`.

Note [leaks the gc cannot see]: a pack hook that returns the tensor it is given (``lambda t: t``, or
``save_on_cpu`` on a CPU tensor) makes a node that saved its own output hold itself: node -> packed
tensor -> its ``grad_fn`` -> node. The cycle lives in C++ shared pointers, so the gc never sees it
(``gc.garbage`` stays empty and ``check_tensor_leaks`` reports nothing), and only the engine
releasing that node (a backward without ``retain_graph``) breaks it; otherwise the node, its whole
graph below and every packed tensor live for ever. The tracker therefore also watches, by weak
reference:

* every autograd **node** created in the block: a small sentinel object goes into the node's
  ``metadata`` dict, which the node owns, so the sentinel dies exactly when the node does;
* every tensor a user's **pack hook returned** (the packed object itself, or the tensors inside a
  tuple, list or dict it returned): what the graph keeps for backward.

Each watch records how its object died (reference counting, or a gc run: Note [freed by gc vs
refcount] in ``_gc_phase.py``); one still alive after a gc run is held by a live reference or by a
cycle the gc cannot see. Watches form no cycle: the tracker holds the weak references, the references
hold their watches, nothing points back (Note [watches form no cycle] in ``_watch.py``).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ppbackward.leaks._storage import unique_storage_bytes
from ppbackward.leaks._watch import Watch, WatchRef, on_freed

__all__ = ["LifeWatches"]  # private module: what other modules use


class _Sentinel:
    """What goes into a watched node's ``metadata``: an object that dies with the node."""

    __slots__ = ("__weakref__",)


class _LifeWatch(Watch):
    """A :class:`Watch` with a label for reports: the node's name, or the packed tensor's dtype and shape."""

    __slots__ = ("label",)

    def __init__(self, label: str, nbytes: int) -> None:
        super().__init__(nbytes)
        self.label = label


def _tensors_in(packed: Any) -> list[torch.Tensor]:
    """The tensors a pack hook returned: the object itself, or those one level inside a container."""
    if isinstance(packed, torch.Tensor):
        return [packed]
    if isinstance(packed, dict):
        packed = list(packed.values())
    if isinstance(packed, (tuple, list)):
        return [p for p in packed if isinstance(p, torch.Tensor)]
    return []


class LifeWatches:
    """Weak watches over nodes (by a sentinel in their metadata) or packed tensors (by the tensor)."""

    def __init__(self, key: str) -> None:
        self._key = key  # the metadata key of this tracker's sentinels
        self._refs: list[WatchRef] = []

    def watch_node(self, node: Any, name: str) -> None:
        sentinel = _Sentinel()
        try:
            node.metadata[self._key] = sentinel
        except (AttributeError, RuntimeError, TypeError):  # a node without metadata: not watched
            return
        self._add(sentinel, name, 0)

    def watch_packed(self, packed: Any) -> None:
        for t in _tensors_in(packed):
            with torch._C.DisableTorchFunction():
                nbytes = unique_storage_bytes([t])[1]
                label = f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
            self._add(t, label, nbytes)

    def _add(self, obj: Any, label: str, nbytes: int) -> None:
        ref = WatchRef(obj, on_freed)
        ref.watch = _LifeWatch(label, nbytes)
        self._refs.append(ref)

    def states(self) -> list[_LifeWatch]:
        return [cast(_LifeWatch, ref.watch) for ref in self._refs]

    def clear(self) -> None:
        self._refs.clear()
