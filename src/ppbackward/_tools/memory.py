"""Measure the bytes of saved activations an autograd graph holds, without touching it.

Private module, shared by the memory tests and the benchmark (issue 6). It reads saved tensors as the
backward would see them (``ppbackward._saved.saved_tensors(node, unpack=True)``, Note [reading saved
tensors]: a tensor ppbackward pinned after B counts through the alias that keeps its storage alive; one
it released is skipped; no saved-tensor hooks are added, so ppbackward's release of unread saved
tensors still happens) and counts them with the library's storage accountant
(``ppbackward.leaks._storage``: unique storages, keyed by storage identity). Only weak references to the
storages are kept: a storage's Python object lives exactly as long as the storage itself, so a dead weak
reference means the memory was freed. Excluded storages (parameters) and empty ones are not counted.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.autograd.graph import Node

from ppbackward._saved import saved_tensors
from ppbackward.leaks._storage import storage_nbytes, unique_storages

__all__ = ["SavedStorages", "alive_bytes", "saved_storages", "w_floor_bytes"]

SavedStorages = dict  # storage key (``storage_key``) -> (weakref to the UntypedStorage, nbytes)


def saved_storages(
    roots: Iterable[Node | None], exclude: Iterable[torch.Tensor] = (), stop: Iterable[Node] = ()
) -> SavedStorages:
    """Storages saved by every node reachable from ``roots`` (not below ``stop`` nodes).

    Reading runs unpack hooks (Note [reading saved tensors] in ``ppbackward._saved``): meant for graphs
    whose only hooks are ppbackward's own.

    Args:
        roots: nodes to start from (``None`` entries ignored).
        exclude: tensors whose storages are not counted (e.g. the module's parameters).
        stop: nodes whose subgraphs are not walked (e.g. the W-only boundary).

    Returns:
        ``{storage key: (weakref to the storage, nbytes)}``, nonempty storages only.
    """
    skip = set(unique_storages(exclude))
    stop_set = set(stop)
    out: SavedStorages = {}
    seen: set[Node] = set()
    todo = [n for n in roots if n is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        _add(out, saved_tensors(node, unpack=True), skip)
        if node not in stop_set:
            todo.extend(k for k, _ in node.next_functions if k is not None)
    return out


def _add(out: SavedStorages, tensors: Iterable[torch.Tensor], skip: set) -> None:
    """Count the nonempty storages of ``tensors`` not in ``skip`` into ``out`` (weakly referenced)."""
    for key, storage in unique_storages(tensors).items():
        nbytes = storage_nbytes(storage)
        if key not in skip and nbytes:
            out[key] = (weakref.ref(storage), nbytes)


def alive_bytes(storages: SavedStorages) -> int:
    """Bytes of the storages in ``storages`` that are still allocated."""
    return sum(nbytes for ref, nbytes in storages.values() if ref() is not None)


def w_floor_bytes(param_groups, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes saved by the nodes ppbackward's W runs for ``param_groups`` (its intermediates and
    their weight-only subgraphs), and the matmul inputs B took out for W: the least a B/W split must hold
    between B and W."""
    exclude = list(exclude)
    intermediates = [call.node for group in param_groups for call in group.calls]
    roots = [
        call.node.next_functions[i][0]
        for group in param_groups
        for call in group.calls
        for i in call.w_edges
    ]
    roots += [c.edge.node for group in param_groups for c in group.ready]
    held = saved_storages(roots, exclude)
    held.update(saved_storages(intermediates, exclude, stop=intermediates))
    # the matmul inputs B took out for W (Note [weight matmuls from their saved input]): their nodes hold nothing
    _add(held, [x for group in param_groups for x, _ in group.taken.values()], set(unique_storages(exclude)))
    return sum(nbytes for _, nbytes in held.values())
