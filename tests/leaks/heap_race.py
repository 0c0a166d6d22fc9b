"""A thread building tuples beside heap scans, for ``tests/leaks/test_heap.py`` and its child script
``tests/leaks/naive_scan.py`` (Note [heap scans beside other threads] in ``ppbackward.leaks._heap``).

Standard library only (the child runs it without ppbackward or torch), and no heap scan: the naive scans that must
break the builder live in ``naive_scan.py``, which only a child process runs (Note [the naive control in a child
process] there).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Note [a race needs a long scan] (test_heap.py): the scans run over a population of this size, the heap made before
# it frozen, so that a scan lasts long enough for the interpreter to switch threads inside it.
POPULATION = 50_000


class Marker:
    """Instances of it are what the scans look for; the builder's tuples hold the class itself."""


class Builder:
    """A thread building ``tuple(generator)`` over and over, the shape ``typing.get_type_hints`` has.

    Attributes:
        error: what broke it (``SystemError`` for the race), or ``None``.
        built: tuples finished.
        scans: scans made beside it (:func:`scan_beside_builder`).
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.built = 0
        self.scans = 0
        self.finished_one = threading.Event()
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="tuple-builder", daemon=True)

    def _run(self) -> None:
        items = (Marker, int, str, Marker, float, bytes, Marker, dict, list, set, Marker, object, type)
        try:
            while not self.stop:
                tuple(c for c in items)
                self.built += 1
                self.finished_one.set()
        except BaseException as e:  # SystemError is the race (here or in Event.set's own tuples)
            self.error = e
        finally:
            self.stop = True
            self.finished_one.set()

    def next_tuple(self) -> None:
        """Wait until the builder finished another tuple (or failed)."""
        self.finished_one.clear()
        if not self.stop:
            assert self.finished_one.wait(120), "the builder thread stopped making progress"


@contextmanager
def _running_builder() -> Iterator[Builder]:
    """A :class:`Builder` running for the block, threads switched as often as CPython allows."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: the race at its most likely
    builder = Builder()
    builder.thread.start()
    try:
        yield builder
    finally:
        builder.stop = True
        builder.thread.join(120)
        sys.setswitchinterval(previous)
        assert not builder.thread.is_alive()


def scan_beside_builder(scan: Callable[[], Any], times: int) -> Builder:
    """``scan()`` up to ``times`` times, each after the builder finished another tuple (events, not time); stops at
    the builder's first failure. Returns the builder: ``error`` and ``scans`` say what happened."""
    with _running_builder() as builder:
        for _ in range(times):
            builder.next_tuple()
            if builder.error is not None:
                break
            scan()
            builder.scans += 1
    return builder
