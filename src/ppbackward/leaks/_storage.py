"""Which storages tensors keep alive, and how big they are; and which graph (``grad_fn``) they hold.

Private module; nothing here is public. The one storage accountant of the project: the leak checker,
the activation tracker and the tooling's measurements (``ppbackward._tools.memory``, the bench) count
memory as **bytes of unique storages**, keyed by :func:`storage_key`: two views of one buffer count
once, and a view counts its whole storage (that is what it keeps alive).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = [  # private module: what other modules use
    "format_bytes",
    "grad_fn_or_none",
    "storage_key",
    "storage_nbytes",
    "tensor_storages",
    "unique_storage_bytes",
    "unique_storages",
]

try:  # torch >= 2.1; wrapper subclasses (DTensor, Float8Tensor, ...) hold their data in inner tensors
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _is_wrapper_subclass
except ImportError:  # pragma: no cover - very old torch

    def _is_wrapper_subclass(t: Any) -> bool:  # type: ignore[misc]
        return False


def grad_fn_or_none(t: torch.Tensor) -> Any:
    """``t.grad_fn`` as stored (no ``__torch_function__`` override), or ``None`` where it cannot be read: a
    tensor object the gc cleared in a cycle it could not free yet is an undefined tensor ("cannot call
    get_autograd_meta() on undefined tensor"; met in a heap scan on torch 2.5.1), which holds no graph. The
    leak tools read every tensor they find through it."""
    try:
        with torch._C.DisableTorchFunction():
            return t.grad_fn
    except RuntimeError:
        return None


def tensor_storages(t: torch.Tensor) -> list[Any]:
    """The untyped storages that hold ``t``'s data.

    Traceable wrapper subclasses (DTensor, ...) are opened through ``__tensor_flatten__`` so their
    inner tensors are counted rather than the empty wrapper (the names it lists that are not tensors,
    such as DTensor's ``device_mesh``, hold no storage). Sparse tensors are counted through the dense
    tensors they are made of (indices and values); a meta tensor holds no memory. A tensor without a
    storage of its own that is neither (mkldnn) yields nothing.
    """
    try:
        layout, meta = t.layout, t.is_meta
    except RuntimeError:  # a tensor the gc cleared (grad_fn_or_none)
        return []
    if meta:
        return []
    parts = _SPARSE_PARTS.get(layout)
    if parts is not None:
        return [s for part in parts for s in tensor_storages(getattr(t, part)())]
    if _is_wrapper_subclass(t):
        try:  # a wrapper the gc cleared (grad_fn_or_none) has lost its inner tensors
            names, _ = t.__tensor_flatten__()
            inners = [getattr(t, name) for name in names]
        except (AttributeError, RuntimeError):
            return []
        found: list[Any] = []
        for inner in inners:
            if isinstance(inner, torch.Tensor):  # DTensor lists its device_mesh too (torch >= 2.13)
                found.extend(tensor_storages(inner))
        return found
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError, TypeError):
        return []


# the dense tensors a sparse tensor of each layout is made of (the methods that give them)
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def storage_key(storage: Any) -> int:
    """Identity of a live storage (its C++ ``StorageImpl`` address)."""
    return int(getattr(storage, "_cdata", id(storage)))


def storage_nbytes(storage: Any) -> int:
    """Size of ``storage`` in bytes."""
    return int(storage.nbytes())


def unique_storages(tensors: Iterable[torch.Tensor]) -> dict[int, Any]:
    """``{storage key: storage}`` for the unique storages holding ``tensors``' data, in first-seen order
    (keys: :func:`storage_key`; a view brings its whole storage, wrapper subclasses their inner ones)."""
    seen: dict[int, Any] = {}
    for t in tensors:
        for s in tensor_storages(t):
            seen.setdefault(storage_key(s), s)
    return seen


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """``(number of unique storages, their total size in bytes)`` over ``tensors``."""
    storages = unique_storages(tensors)
    return len(storages), sum(storage_nbytes(s) for s in storages.values())


def format_bytes(n: int) -> str:
    """``n`` bytes in a human unit, exact count kept: ``'4000 bytes (3.9 KiB)'``."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "TiB":
            break
    return f"{n} bytes ({value:.1f} {unit})"
