"""A thread held inside a gc collection, for the tests of Note [a collection that surely ran] and
Note [freed by gc vs refcount] (``ppbackward.leaks._gc_phase``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ppbackward.leaks import _gc_phase


@contextmanager
def another_thread_collecting() -> Iterator[threading.Event]:
    """Another thread sits inside a gc collection (a finaliser of its garbage waits) until the event
    yielded is set; the GIL is free meanwhile."""
    inside, release = threading.Event(), threading.Event()

    class _Waits:
        def __del__(self) -> None:
            inside.set()
            release.wait()

    def _collect() -> None:
        obj = _Waits()
        obj.self = obj  # type: ignore[attr-defined]
        del obj
        _gc_phase.full_collect()  # not gc.collect(): the suite's own threads may be collecting

    thread = threading.Thread(target=_collect, daemon=True)
    thread.start()
    assert inside.wait(120), "the helper thread's collection never ran its finaliser"
    try:
        yield release
    finally:
        release.set()
        thread.join(120)
        assert not thread.is_alive()
