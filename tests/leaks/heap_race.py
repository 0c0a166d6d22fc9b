"""A thread building tuples beside heap scans, for ``test_heap.py`` (Note [heap scans beside other threads] in
``ppbackward.leaks._heap``); run as a script, the naive scan that must break it, in a process of its own.

Standard library only: the script runs in a fresh interpreter, without ppbackward or torch.

Note [the naive control in a child process]
The negative control of the race is a naive scan that keeps ``gc.get_objects()``'s list alive while Python runs,
at the smallest switch interval. It breaks *every* thread of its process that is inside ``tuple(generator)`` at
that moment, not only the builder it is aimed at. In the suite's pytest process one such thread is the launches'
background thread (Note [launches prefetched] in ``tests/multiproc/conftest.py``), which decodes the ranks' records
twice a second (``typing.get_type_hints``, ``tuple(...)``): twice in CI (at 94e21d8 and 05f11d7) the control
broke it, and the 48 tests reading that launch failed with ``SystemError: Objects/tupleobject.c:927: bad argument
to internal function``. Reproduced by hand: a thread decoding ``Failure`` records beside the control failed within
3 scans. So the control runs here, in a child whose only other thread is its builder; the scans of
``ppbackward.leaks``, which are safe beside any thread, still run in the test's process.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Note [a race needs a long scan] (test_heap.py): the naive scans run over a population of this size, the heap
# made before it frozen, so that a scan lasts long enough for the interpreter to switch threads inside it.
POPULATION = 50_000
NAIVE_SCANS = 20_000  # at most, before the naive scan is declared harmless


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
def running_builder() -> Iterator[Builder]:
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
    with running_builder() as builder:
        for _ in range(times):
            builder.next_tuple()
            if builder.error is not None:
                break
            scan()
            builder.scans += 1
    return builder


def _naive_get_objects() -> None:
    for obj in gc.get_objects():  # the list alive while the loop runs bytecode: the hazard
        if type(obj) is Marker:
            pass


def _naive_get_referrers() -> None:
    for obj in gc.get_referrers(Marker):
        if isinstance(obj, tuple):
            pass


NAIVE_SCANS_BY_NAME = {"get_objects": _naive_get_objects, "get_referrers": _naive_get_referrers}


def _main(name: str) -> None:
    """Run the naive scan ``name`` beside a builder in this process; print ``{"error", "message", "scans"}``."""
    gc.collect()
    gc.freeze()
    population = [[i] for i in range(POPULATION)]
    builder = scan_beside_builder(NAIVE_SCANS_BY_NAME[name], NAIVE_SCANS)
    error = builder.error
    print(json.dumps({
        "error": None if error is None else type(error).__name__,
        "message": "" if error is None else str(error),
        "scans": builder.scans,
        "population": len(population),
    }))


if __name__ == "__main__":
    _main(sys.argv[1])
