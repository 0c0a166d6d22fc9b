"""The activation-lifetime tracker: :func:`track_activations` and :class:`ActivationTracker`.

Public names (re-exported by ``ppbackward.leaks``): ``track_activations``, ``ActivationTracker``.

Records every tensor autograd saves for backward inside the block (``saved_tensors_hooks``), keeps
only weak references to their storages, and later tells which are alive, which were freed only by a
gc collection (held by a reference cycle: pytorch/pytorch#136507, #136584) and which are still held
after a collection (a live reference: a cache, a hook left on a long-lived tensor, #185331's kind, or
a cycle gc cannot see, #136678's ``node.metadata`` kind).

Note [tracker keeps nothing alive]
The tracker keeps only weak references to storages (``_watch.py``), sequence numbers and names; its
pack hook hands autograd a detached alias (Note [tracker pack hook detaches] in ``_saved_hooks.py``)
or the user's own packed object (Note [tracker composes with saved-tensor hooks], same file). Node
names are resolved by walking ``grad_fn.next_functions`` from tensors as they are produced and
saved; nodes are never stored.

Note [which saved tensors are recorded]
A view is judged by its base. Recorded by default: non-leaf tensors (activations) and leaves that do
not require grad and were made in the block -- outputs of an earlier op in the block, or made inside
the running op (not among its arguments: a dropout mask). Skipped unless asked for: ``nn.Parameter``
(``include_parameters``), leaves that require grad (weights, inputs, a stage's received
activations) and leaves from outside the block (``include_leaves``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from ppbackward._gc_pause import automatic_gc_paused
from ppbackward.leaks import _gc_phase
from ppbackward.leaks._activations import (
    ALIVE,
    FREED_BY_GC,
    FREED_BY_REFCOUNT,
    UNTRACKED,
    ActivationReport,
    SavedActivation,
)
from ppbackward.leaks._chains import format_holders, holder_chain
from ppbackward.leaks._heap import instances_of
from ppbackward.leaks._node_watches import LifeWatches
from ppbackward.leaks._saved_hooks import OpMode, hooks_enabled, peek_sequence_nr, top_hooks, unpack
from ppbackward.leaks._storage import grad_fn_or_none, storage_key, tensor_storages
from ppbackward.leaks._watch import Watch, WatchMap

__all__ = ["ActivationTracker", "track_activations"]

_UNKNOWN = "<unknown>"
_NO_SEQUENCE = 2**63  # AccumulateGrad and other sequence-less nodes report UINT64_MAX


def _trackers_of(pack: Any) -> frozenset[int]:
    """Ids of the trackers a pack hook records for (empty for a user's own hook)."""
    return getattr(pack, "_ppbackward_trackers", frozenset())


@dataclass
class _Record:
    index: int
    saver: int | None  # sequence number of the node that saved it
    name: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    watches: tuple[Watch, ...]
    is_leaf: bool


_HOLDER_CHAINS = 3  # chains in ActivationReport.held_by


def _made_in_block(t: torch.Tensor, key: str) -> bool:
    """Whether ``t``'s ``grad_fn`` is a node the tracker watches (its sentinel is in the node's metadata)."""
    fn = grad_fn_or_none(t)
    if fn is None:
        return False
    try:
        return key in fn.metadata  # a property (a dict), not a method
    except (AttributeError, RuntimeError):
        return False


class ActivationTracker:
    """Records the tensors autograd saves inside a ``with`` block; see :func:`track_activations`.

    One tracker may be entered several times (e.g. once per schedule step); records accumulate
    until :meth:`clear`. It tracks the thread that entered it only (saved-tensor hooks, torch
    function modes and autograd sequence numbers are thread-local).
    """

    def __init__(self, *, include_parameters: bool = False, include_leaves: bool = False) -> None:
        for name, value in (("include_parameters", include_parameters), ("include_leaves", include_leaves)):
            if not isinstance(value, bool):  # "no" is truthy: it would record what the caller left out
                raise TypeError(f"track_activations: {name} must be a bool, got {type(value).__name__} {value!r}")
        self.include_parameters = include_parameters
        self.include_leaves = include_leaves
        self._records: list[_Record] = []
        self._watches = WatchMap()
        self._produced = WatchMap()  # storages of non-differentiable op outputs made in the block
        self._names: dict[int, str] = {}
        self._pending: dict[int, list[_Record]] = {}
        self._frames: list[list[tuple[_Record, list[Any]]]] = []  # pending leaves per running op
        # Note [leaks the gc cannot see] in _node_watches.py: the nodes created in the block, and what user pack
        # hooks returned
        self._nodes = LifeWatches(f"ppbackward.leaks.track_activations:{id(self)}")
        self._packed = LifeWatches("")
        self._seq_start: int | None = None
        self._stack: contextlib.ExitStack | None = None
        self._thread: int | None = None
        _gc_phase.ensure_watcher()  # Note [freed by gc vs refcount]

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> ActivationTracker:
        if self._stack is not None:
            raise RuntimeError("track_activations: this tracker is already active (nested re-entry)")
        if not hooks_enabled():
            raise RuntimeError(
                "track_activations: saved-tensor hooks are disabled here "
                "(torch.autograd.graph.disable_saved_tensors_hooks is active), so the tracker cannot "
                "see what autograd saves. Enter track_activations outside that region."
            )
        outer = top_hooks(False) if top_hooks is not None else None
        pack, unpack = self._compose(outer)
        if self._seq_start is None:  # first entry: nodes older than this are never named
            self._seq_start = peek_sequence_nr() if peek_sequence_nr is not None else 0
        self._thread = threading.get_ident()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            stack.enter_context(OpMode(self))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    # -- hooks -------------------------------------------------------------------------------
    def _compose(self, user: tuple[Any, Any] | None) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], Any]]:
        """A (pack, unpack) pair that records, then defers to ``user``'s pair if any.

        Each pack function is tagged with the ids of the trackers it records for, so a tracker never
        wraps a pair that already records for it (nested trackers record each tensor once each).
        """
        # Note [tracker composes with saved-tensor hooks]; Note [tracker keeps nothing alive]
        if user is None:

            def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
                self._observe(t)
                return (t.detach(), t._version)  # Note [tracker pack hook detaches]

            pack._ppbackward_trackers = frozenset({id(self)})  # type: ignore[attr-defined]
            return pack, unpack
        user_pack, user_unpack = user

        def composed_pack(t: torch.Tensor) -> Any:
            self._observe(t)
            packed = user_pack(t)
            self._packed.watch_packed(packed)  # Note [leaks the gc cannot see]
            return packed

        composed_pack._ppbackward_trackers = _trackers_of(user_pack) | {id(self)}  # type: ignore[attr-defined]
        return composed_pack, user_unpack

    @contextlib.contextmanager
    def _inner_hooks_composed(self) -> Any:
        """For one op: if the user entered saved-tensor hooks inside the block, wrap them too."""
        top = top_hooks(False) if top_hooks is not None else None
        if top is None or id(self) in _trackers_of(top[0]) or not hooks_enabled():
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(*self._compose(top)):
            yield

    # -- recording ---------------------------------------------------------------------------
    def _observe(self, t: torch.Tensor) -> None:
        """Record ``t`` (being saved by autograd right now); Note [which saved tensors are recorded]."""
        if not isinstance(t, torch.Tensor) or threading.get_ident() != self._thread:
            return
        with torch._C.DisableTorchFunction():
            base = t._base if t._is_view() and t._base is not None else t  # a view is judged by its base
            is_param = isinstance(base, torch.nn.Parameter)
            if is_param and not self.include_parameters:
                return
            is_leaf = base.grad_fn is None
            storages = tensor_storages(t)
            pending = False
            if is_leaf and not is_param and not self.include_leaves:
                if base.requires_grad:
                    return  # grads accumulate into it: an input or a weight, not an activation
                if not any(self._produced.is_alive(s) for s in storages):
                    if not self._frames:
                        return  # a leaf from outside the block (input, buffer, plain weight)
                    pending = True  # decided when the running op returns, see _after_op
            saver = peek_sequence_nr() - 1 if peek_sequence_nr is not None else None
            if t.grad_fn is not None:
                self._name_graph(t.grad_fn)
            record = _Record(
                index=-1,
                saver=saver,
                name=self._names.get(saver) if saver is not None else None,
                shape=tuple(t.shape),
                dtype=t.dtype,
                device=t.device,
                watches=tuple(self._watches.watch(s) for s in storages),
                is_leaf=is_leaf,
            )
        if pending:
            self._frames[-1].append((record, storages))
        else:
            self._add(record)

    def _add(self, record: _Record) -> None:
        record.index = len(self._records)
        self._records.append(record)
        if record.name is None and record.saver is not None:
            self._pending.setdefault(record.saver, []).append(record)

    def _after_op(self, out: Any, frame: list[tuple[_Record, list[Any]]], args: Any, kwargs: Any) -> None:
        """After one torch call: name the nodes it created, remember the leaves it produced, and keep
        the leaves it saved that are not among its arguments (made inside the op, e.g. a dropout mask).
        """
        if isinstance(out, torch.Tensor):
            outputs = [out]
        elif isinstance(out, (tuple, list)):
            outputs = [o for o in out if isinstance(o, torch.Tensor)]
        else:
            outputs = []
        with torch._C.DisableTorchFunction():
            for o in outputs:
                if o.grad_fn is not None:
                    self._name_graph(o.grad_fn)
                else:  # a non-differentiable output (mask, indices): an activation if saved later
                    for s in tensor_storages(o):
                        self._produced.watch(s)
            if not frame:
                return
            from_args = {
                storage_key(s)
                for a in tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)
                for s in tensor_storages(a)
            }
        for record, storages in frame:
            if not any(storage_key(s) in from_args for s in storages):
                self._add(record)

    def _name_graph(self, root: Any) -> None:
        """Name every node created in the block that is reachable from ``root`` and not named yet."""
        stack = [root]
        while stack:
            node = stack.pop()
            if node is None:
                continue
            seq = node._sequence_nr()
            if seq >= _NO_SEQUENCE or seq < (self._seq_start or 0) or seq in self._names:
                continue
            name = node.name()
            self._names[seq] = name
            self._nodes.watch_node(node, name)  # Note [leaks the gc cannot see]
            for record in self._pending.pop(seq, ()):
                record.name = name
            stack.extend(nxt for nxt, _ in node.next_functions)

    # -- reporting ---------------------------------------------------------------------------
    def report(self, collect: bool = True) -> ActivationReport:
        """Classify every recorded activation.

        Args:
            collect: run a full collection first (one that surely ran, even while another thread
                collects: Note [a collection that surely ran] in ``_gc_phase``), so ``held_after_gc``
                means "held by a live reference" and cycles are broken into ``freed_only_by_gc``.

        Returns:
            An :class:`ActivationReport` snapshot (keeps no tensor alive).

        Raises:
            RuntimeError: with ``collect``, when called from a finaliser or weak-reference callback of
                this thread's own collection, or when another thread's collection kept any from
                starting for 60 s.
        """
        with automatic_gc_paused(always=True):  # a consistent snapshot: no automatic collection while classifying
            if collect:
                _gc_phase.full_collect()  # Note [a collection that surely ran]
            saved = [self._snapshot(r) for r in self._records]
        by_state: dict[str, list[SavedActivation]] = {ALIVE: [], FREED_BY_GC: [], FREED_BY_REFCOUNT: []}
        watches: dict[str, dict[int, int]] = {ALIVE: {}, FREED_BY_GC: {}}
        for snap, record in zip(saved, self._records):
            if snap.state in by_state:
                by_state[snap.state].append(snap)
            if snap.state in watches:
                for w in record.watches:
                    watches[snap.state][id(w)] = w.nbytes
        held, by_gc = by_state[ALIVE], by_state[FREED_BY_GC]
        nodes, packed = self._nodes.states(), self._packed.states()
        held_by = self._held_by() if collect and any(w.state == ALIVE for w in nodes) else []
        alive = sorted(held + by_gc, key=lambda a: a.index)
        bytes_held = sum(watches[ALIVE].values())
        bytes_gc = sum(watches[FREED_BY_GC].values())
        return ActivationReport(
            saved=saved,
            alive=alive,
            freed_only_by_gc=by_gc,
            held_after_gc=held,
            freed_by_refcount=by_state[FREED_BY_REFCOUNT],
            bytes_alive=sum({**watches[ALIVE], **watches[FREED_BY_GC]}.values()),
            bytes_freed_only_by_gc=bytes_gc,
            bytes_held_after_gc=bytes_held,
            collected=collect,
            nodes=len(nodes),
            nodes_freed_only_by_gc=sum(w.state == FREED_BY_GC for w in nodes),
            nodes_held_after_gc=[w.label for w in nodes if w.state == ALIVE],
            packed=len(packed),
            packed_freed_only_by_gc=sum(w.state == FREED_BY_GC for w in packed),
            packed_held_after_gc=[w.label for w in packed if w.state == ALIVE],
            bytes_packed_held_after_gc=sum(w.nbytes for w in packed if w.state == ALIVE),
            held_by=held_by,
        )

    def _held_by(self, limit: int = _HOLDER_CHAINS) -> list[str]:
        """Chains to what holds the live tensors whose ``grad_fn`` is a node of the block (Note [holder
        chains] in ``_chains.py``): an output kept past its step holds its whole graph, saved tensors
        included. At most ``limit`` chains, in gc order."""
        key = self._nodes._key
        tensors = instances_of(torch.Tensor)  # Note [heap scans beside other threads] in _heap.py
        starts = [t for t in tensors if _made_in_block(t, key)][:limit]
        del tensors
        chains = []
        while starts:  # the search must not find this list: each start leaves it before its search
            start = starts.pop(0)
            chains.append(format_holders(holder_chain(start)))
            del start
        return chains

    def _snapshot(self, record: _Record) -> SavedActivation:
        states = {w.state for w in record.watches}
        if not states:
            state = UNTRACKED
        elif ALIVE in states:
            state = ALIVE
        elif FREED_BY_GC in states:
            state = FREED_BY_GC
        else:
            state = FREED_BY_REFCOUNT
        name = record.name or (self._names.get(record.saver) if record.saver is not None else None)
        return SavedActivation(
            index=record.index,
            node_name=name or _UNKNOWN,
            shape=record.shape,
            dtype=record.dtype,
            device=record.device,
            nbytes=sum(w.nbytes for w in record.watches),
            state=state,
            is_leaf=record.is_leaf,
        )

    @property
    def num_recorded(self) -> int:
        """How many saved tensors have been recorded so far."""
        return len(self._records)

    def clear(self) -> None:
        """Forget every record (the tracker may be reused afterwards)."""
        self._records.clear()
        self._pending.clear()
        self._names.clear()
        self._watches.clear()
        self._produced.clear()
        self._nodes.clear()
        self._packed.clear()
        if self._stack is None:
            self._seq_start = None


