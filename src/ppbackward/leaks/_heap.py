"""Heap scans that never hand another thread's half-built tuple to Python (Note [heap scans beside
other threads]).

Private module: :func:`instances_of` (every live object of a class) and :func:`referrers_of` (what refers
to an object), the only two heap scans of ``ppbackward.leaks``.

Note [heap scans beside other threads]
``gc.get_objects()`` and ``gc.get_referrers()`` return every object the collector tracks, and CPython
tracks a tuple from the moment it is allocated, before its items are set. ``tuple(x for x in it)`` fills
one while the generator runs Python code, in which the interpreter may switch threads, and grows it with
``_PyTuple_Resize``, which refuses a tuple anything else holds a reference to: ``SystemError:
Objects/tupleobject.c: bad argument to internal function`` (CPython gh-59313, gh-101855; in
``PyTuple_SetItem`` too). So a scan whose list is alive while another thread runs makes *that* thread
fail: its data loader, its logger, a test suite's background thread. Reproduced with the standard
library alone on CPython 3.9, 3.10, 3.11, 3.12 and 3.13 (``python -m tests.leaks.naive_scan get_objects``);
no released CPython we know of tracks tuples only once complete (3.14 and later not tried here). Two rules:

1. A scan is one C-level call. ``gc.get_objects`` / ``gc.get_referrers`` are called by ``itertools``
   inside the call that filters their list, and the list is dropped before that call returns. The
   interpreter switches threads only between bytecodes or where C code releases the GIL, and nothing in
   these pipelines does either: ``type``, ``issubclass`` (of a class whose metaclass is not a Python
   ``__subclasscheck__``: refused), ``len``, ``operator`` functions, ``itertools``. A collection could run
   Python finalizers, so the automatic collector is paused for the call. Each object is read twice in a
   row from one iterator (``_each_twice``), once as data and once by the selector, so ``compress`` keeps
   it by a test on its type; not ``itertools.tee``, whose exhausted buffer still holds the last objects
   read after the call (the scan built on it failed the reproducer).
2. What comes out holds no tuple that may be half-built. :func:`instances_of` refuses classes a tuple
   can belong to. :func:`referrers_of` keeps a tuple only when an object the collector sees, besides the
   scan's own containers, refers to it: a tuple being built is referred to by its builder's C variable
   alone. The scan's own references are counted once per process on a probe tuple with exactly one
   holder (``_tuple_threshold``).

Lists and dicts that CPython itself builds are complete whenever Python code can run, so only tuples
need rule 2 (a C extension that fills a ``PyList_New(n)`` while calling back into Python could expose
one with empty slots: not guarded).

Known limits: an audit hook (``sys.addaudithook``) runs Python code at each ``gc.get_referrers`` call
of rule 2's check, while the scan holds the referrers; a hook that lets another thread run reopens the
window. So does an exception raised inside the pipeline (``MemoryError``) while its traceback holds the
list. A tuple held only by a running function's local variable looks, to the collector, like one being
built (its frame is no container while it runs, from Python 3.11 on), so it is left out.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from functools import partial
from itertools import chain, compress, islice, repeat, starmap
from operator import ge, is_not, not_
from typing import Any

from ppbackward._gc_pause import automatic_gc_paused

__all__ = ["instances_of", "referrers_of"]  # private module: what other modules use

_threshold: int | None = None  # len(gc.get_referrers(t)) inside referrers_of for a tuple with one holder


def _each_twice(items: Iterable[Any]) -> Iterator[Any]:
    """``a, a, b, b, ...``: one stream a ``compress`` reads as data and as its selector's input."""
    return chain.from_iterable(map(repeat, items, repeat(2)))


