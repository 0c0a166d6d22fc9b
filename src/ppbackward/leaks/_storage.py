"""Which storages a tensor (or an autograd node's saved tensors) keeps alive, and how big they are.

Private module; nothing here is public. Both the leak checker and the activation tracker count memory
as **bytes of unique storages**: two views of one buffer count once, and a view counts its whole
storage (that is what it keeps alive).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__: list[str] = []  # private module

try:  # torch >= 2.1; wrapper subclasses (DTensor, Float8Tensor, ...) hold their data in inner tensors
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _is_wrapper_subclass
except ImportError:  # pragma: no cover - very old torch

    def _is_wrapper_subclass(t: Any) -> bool:  # type: ignore[misc]
        return False


def _tensor_storages(t: torch.Tensor) -> list[Any]:
    """The untyped storages that hold ``t``'s data.

    Traceable wrapper subclasses (DTensor, ...) are opened through ``__tensor_flatten__`` so their
    inner tensors are counted rather than the empty wrapper (the names it lists that are not tensors,
    such as DTensor's ``device_mesh``, hold no storage). Tensors without a storage (sparse,
    nested) yield nothing.
    """
    if _is_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        found: list[Any] = []
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # DTensor lists its device_mesh too (torch >= 2.13)
                found.extend(_tensor_storages(inner))
        return found
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError, TypeError):
        return []


def _storage_key(storage: Any) -> int:
    """Identity of a live storage (its C++ ``StorageImpl`` address)."""
    return int(getattr(storage, "_cdata", id(storage)))


def _storage_nbytes(storage: Any) -> int:
    """Size of ``storage`` in bytes."""
    return int(storage.nbytes())


def _unique_storage_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> tuple[int, int]:
    """``(number of unique storages, their total size in bytes)`` over ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        for s in _tensor_storages(t):
            seen.setdefault(_storage_key(s), _storage_nbytes(s))
    return len(seen), sum(seen.values())


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in ``obj`` if it is a tensor or a (shallow) tuple/list of tensors."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                yield item


def _node_saved_tensors(node: Any) -> list[torch.Tensor]:
    """The tensors an autograd node saved for backward, read without running any unpack hook.

    Reads each ``_raw_saved_*`` attribute's ``.data``: the saved tensor itself, or, when saved-tensor
    hooks were active at save time, the object the pack hook returned (tensors in it are counted
    when it is a tensor or a tuple/list of tensors). Unpacking through ``_saved_*`` is avoided on
    purpose: an unpack hook may run arbitrary code (activation checkpointing recomputes the forward).
    Buffers already freed by a backward are skipped.
    """
    found: list[torch.Tensor] = []
    for name in dir(node):
        if not name.startswith("_raw_saved_"):
            continue
        try:
            raw = getattr(node, name)
        except RuntimeError:  # freed by a backward without retain_graph
            continue
        for saved in raw if isinstance(raw, (tuple, list)) else (raw,):
            try:
                data = saved.data
            except (AttributeError, RuntimeError):  # freed, or a torch without SavedTensor.data
                continue
            found.extend(_tensors_in(data))
    return found


def _format_bytes(n: int) -> str:
    """``n`` bytes in a human unit, exact count kept: ``'4000 bytes (3.9 KiB)'``."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "TiB":
            break
    return f"{n} bytes ({value:.1f} {unit})"