def track_activations(*, include_parameters: bool = False, include_leaves: bool = False) -> ActivationTracker:
    """Record every tensor autograd saves for backward inside the block, keeping none of them alive.

    Use it around a forward (or a whole schedule step), then ask :meth:`ActivationTracker.report`
    which saved activations are still alive, which were freed only by a gc collection (held by a
    reference cycle: pytorch/pytorch#136507, #136584) and which stay alive after a collection (held
    by a live reference, or by a cycle gc cannot see such as #136678's ``node.metadata``).

    What is recorded, by default: every non-leaf tensor autograd saves (activations), plus
    non-differentiable outputs of ops run in the block (dropout masks, pooling indices, comparison
    masks). Not recorded by default: ``nn.Parameter`` s (``include_parameters=True`` records them) and
    other leaves that come from outside the block -- inputs, buffers, plain-tensor weights, a pipeline
    stage's received activations (``include_leaves=True`` records them).

    Composes with the user's own saved-tensor hooks (activation checkpointing, offloading), entered
    outside or inside the block: the tracker records the tensor autograd asked to save and then calls
    the user's pack hook; see Note [tracker composes with saved-tensor hooks].

    Args:
        include_parameters: also record ``nn.Parameter`` s that autograd saves.
        include_leaves: also record every other leaf tensor that autograd saves.

    Returns:
        An :class:`ActivationTracker`; use it as a context manager, then call ``report()``.

    Raises:
        TypeError: ``include_parameters`` or ``include_leaves`` is not a bool.
        RuntimeError: on entry, where saved-tensor hooks are disabled
            (``torch.autograd.graph.disable_saved_tensors_hooks``), or when already active.

    Example::

        with track_activations() as tracker:
            loss = model(x).sum()
        loss.backward()
        del loss
        assert tracker.report().bytes_alive == 0
    """
    return ActivationTracker(include_parameters=include_parameters, include_leaves=include_leaves)