def instances_of(cls: type) -> list[Any]:
    """Every live object the collector tracks whose type is ``cls`` or a subclass of it, found in one
    C-level pass (Note [heap scans beside other threads]).

    Args:
        cls: a class whose metaclass keeps ``type.__subclasscheck__`` (``torch.Tensor``, a function
            type, an autograd node's type), and that no tuple can be an instance of.

    Returns:
        The objects, in the collector's order (youngest generation first).

    Raises:
        TypeError: for ``cls`` an ABC or another class with a Python ``__subclasscheck__``, or a class
            a tuple can be an instance of (``object``, ``tuple``, a named tuple).
    """
    if not isinstance(cls, type) or type(cls).__subclasscheck__ is not type.__subclasscheck__:
        raise TypeError(f"instances_of({cls!r}): a class whose metaclass keeps type.__subclasscheck__ is needed")
    if issubclass(tuple, cls) or issubclass(cls, tuple):
        raise TypeError(f"instances_of({cls.__name__}): tuples are never handed out (a half-built one would break)")
    objects = _each_twice(chain.from_iterable(starmap(gc.get_objects, ((),))))
    with automatic_gc_paused(always=True):
        return list(compress(objects, map(issubclass, map(type, objects), repeat(cls))))


def referrers_of(obj: Any) -> list[Any]:
    """``gc.get_referrers(obj)`` without the tuples no other object refers to (Note [heap scans beside
    other threads]): those may be under construction in another thread, or in the caller's own
    ``tuple(generator)``.

    Args:
        obj: any object; its referrers are looked up, nothing is called on it.

    Returns:
        The referrers, non-tuples first; a fresh list nothing else refers to. At most
        ``_TUPLES_CHECKED`` tuples are checked (each check is a heap scan); further tuples are left out.

    Raises:
        RuntimeError: when the scan cannot measure its own references once per process (then no tuple
            could be handed out safely); the next call measures again.
    """
    return _referrers(obj, _tuple_threshold())


_TUPLES_CHECKED = 8  # tuples among one object's referrers that are checked for a holder (a heap scan each)


def _referrers(obj: Any, threshold: int) -> list[Any]:
    """The one C-level pass of :func:`referrers_of`: tuples kept when ``len(gc.get_referrers(t))``, the
    scan's own containers included, is at least ``threshold``; the candidates after the first
    ``_TUPLES_CHECKED`` are read to the end into ``sink`` and dropped, so no iterator left behind holds one."""
    box: list[Any] = []  # the referrers, inside the call only: emptied by its last steps
    sink: list[Any] = []  # the unchecked rest, likewise
    fill = starmap(box.extend, ((chain.from_iterable(starmap(gc.get_referrers, ((obj,),))),),))
    firsts = _each_twice(iter(box))
    others = compress(firsts, map(not_, map(issubclass, map(type, firsts), repeat(tuple))))
    seconds = _each_twice(iter(box))
    candidates = islice(compress(seconds, map(issubclass, map(type, seconds), repeat(tuple))), _TUPLES_CHECKED)
    tuples = _each_twice(candidates)
    held = compress(tuples, map(ge, map(len, map(gc.get_referrers, tuples)), repeat(threshold)))
    rest = starmap(sink.extend, ((seconds,),))
    empty = starmap(box.clear, ((),))
    empty_sink = starmap(sink.clear, ((),))
    with automatic_gc_paused(always=True):
        return list(filter(partial(is_not, None), chain(fill, others, held, rest, empty, empty_sink)))


def _tuple_threshold() -> int:
    """How many referrers a tuple with exactly one holder shows inside :func:`_referrers` (the scan's own
    containers and the holder), measured once per process on a probe, the collector paused throughout: a
    tuple with fewer has no holder the collector sees. The probe holds a list, which the collector never
    untracks (it untracks a tuple of untracked items), and every threshold up to the measured one must
    keep it, or nothing is cached and :class:`RuntimeError` says so."""
    global _threshold
    if _threshold is None:
        marker: list[Any] = []
        holder = [(marker,)]  # the probe tuple's one holder; no Python variable refers to the tuple
        with automatic_gc_paused(always=True):
            kept = [n for n in range(1, 16) if any(type(r) is tuple for r in _referrers(marker, n))]
        del holder
        if len(kept) < 2 or kept != list(range(1, len(kept) + 1)):
            raise RuntimeError(
                f"ppbackward.leaks: the referrer scan could not measure its own references (kept at {kept}); "
                "no tuple is handed out"
            )
        _threshold = kept[-1]
    return _threshold
