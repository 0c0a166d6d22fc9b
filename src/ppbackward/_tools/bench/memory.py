"""Bytes of saved activations held between B and W, against the bytes W actually reads.

Private module. Two forwards of the same stage, with the same shapes and therefore the same bytes:

* **held** (no hooks): after the forward, weak references to the storages of every tensor saved
  by the graph (``ppbackward._tools.memory.saved_storages``, which reads them unpacked: Note [reading
  saved tensors] in ``ppbackward._saved``); after B returns, the bytes of those still allocated. The
  stage output is kept alive until W, as torch's
  ``PipelineStage`` keeps it in ``backward_state``; its storage, the parameters' and the stage
  input's are not counted (the caller owns them). No saved-tensor hook is installed here, on
  purpose: ppbackward's B releases the saved tensors W never reads through the public
  ``SavedTensor.register_hooks`` and leaves alone those that already have hooks (Note [release
  unread saved tensors] in ``ppbackward._saved``), so measuring with hooks would disable what is
  measured. The gc is disabled from the forward to the end of W, so held is what reference
  counting keeps; ``held_after_gc_bytes`` repeats the count after a ``gc.collect()``.
* **floor** (unpack hooks): the forward runs under ``torch.autograd.graph.saved_tensors_hooks``.
  The pack hook returns a *detached alias* ``a = t.detach()`` (never ``t`` itself: packing a
  node's own output would make the node hold the tensor that holds the node, a cycle inside C++
  that no gc can break; parameters and the stage input, leaves requiring grad, are returned as
  they are) and keeps a ``weakref.ref(a)``; the unpack hook records the storage of every alias read
  during W. A node run in W unpacks all its saved tensors, whether or not the gradients W asks for
  use them: the floor is what W *reads*, as the engine runs it. W reads the same tensors with or
  without the release, so this run gives the floor of either implementation.

With a user's hooks (``measure_hooked``: a pack that keeps a copy, as offloading does) the same two
figures are read from the hooks themselves: the bytes of the copies alive after B, and of those W
unpacks.

Both runs count unique storages, keyed and sized by the library's accountant
(``ppbackward.leaks._storage``): several saved tensors may be views of one buffer (attention's q, k
and v are chunks of one projection). Both
count the same set at the end of the forward (``saved_bytes`` and ``saved_bytes_hooked`` agree);
``held >= floor`` unless W read something B had freed (W would then have failed). The recorder and
the storage map hold only weak references and integers; the hooks that autograd nodes keep
reference the recorder, never a node or a tensor, so measuring creates no cycle.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from ppbackward._saved import observing_only
from ppbackward._tools.bench.impls import run_b, run_w
from ppbackward._tools.bench.timing import gc_paused
from ppbackward._tools.harness.models import Stage, reset_grads
from ppbackward._tools.memory import alive_bytes, saved_storages
from ppbackward.leaks._storage import (
    storage_key,
    storage_nbytes,
    tensor_storages,
    unique_storage_bytes,
    unique_storages,
)

__all__ = ["measure_hooked", "measure_split"]  # private module: what other modules use

_Key = tuple[int, int]


def _keys(t: torch.Tensor) -> tuple[_Key, ...]:
    """``(storage key, bytes)`` of each storage holding ``t``'s data (the storage accountant's
    ``tensor_storages``: a wrapper subclass brings its inner tensors', a tensor without storage none)."""
    return tuple((storage_key(st), storage_nbytes(st)) for st in tensor_storages(t))


class SavedRecorder:
    """Pack/unpack hooks that record which saved storages are read, per phase (module docstring)."""

    __slots__ = ("phase", "refs", "skip", "unpacked")

    def __init__(self, skip: frozenset[int] = frozenset()) -> None:
        self.refs: list[tuple[weakref.ref, tuple[_Key, ...]]] = []
        self.unpacked: dict[str, set[_Key]] = {}
        self.phase = "forward"
        self.skip = skip  # storage keys not counted (parameters, stage input, output)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad and t.grad_fn is None:  # a parameter or the stage input
            return t
        a = t.detach()
        self.refs.append((weakref.ref(a), _keys(a)))
        return a

    @observing_only  # the split treats the tensors as unhooked (Note [hooked saved tensors run once])
    def unpack(self, a: torch.Tensor) -> torch.Tensor:
        if not (a.requires_grad and a.grad_fn is None):
            self.unpacked.setdefault(self.phase, set()).update(_keys(a))
        return a

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def bytes(self, keys: Any) -> int:
        return sum(nbytes for key, nbytes in set(keys) if key not in self.skip and nbytes)


