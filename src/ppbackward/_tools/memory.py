"""Measure the bytes of saved activations an autograd graph holds, without touching it.

Private module, shared by the memory tests and the benchmark (issue 6). It reads saved tensors
through ``grad_fn._saved_*`` (no saved-tensor hooks are added, so ppbackward's release of unread
saved tensors still happens, see ``ppbackward._saved``) and keeps only weak references to their
storages: a storage's Python object lives exactly as long as the storage itself, so a dead weak
reference means the memory was freed. Parameters' storages are excluded.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.autograd.graph import Node

__all__: list[str] = []  # private module

SavedStorages = dict  # data_ptr -> (weakref to UntypedStorage, nbytes)


def _saved_tensors_of(node: Node) -> list[torch.Tensor]:
    found = []
    for attr in dir(node):
        if not attr.startswith("_raw_saved_"):
            continue
        try:
            value = getattr(node, "_saved_" + attr[len("_raw_saved_") :])
        except Exception:  # released (ppbackward or the engine), or not readable
            continue
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


def saved_storages(
    roots: Iterable[Node | None], exclude: Iterable[torch.Tensor] = (), stop: Iterable[Node] = ()
) -> SavedStorages:
    """Storages saved by every node reachable from ``roots`` (not below ``stop`` nodes).

    Args:
        roots: nodes to start from (``None`` entries ignored).
        exclude: tensors whose storages are not counted (e.g. the module's parameters).
        stop: nodes whose subgraphs are not walked (e.g. the W-only boundary).

    Returns:
        ``{data_ptr: (weakref to the storage, nbytes)}``.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    stop_set = set(stop)
    out: SavedStorages = {}
    seen: set[Node] = set()
    todo = [n for n in roots if n is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for t in _saved_tensors_of(node):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in skip and storage.nbytes():
                out[ptr] = (weakref.ref(storage), storage.nbytes())
        if node not in stop_set:
            todo.extend(k for k, _ in node.next_functions if k is not None)
    return out


def alive_bytes(storages: SavedStorages) -> int:
    """Bytes of the storages in ``storages`` that are still allocated."""
    return sum(nbytes for ref, nbytes in storages.values() if ref() is not None)


def w_floor_bytes(param_groups, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes saved by the nodes ppbackward's W runs for ``param_groups`` (its intermediates and
    their weight-only subgraphs): the least a B/W split must hold between B and W."""
    exclude = list(exclude)
    intermediates = [call.node for group in param_groups for call in group.intermediates]
    roots = [
        call.node.next_functions[i][0]
        for group in param_groups
        for call in group.intermediates
        for i in call.w_edges
    ]
    roots += [c.edge.node for group in param_groups for c in group.ready]
    held = saved_storages(roots, exclude)
    held.update(saved_storages(intermediates, exclude, stop=intermediates))
    return sum(nbytes for _, nbytes in held.values())
