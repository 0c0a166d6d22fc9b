"""The race's negative control, for a child process only: ``python -m tests.leaks.naive_scan get_objects`` (or
``get_referrers``), from the repository's root, runs that naive heap scan beside a tuple builder
(``tests/leaks/heap_race.py``) and prints one JSON line, ``{"error": "SystemError", "message":
"Objects/tupleobject.c:927: bad argument to internal function", "scans": 3, "population": 50000}`` (``error`` null
when the builder survived ``NAIVE_SCANS`` scans). Standard library only. Never imported by the suite
(``test_heap.py`` refuses an import of it).

Note [the naive control in a child process]
The negative control of the race is a naive scan that keeps the collector's list alive while Python runs, at the
smallest switch interval. ``gc.get_objects()``'s list holds every tracked object, so that scan breaks *every*
thread of its process that is inside ``tuple(generator)`` at that moment, not only the builder it is aimed at. In
the suite's pytest process one such thread is the launches' background thread (Note [launches prefetched] in
``tests/multiproc/conftest.py``), which decodes the ranks' records twice a second (``typing.get_type_hints``,
``tuple(...)``): twice in CI (the landing run of 05f11d7, the ``.ci/run`` at 94e21d8) the control broke it, and the 48
tests reading that launch failed with ``SystemError: Objects/tupleobject.c:927: bad argument to internal function``.
Reproduced by hand: a thread decoding ``Failure`` records beside the control failed within 3 scans. So the control
runs here, in a child whose only other thread is its builder; the scans of ``ppbackward.leaks``, safe beside any
thread, still run in the test's process. ``gc.get_referrers(Marker)``'s list holds only tuples that contain
``Marker``, which no other thread builds: that control runs here too, for symmetry, not for safety.
"""

from __future__ import annotations

import gc
import json
import sys

from tests.leaks.heap_race import POPULATION, Marker, scan_beside_builder

NAIVE_SCANS = 20_000  # at most, before the naive scan is declared harmless


def _naive_get_objects() -> None:
    for obj in gc.get_objects():  # the list alive while the loop runs bytecode: the hazard
        if type(obj) is Marker:
            pass


def _naive_get_referrers() -> None:
    for obj in gc.get_referrers(Marker):
        if isinstance(obj, tuple):
            pass


_SCANS = {"get_objects": _naive_get_objects, "get_referrers": _naive_get_referrers}


def _main(name: str) -> None:
    """Run the naive scan ``name`` beside a builder in this process, over ``POPULATION`` objects made after the heap
    was frozen; print ``{"error", "message", "scans", "population"}`` as one JSON line."""
    gc.collect()
    gc.freeze()
    population = [[i] for i in range(POPULATION)]
    builder = scan_beside_builder(_SCANS[name], NAIVE_SCANS)
    error = builder.error
    print(json.dumps({
        "error": None if error is None else type(error).__name__,
        "message": "" if error is None else str(error),
        "scans": builder.scans,
        "population": len(population),
    }))


if __name__ == "__main__":
    _main(sys.argv[1])
