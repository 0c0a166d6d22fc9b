"""The tensor-leak checker: :func:`check_tensor_leaks`.

Public name (re-exported by ``ppbackward.leaks``): ``check_tensor_leaks``.

Anchor: torch's test helper ``check_leaked_tensors`` (``torch/testing/_internal/common_utils.py``,
first shipped in torch 2.6 with the fixes for pytorch/pytorch#136507 and #136584). This checker keeps
its idea (collect, ``gc.DEBUG_SAVEALL``, run, collect, inspect ``gc.garbage``) and fixes its faults:
it clears what it caught, counts autograd nodes as well as tensors, restores the gc state it found,
raises instead of warning, and writes graph files into a temporary folder, never the working directory.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import threading
import types
import weakref
from typing import Any, Callable

import torch

from ppbackward._gc_pause import automatic_gc_paused, collector_enabled, fork_generation, restore_collector
from ppbackward._saved import saved_tensors
from ppbackward.leaks._chains import find_chain, format_chain, referrer_index, write_graph
from ppbackward.leaks._gc_phase import full_collect
from ppbackward.leaks._report import LeakReport, TensorLeakError
from ppbackward.leaks._storage import grad_fn_or_none, unique_storage_bytes

__all__ = ["check_tensor_leaks"]

_PROXY_TYPES = (weakref.ProxyType, weakref.CallableProxyType)

# Note [checker clears gc.garbage]
# With gc.DEBUG_SAVEALL every object the collector finds unreachable is appended to gc.garbage
# instead of being freed, which keeps it (and every tensor storage it pins) alive for the rest of the
# process. torch's helper never removes them, so a later, clean block reports the old leak again and
# the memory is never returned. Here the objects appended during the block (gc.garbage[start:]) are
# moved out on exit, the debug flags restored, the analysis run on that private list, the list
# emptied, and one more collection frees the cycles. The report keeps only numbers and strings.
# Entries that were in gc.garbage before the block are left alone. (Nested checkers: the inner one
# reports its own block; an outer DEBUG_SAVEALL re-captures the inner garbage when it is freed, so the
# outer block reports it too.)

# Note [checker restores gc state]
# The previous debug flags and enabled/disabled state are restored in a ``finally`` on every exit
# path, including a body that raised and a failure inside the analysis itself. The debug flags are one
# process-wide setting that every armed checker needs ``gc.DEBUG_SAVEALL`` in, so the checkers share it
# (Note [armed checkers share the debug flags]).

# Note [armed checkers share the debug flags]
# Checkers can be armed at overlapping times in two threads, or exited out of the order they were entered
# (``__enter__``/``__exit__`` called by hand). Each restoring the flags it found on entry then left
# ``DEBUG_SAVEALL`` on for good where the second to enter found the first one's flags and left last: every
# later cycle of the process kept in ``gc.garbage``. So a count of armed checkers, under a lock, decides: the
# first to arm records the flags it found and sets ``DEBUG_SAVEALL``; the others keep it set; the last to
# disarm puts back the flags the first found. So a nested checker's exit leaves ``DEBUG_SAVEALL`` on, with
# whatever else its block set, until the outermost one exits; and a checker exits once (a second ``__exit__``
# is refused: it would take another checker's share).
_FLAGS_LOCK = threading.Lock()
_armed_checkers = 0
_flags_before = 0
_garbage_before = 0  # len(gc.garbage) when the first armed checker armed


def _arm_debug_flags() -> int:
    """Count one more armed checker and set ``gc.DEBUG_SAVEALL`` (Note [armed checkers share the debug flags]).

    Returns:
        The fork generation it armed in, for :func:`_disarm_debug_flags`.
    """
    global _armed_checkers, _flags_before, _garbage_before
    with _FLAGS_LOCK:
        flags = gc.get_debug()
        if _armed_checkers == 0:
            _flags_before = flags
            _garbage_before = len(gc.garbage)
        _armed_checkers += 1
        gc.set_debug(flags | gc.DEBUG_SAVEALL)
        return fork_generation()


def _disarm_debug_flags(generation: int) -> None:
    """Count one armed checker less; the last one puts back the flags the first found (Note [armed checkers
    share the debug flags]). ``generation``: what :func:`_arm_debug_flags` returned."""
    global _armed_checkers
    with _FLAGS_LOCK:
        if generation != fork_generation():  # armed before a fork (Note [a fork inside a checker])
            return
        _armed_checkers -= 1
        if _armed_checkers == 0:
            gc.set_debug(_flags_before)
        else:
            gc.set_debug(gc.get_debug() | gc.DEBUG_SAVEALL)  # the block may have cleared it (_SaveAll's Note)


# Note [a fork inside a checker]: a process forked while checkers are armed (a ``multiprocessing`` or
# ``DataLoader`` worker started inside the block) inherits ``gc.DEBUG_SAVEALL``, the checkers' ``_SaveAll``
# callbacks that put it back at every collection, and what they saved in ``gc.garbage``; a worker never leaves the
# block, so every cycle it made stayed in ``gc.garbage`` for its whole life. So the child disarms them all: the
# flags the first checker found, no ``_SaveAll`` callback, ``gc.garbage`` cut back to its length before the first
# checker armed (by the exit's rule: all of it if the block emptied it), no armed checker counted (a checker
# armed before the fork, in an earlier ``fork_generation()`` of the gc pause's, disarms nothing when it exits in
# the child; it was disarmed, so it reports nothing of the child's garbage), a new lock, held across the fork
# itself so that the child never copies an update half made by another thread. The gc pause's own fork handler
# (registered first, so it runs first in the child) switches the collector back on and starts the new generation
# (Note [a fork inside a pause] in ``ppbackward._gc_pause``).
def _after_fork_in_child() -> None:
    global _FLAGS_LOCK, _armed_checkers
    _FLAGS_LOCK = threading.Lock()
    if _armed_checkers == 0:
        return
    _armed_checkers = 0
    gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, _SaveAll)]
    gc.set_debug(_flags_before)
    del gc.garbage[_garbage_before if len(gc.garbage) >= _garbage_before else 0 :]


# Note [checker survives the block's gc flags]
# The block may change the gc's debug flags itself (``gc.set_debug(0)``, a library saving and restoring
# them): without ``gc.DEBUG_SAVEALL`` a collection frees the leaked cycles instead of saving them, and the
# checker would report ``ok`` for a leak. So while armed, a ``gc.callbacks`` entry puts ``DEBUG_SAVEALL``
# back at the start of every collection (automatic or explicit; the collector reads the flags after its
# callbacks) and restores the block's own flags when the collection stops. When the last armed checker
# exits, the caller's flags from before the first one are restored (Note [checker restores gc state]).


# Note [one collection decides]
# With gc.DEBUG_SAVEALL a collection saves the objects it finds unreachable *then*. One started in the middle
# of the block (the automatic collector's) could find a leaky cycle while a tensor it holds was still alive
# elsewhere (W still using a gradient a leaky capture boxed): it saved the cycle without that tensor, which
# stayed alive through gc.garbage afterwards and was never in garbage itself, so the block reported no tensor
# for a real leak, depending on when a collection happened to start. So while armed the checker pauses the
# automatic collector (through ppbackward._gc_pause's counter, shared with B and W, with ``always=True``): the
# collection on exit is the one that decides, and every tensor a cycle holds then is garbage with it. A
# ``gc.collect()`` the block itself calls still collects then (what it saves is reported, as is another
# thread's collection's: docs/leak-hunting.md). The pause holds across nesting: an inner checker's exit, or a
# tracker's report inside the block, puts the switch back through ``restore_collector``, which leaves the
# collector off while the outer pause is held.


class _SaveAll:
    """The ``gc.callbacks`` entry of one armed checker (Note [checker survives the block's gc flags])."""

    __slots__ = ("added",)

    def __init__(self) -> None:
        self.added = False

    def __call__(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            flags = gc.get_debug()
            self.added = not flags & gc.DEBUG_SAVEALL
            if self.added:
                gc.set_debug(flags | gc.DEBUG_SAVEALL)
        elif self.added:
            gc.set_debug(gc.get_debug() & ~gc.DEBUG_SAVEALL)
            self.added = False


class _TensorLeakCheck:
    """Context manager behind :func:`check_tensor_leaks` (see there)."""

    def __init__(
        self,
        strict: bool,
        warmup: Callable[[], object] | None,
        max_chains: int,
        max_depth: int,
        output_dir: str | os.PathLike[str] | None,
    ) -> None:
        if not isinstance(strict, bool):  # "no" is truthy: a strict checker where the caller asked for none
            raise TypeError(f"check_tensor_leaks: strict must be a bool, got {type(strict).__name__} {strict!r}")
        for name, value in (("max_chains", max_chains), ("max_depth", max_depth)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"check_tensor_leaks: {name} must be an int, got {type(value).__name__} {value!r}")
        if max_chains < 0:
            raise ValueError(f"check_tensor_leaks: max_chains must be >= 0, got {max_chains}")
        if max_depth < 1:
            raise ValueError(f"check_tensor_leaks: max_depth must be >= 1, got {max_depth}")
        if warmup is not None and not callable(warmup):
            raise TypeError(f"check_tensor_leaks: warmup must be a callable or None, got {type(warmup).__name__}")
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
            raise TypeError(
                f"check_tensor_leaks: output_dir must be a str, an os.PathLike or None, got {type(output_dir).__name__}"
            )
        folder = None if output_dir is None else os.fspath(output_dir)
        if not isinstance(folder, (str, type(None))):  # a PathLike of bytes
            raise TypeError(f"check_tensor_leaks: output_dir must name a folder as a str, got {folder!r}")
        if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
            raise ValueError(f"check_tensor_leaks: output_dir {folder!r} exists and is not a folder")
        self.report = LeakReport()
        self._strict = strict
        self._warmup = warmup
        self._warmed = False  # run_warmup() ran it for the next entry
        self._flags_generation = 0  # the fork generation it armed in (Note [a fork inside a checker])
        self._report_fresh = True  # self.report is neither filled nor half-filled by a block yet
        self._max_chains = max_chains
        self._max_depth = max_depth
        self._output_dir = folder
        self._armed = False
        self._start = 0
        self._prev_enabled = True
        self._save_all = _SaveAll()
        # the automatic collector's pause while armed (Note [one collection decides])
        self._paused: contextlib.AbstractContextManager[None] | None = None

    def fresh_report(self) -> LeakReport:
        """The report the next block fills: the current one if no block used it yet, else a new one."""
        if not self._report_fresh:
            self.report = LeakReport()
            self._report_fresh = True
        return self.report

    def run_warmup(self) -> None:
        """Run the ``warmup`` callable now instead of at the next entry (the pytest plugin runs it before it enters
        an activation tracker, so that a one-time cache is not an activation held either).

        Raises:
            RuntimeError: the checker is armed (the warmup would run inside the checked block).
        """
        if self._armed:
            raise RuntimeError("check_tensor_leaks: run_warmup() inside the checked block; call it before entering")
        if self._warmup is not None:
            self._warmup()
        self._warmed = True

    def __enter__(self) -> LeakReport:
        if self._armed:
            raise RuntimeError("check_tensor_leaks: this checker is already active; create a new one per block")
        self.fresh_report()  # a checker entered again reports on the new block only; an unused report is the one
        self._report_fresh = False  # filled (what the pytest fixture handed out before the call)
        if not self._warmed:
            self.run_warmup()  # before arming: one-time lazy imports and caches are not leaks
        self._warmed = False  # the next entry runs it again
        self._prev_enabled = collector_enabled()  # not gc.isenabled(): a B on another thread may pause it
        paused = automatic_gc_paused(always=True)
        paused.__enter__()  # Note [one collection decides]
        armed = False
        try:
            full_collect()  # Note [a collection that surely ran] in _gc_phase.py
            self._start = len(gc.garbage)
            self._flags_generation = _arm_debug_flags()  # Note [armed checkers share the debug flags]
            armed = True
            gc.callbacks.append(self._save_all)  # Note [checker survives the block's gc flags]
        except BaseException:  # not armed: nothing of it left behind
            if self._save_all in gc.callbacks:
                gc.callbacks.remove(self._save_all)
            if armed:
                _disarm_debug_flags(self._flags_generation)
            paused.__exit__(None, None, None)
            raise
        self._paused = paused
        self._armed = True
        return self.report

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if not self._armed:  # a second exit would take another checker's share of the flags
            raise RuntimeError("check_tensor_leaks: this checker is not active (never entered, or exited already)")
        self._armed = False
        caught: list[Any] = []
        no_collection: RuntimeError | None = None
        try:
            paused, self._paused = self._paused, None
            if paused is not None:
                paused.__exit__(None, None, None)  # the collector as the pause found it, before the one collection
            try:
                full_collect()  # Note [a collection that surely ran] in _gc_phase.py
            except RuntimeError as e:  # none could start: the garbage is unknown, so nothing is reported
                no_collection = e
            # Note [checker clears gc.garbage]: take what the block added, and only that.
            start = self._start if len(gc.garbage) >= self._start else 0
            caught = gc.garbage[start:]
            del gc.garbage[start:]
        finally:
            # Note [checker restores gc state]
            if self._save_all in gc.callbacks:
                gc.callbacks.remove(self._save_all)
            _disarm_debug_flags(self._flags_generation)  # Note [armed checkers share the debug flags]
            restore_collector(self._prev_enabled)  # an outer checker's pause, if any, holds on
        caught_any = bool(caught)
        try:
            if no_collection is None:
                self._fill(caught)
        except Exception as failure:
            if exc is None:
                raise
            if hasattr(exc, "add_note"):  # Python >= 3.11; never mask the body's own exception
                exc.add_note(f"check_tensor_leaks: no report: {type(failure).__name__}: {failure}")
            return None
        finally:
            caught.clear()
            del caught
            if caught_any:
                gc.collect()  # frees the cycles we took out of gc.garbage (a later one would too)
        if no_collection is not None:
            if exc is not None:
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"check_tensor_leaks: no report: {no_collection}")
                return None  # never mask the body's own exception
            raise RuntimeError(f"check_tensor_leaks: no report: {no_collection}") from no_collection
        self.report.done = True
        self.report.body_raised = exc_type is not None
        if self.report.ok:
            return None
        if exc is not None:
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(self.report.format())
            return None  # never mask the body's own exception
        if self._strict:
            raise TensorLeakError(self.report)
        return None

    def _fill(self, caught: list[Any]) -> None:
        """Count and describe ``caught`` into ``self.report``; keeps no reference to any of it."""
        report = self.report
        # a weakref proxy answers isinstance() for its referent, and raises once that is gone
        objects = [o for o in caught if type(o) not in _PROXY_TYPES]
        # by type, not isinstance: a mock with a tensor's spec answers isinstance() for Tensor (its own
        # parent/child cycle is no tensor leak)
        tensors = [o for o in objects if issubclass(type(o), torch.Tensor)]
        nodes = [o for o in objects if issubclass(type(o), torch.autograd.graph.Node)]
        del objects
        report.num_garbage = len(caught)
        types_count: dict[str, int] = {}
        for o in caught:
            name = type(o).__name__
            types_count[name] = types_count.get(name, 0) + 1
        report.garbage_types = types_count
        report.num_tensors = len(tensors)
        report.num_nodes = len(nodes)
        saved_by_nodes = [t for n in nodes for t in saved_tensors(n, unpack=False)]
        # a subclass's __torch_function__ would answer ``t.layout`` and the storage reads (and may return
        # NotImplemented or raise): the bytes are the tensors' own, as the chains' descriptions read them
        with torch._C.DisableTorchFunctionSubclass():
            report.num_storages, report.tensor_bytes = unique_storage_bytes(tensors + saved_by_nodes)
        del saved_by_nodes
        # chains for the tensors that hold a graph first (what keeps activations alive), in gc order
        tensors.sort(key=lambda t: grad_fn_or_none(t) is None)
        leaked = (tensors + nodes)[: self._max_chains]
        if not leaked:
            return
        index = referrer_index(caught)
        folder: str | None = None
        try:
            folder = self._output_dir or tempfile.mkdtemp(prefix="ppbackward-leaks-")
            os.makedirs(folder, exist_ok=True)
        except OSError as e:  # the chains are the report; the graph files are its pictures
            report.graph_error = f"{folder or 'a temporary folder'}: {e}"
            folder = None
        for i, obj in enumerate(leaked, 1):
            chain, back_to = find_chain(obj, index, self._max_depth)
            report.chains.append(format_chain(chain, back_to))
            if folder is not None and report.graph_error is None:  # none after a file that could not be written
                dot_path = os.path.join(folder, f"leak-{i}.dot")
                try:
                    png = write_graph(chain, dot_path)
                except OSError as e:
                    report.graph_error = f"{dot_path}: {e}"
                    with contextlib.suppress(OSError):  # a file half written is no graph
                        if os.path.isfile(dot_path):
                            os.remove(dot_path)
                else:
                    report.dot_paths.append(dot_path)
                    if png is not None:
                        report.png_paths.append(png)
            del chain
        index.clear()
        if folder is not None and not report.dot_paths and self._output_dir is None:  # leave no empty folder
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        report.output_dir = folder if report.dot_paths else None


def check_tensor_leaks(
    strict: bool = True,
    warmup: Callable[[], object] | None = None,
    max_chains: int = 3,
    *,
    max_depth: int = 20,
    output_dir: str | os.PathLike[str] | None = None,
) -> _TensorLeakCheck:
    """Check that a block leaves no tensor and no autograd node in a reference cycle.

    On entry: runs ``warmup`` (if any), collects, then sets ``gc.DEBUG_SAVEALL`` so the collector
    keeps what it finds. On exit: collects and reports every ``torch.Tensor`` and every
    ``torch.autograd.graph.Node`` in the garbage the block produced, with the bytes of the unique
    storages they pin and a back-reference chain (plus a ``.dot`` file, and a PNG when graphviz's
    ``dot`` exists) for the first ``max_chains`` of them. It then removes what it caught from
    ``gc.garbage``, frees it, and restores the previous gc debug flags and enabled state -- always,
    even when the body raised. A clean block after a leaky one therefore reports 0.

    Mirrors torch's test helper ``check_leaked_tensors`` and fixes its faults: that helper never
    clears ``gc.garbage``, counts only Python tensors (a cycle through autograd nodes that pins saved
    activations reports 0, see pytorch/pytorch#136584 and #136678), only warns, and writes pictures
    into the working directory. Retention by *live* references is not a cycle and is not reported
    here; use :func:`track_activations` for that.

    Args:
        strict: raise :class:`TensorLeakError` on exit when a tensor or a node leaked. With
            ``False`` the filled report is only returned. Never raised over an exception of the body
            (the report is then attached to that exception as a note on Python >= 3.11).
        warmup: optional callable run once before arming, so one-time lazy imports, caches and
            first-call initialisation are not reported.
        max_chains: how many leaked objects (tensors first, those with a ``grad_fn`` before the others,
            then nodes) get a chain and a graph file.
        max_depth: longest back-reference chain searched, in references.
        output_dir: folder for the graph files; default: a fresh ``tempfile.mkdtemp()`` folder,
            created only when something leaked. Never the working directory. Where it cannot be made
            or written, the report keeps its chains and says why in ``graph_error``.

    Returns:
        A context manager whose ``__enter__`` returns the :class:`LeakReport`, filled on exit.

    Raises:
        TensorLeakError: on exit, when ``strict`` and anything leaked (``error.report`` has the report).
        ValueError: for ``max_chains < 0`` or ``max_depth < 1``, or an ``output_dir`` that exists and is
            not a folder.
        TypeError: when ``strict`` is not a bool, ``max_chains`` or ``max_depth`` not an int, ``warmup``
            neither ``None`` nor callable, or ``output_dir`` neither ``None``, a ``str`` nor an ``os.PathLike``.
        RuntimeError: the checker entered while it is active, or exited when it is not; or, on entry or
            exit, no full collection could start (called from a finaliser of this thread's own collection,
            or another thread's collection never ended for 60 s: Note [a collection that surely ran] in
            ``_gc_phase``). On exit the report then stays not ``done``, the gc state is restored all the
            same, and a body that raised keeps its own exception (with a note).

    Example::

        with check_tensor_leaks() as report:
            loss = model(x).sum()
            loss.backward()
        assert report.ok and report.num_tensors == 0
    """
    return _TensorLeakCheck(strict, warmup, max_chains, max_depth, output_dir)


if hasattr(os, "register_at_fork"):  # POSIX; looked up at each fork, so a test can take it out
    os.register_at_fork(
        before=lambda: _FLAGS_LOCK.acquire(),
        after_in_parent=lambda: _FLAGS_LOCK.release(),
        after_in_child=lambda: _after_fork_in_child(),
    )