def _floor(impl: str, stage: Stage) -> tuple[int, int]:
    """(bytes saved by the forward, bytes W unpacks) with the recorder's hooks."""
    reset_grads(stage)
    rec = SavedRecorder()
    with rec.hooks():
        out = stage.model(stage.x)
    rec.skip = frozenset(unique_storages([*stage.params, stage.x, out]))
    saved = rec.bytes(key for ref, keys in rec.refs if ref() is not None for key in keys)
    rec.phase = "B"
    groups = run_b(impl, stage, out)
    # what ppbackward's B took out of the weight matmuls for W (read in B, used in W: Note [weight matmuls from
    # their saved input] in ppbackward._matmul_weights)
    for group in groups:
        for x, _ in getattr(group, "taken", {}).values():
            rec.unpacked.setdefault("W", set()).update(_keys(x))
    rec.phase = "W"
    run_w(impl, stage, groups)
    del groups, out
    reset_grads(stage)
    return saved, rec.bytes(rec.unpacked.get("W", ()))


class _CopyHooks:
    """A user's offloading-style hook pair (issue 15): pack keeps a copy, unpack hands it back.

    Not transparent to the split: ppbackward's B sees hooked saved tensors and does W's work itself
    (Note [hooked saved tensors run once]). Records the bytes of every copy still alive, and of every
    copy unpacked during W. Parameters and the stage input are returned as they are (not copied).
    """

    def __init__(self) -> None:
        self.copies: list[tuple[weakref.ref, int]] = []
        self.read_in_w: dict[int, int] = {}
        self.phase = "forward"

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad and t.grad_fn is None:
            return t
        copy = t.detach().clone()
        self.copies.append((weakref.ref(copy), unique_storage_bytes([copy])[1]))
        return copy

    def unpack(self, copy: torch.Tensor) -> torch.Tensor:
        if self.phase == "W" and not (copy.requires_grad and copy.grad_fn is None):
            self.read_in_w[id(copy)] = unique_storage_bytes([copy])[1]
        return copy

    def alive_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.copies if ref() is not None)


def measure_hooked(impl: str, stage: Stage) -> dict[str, Any]:
    """Bytes of what a user's pack hook returned that are alive between B and W, against the bytes W
    unpacks; and alive after W (the stage output dropped)."""
    reset_grads(stage)
    hooks = _CopyHooks()
    try:
        with gc_paused():
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                out = stage.model(stage.x)
            packed = hooks.alive_bytes()
            hooks.phase = "B"
            groups = run_b(impl, stage, out)
            held = hooks.alive_bytes()
            hooks.phase = "W"
            run_w(impl, stage, groups)
            del groups, out
            after_w = hooks.alive_bytes()
    finally:
        reset_grads(stage)
    floor = sum(hooks.read_in_w.values())
    return {
        "packed_bytes": packed,
        "held_bytes": held,
        "floor_bytes": floor,
        "held_over_floor": held / floor if floor else (float("inf") if held else 1.0),
        "after_w_bytes": after_w,
    }


def measure_split(impl: str, stage: Stage) -> dict[str, Any]:
    """Held (no hooks) and floor (unpack hooks) bytes of ``impl`` on ``stage``; see module docstring."""
    saved_hooked, floor = _floor(impl, stage)
    reset_grads(stage)
    try:
        with gc_paused():
            out = stage.model(stage.x)
            storages = saved_storages([out.grad_fn], exclude=[*stage.params, stage.x, out])
            saved = alive_bytes(storages)
            groups = run_b(impl, stage, out)
            held = alive_bytes(storages)  # `out` is still referenced, as PipelineStage keeps it until W
            gc.collect()
            held_after_gc = alive_bytes(storages)
            run_w(impl, stage, groups)
            del groups, out
            after_w = alive_bytes(storages)
    finally:
        reset_grads(stage)
    return {
        "saved_bytes": saved,
        "saved_bytes_hooked": saved_hooked,
        "held_bytes": held,
        "floor_bytes": floor,
        "held_over_floor": held / floor if floor else (float("inf") if held else 1.0),
        "held_after_gc_bytes": held_after_gc,
        "after_w_bytes": after_w,
        "unread_held_bytes": held - floor,
    }
