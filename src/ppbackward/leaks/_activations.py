"""What :func:`ppbackward.leaks.track_activations` reports: :class:`SavedActivation`, :class:`ActivationReport`.

Public names (re-exported by ``ppbackward.leaks``): ``SavedActivation``, ``ActivationReport``.
Both are plain snapshots (numbers, strings, dtypes, devices): holding a report keeps no tensor alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ppbackward.leaks._storage import format_bytes

__all__ = ["ALIVE", "FREED_BY_GC", "FREED_BY_REFCOUNT", "UNTRACKED", "ActivationReport", "SavedActivation"]

#: ``SavedActivation.state`` values.
ALIVE = "alive"  # alive at report time (after the report's collection when collect=True)
FREED_BY_GC = "freed_by_gc"  # its storage died during a gc collection: it was held by a reference cycle
FREED_BY_REFCOUNT = "freed_by_refcount"  # its storage died by reference counting: no cycle, no leak
UNTRACKED = "untracked"  # no storage to watch (sparse, nested): never in any of the lists

_LISTED = 20  # entries per list shown by ActivationReport.format()


@dataclass(frozen=True)
class SavedActivation:
    """One tensor that autograd saved for backward inside a :func:`track_activations` block.

    Attributes:
        index: position in save order (0 = first tensor saved in the tracker's lifetime).
        node_name: name of the autograd node that saved it (``grad_fn`` name, e.g.
            ``"AddmmBackward0"``, or a custom ``Function``'s ``"<Name>Backward"``); ``"<unknown>"``
            when it could not be resolved (see ``docs/leak-hunting.md``).
        shape: the saved tensor's shape.
        dtype: its dtype.
        device: its device.
        nbytes: bytes of the storage(s) the saved tensor keeps alive (a view counts its whole
            storage: that is what stays allocated).
        state: ``"alive"``, ``"freed_by_gc"``, ``"freed_by_refcount"`` or ``"untracked"``.
        is_leaf: ``True`` for a leaf tensor (recorded only with ``include_leaves``/
            ``include_parameters``, or for a non-differentiable output of an op in the block).
    """

    index: int
    node_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    state: str
    is_leaf: bool = False

    def describe(self) -> str:
        """One line: ``#3 AddmmBackward0 saved float32[4, 8] on cpu, 128 bytes``."""
        dtype = str(self.dtype).replace("torch.", "")
        return f"#{self.index} {self.node_name} saved {dtype}{list(self.shape)} on {self.device}, {self.nbytes} bytes"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (dtype and device as strings)."""
        return {
            "index": self.index,
            "node_name": self.node_name,
            "shape": list(self.shape),
            "dtype": str(self.dtype),
            "device": str(self.device),
            "nbytes": self.nbytes,
            "state": self.state,
            "is_leaf": self.is_leaf,
        }


@dataclass(frozen=True)
class ActivationReport:
    """Where the saved activations of a :func:`track_activations` block stand.

    Attributes:
        saved: every recorded activation, in save order.
        alive: not freed by reference counting -- what would still be allocated with ``gc``
            disabled. Equals ``freed_only_by_gc + held_after_gc``.
        freed_only_by_gc: freed by a gc collection (the report's own, or an earlier automatic
            one): they were held by a reference cycle and outlived their last use until a
            collection ran. Cycles the :func:`check_tensor_leaks` checker reports land here.
        held_after_gc: still alive after the report's ``gc.collect()``: held by a live reference
            (a cache, a module-level list, a hook left on a long-lived tensor, the caller's own
            variables) or by a cycle the collector cannot see (e.g. through ``node.metadata``).
            With ``collect=False`` this is simply "alive now", not verified by a collection.
        freed_by_refcount: freed promptly by reference counting (the healthy case).
        bytes_alive: bytes of the unique storages of ``alive``.
        bytes_freed_only_by_gc: bytes of the unique storages of ``freed_only_by_gc``.
        bytes_held_after_gc: bytes of the unique storages of ``held_after_gc``.
        collected: whether the report ran ``gc.collect()`` first.
        nodes: autograd nodes created in the block (Note [leaks the gc cannot see] in ``_node_watches.py``).
        nodes_freed_only_by_gc: of those, how many a gc run freed (a reference cycle held them).
        nodes_held_after_gc: the names of those still alive (after the report's collection, with
            ``collect=True``): held by a live reference or by a cycle inside C++ that the gc cannot
            see, such as a node holding itself through a pack hook that returned the tensor.
        packed: tensors that the user's saved-tensor pack hooks returned in the block.
        packed_freed_only_by_gc: of those, how many a gc run freed.
        packed_held_after_gc: ``dtype[shape]`` of those still alive.
        bytes_packed_held_after_gc: bytes of their storages.
        held_by: for what a live reference holds after the block (an output tensor of the block kept
            alive, with its graph and saved tensors), the back-reference chain to its holder, one string
            per tensor (at most 3): ``[0] Tensor float32[] ..., grad_fn=PowBackward0`` /
            ``<- [1] list (len 1) via [0]`` / ``<- [2] Loop object via .outputs``. Filled with
            ``collect=True`` when a node of the block is still alive; empty otherwise.

    ``str(report)`` is :meth:`format`.
    """

    saved: list[SavedActivation] = field(default_factory=list)
    alive: list[SavedActivation] = field(default_factory=list)
    freed_only_by_gc: list[SavedActivation] = field(default_factory=list)
    held_after_gc: list[SavedActivation] = field(default_factory=list)
    freed_by_refcount: list[SavedActivation] = field(default_factory=list)
    bytes_alive: int = 0
    bytes_freed_only_by_gc: int = 0
    bytes_held_after_gc: int = 0
    collected: bool = True
    nodes: int = 0
    nodes_freed_only_by_gc: int = 0
    nodes_held_after_gc: list[str] = field(default_factory=list)
    packed: int = 0
    packed_freed_only_by_gc: int = 0
    packed_held_after_gc: list[str] = field(default_factory=list)
    bytes_packed_held_after_gc: int = 0
    held_by: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return self.format()

    def format(self) -> str:
        """A multi-line human-readable summary with the alive activations listed."""
        lines = [
            f"ppbackward.leaks: {len(self.saved)} saved activation(s) recorded"
            + ("" if self.collected else " (no gc.collect() run: 'held after gc' means 'alive now')"),
            f"  freed by reference counting: {len(self.freed_by_refcount)}",
            f"  freed only by the cycle collector (held by a reference cycle): {len(self.freed_only_by_gc)}, "
            f"{format_bytes(self.bytes_freed_only_by_gc)}",
            f"  still alive after gc (held by a live reference, or a cycle inside C++): {len(self.held_after_gc)}, "
            f"{format_bytes(self.bytes_held_after_gc)}",
        ]
        if self.nodes:
            lines.append(
                f"  autograd nodes created in the block: {self.nodes}; freed only by the cycle collector: "
                f"{self.nodes_freed_only_by_gc}; still alive after gc: {len(self.nodes_held_after_gc)}"
                + (f" ({', '.join(self.nodes_held_after_gc[:_LISTED])})" if self.nodes_held_after_gc else "")
            )
        if self.packed:
            lines.append(
                f"  tensors returned by saved-tensor pack hooks: {self.packed}; freed only by the cycle "
                f"collector: {self.packed_freed_only_by_gc}; still alive after gc: "
                f"{len(self.packed_held_after_gc)}, {format_bytes(self.bytes_packed_held_after_gc)}"
            )
        if self.held_by:
            lines.append("what holds the block's live outputs (and through them their graph and saved tensors):")
            lines.extend("  " + line for chain in self.held_by for line in chain.splitlines())
        for title, items in (("held after gc", self.held_after_gc), ("freed only by gc", self.freed_only_by_gc)):
            if items:
                lines.append(f"{title}:")
                lines.extend("  " + a.describe() for a in items[:_LISTED])
                if len(items) > _LISTED:
                    lines.append(f"  ... and {len(items) - _LISTED} more")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return {
            "saved": [a.to_dict() for a in self.saved],
            "alive": [a.index for a in self.alive],
            "freed_only_by_gc": [a.index for a in self.freed_only_by_gc],
            "held_after_gc": [a.index for a in self.held_after_gc],
            "freed_by_refcount": [a.index for a in self.freed_by_refcount],
            "bytes_alive": self.bytes_alive,
            "bytes_freed_only_by_gc": self.bytes_freed_only_by_gc,
            "bytes_held_after_gc": self.bytes_held_after_gc,
            "collected": self.collected,
            "nodes": self.nodes,
            "nodes_freed_only_by_gc": self.nodes_freed_only_by_gc,
            "nodes_held_after_gc": list(self.nodes_held_after_gc),
            "packed": self.packed,
            "packed_freed_only_by_gc": self.packed_freed_only_by_gc,
            "packed_held_after_gc": list(self.packed_held_after_gc),
            "bytes_packed_held_after_gc": self.bytes_packed_held_after_gc,
            "held_by": list(self.held_by),
        }
