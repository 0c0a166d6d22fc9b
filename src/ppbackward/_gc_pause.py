"""The automatic cycle collector paused while B and W run (Note [no collection inside B and W]).

Private module.

Note [no collection inside B and W]
B's graph analysis holds a stage graph's worth of short-lived Python objects at once (a wrapper per
autograd node, its ``next_functions`` tuples, the analysis' lists and dicts; about 3,000 at 16 layers),
and W a smaller set. All of them die by reference counting before the call returns (Note [no closure
cycle] in ``ppbackward.backward``), but while they live they push the collector's allocation count
over its threshold: a 16-layer stage's B+W started 4.6 young collections per microbatch, each promoting
the live temporaries to an older generation, and so, every few dozen microbatches, a full collection
(tens of milliseconds in a process that imported torch, during which this rank, and so the pipeline,
stands still). A full backward starts none. So B and W run with the automatic collector paused and put
it back as they found it: none of their own work needs a collection, and the allocation count they
leave behind is what they keep (the param groups), about what a full backward's would be.

Shared by threads (DualPipeV's overlap runs a backward on a worker thread): a counter under a lock;
the first B or W to enter disables an enabled collector, the last to leave enables it again. Other
threads' allocations meanwhile only count; their collection runs at their first allocation after.
``gc.collect()`` is unaffected. A hook that calls ``gc.disable()`` inside B or W finds the collector
enabled again when the outermost B or W returns (docs/api.md, Differences).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__: list[str] = []  # private module

_lock = threading.RLock()  # re-entrant: a finaliser run by a collection could in principle call B
_depth = 0  # B and W calls inside the pause now, all threads together
_disabled_here = False  # whether the outermost of them disabled the collector


@contextlib.contextmanager
def automatic_gc_paused() -> Iterator[None]:
    """The automatic collector off for the block, then as it was (Note [no collection inside B and W])."""
    global _depth, _disabled_here
    with _lock:
        _depth += 1
        if _depth == 1:
            _disabled_here = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _disabled_here:
                _disabled_here = False
                gc.enable()
