"""The order of a benchmark's repeats (Note [interleaved repeats]); below the harness and the bench, which
both time variants this way (the bench in one process, the harness's schedule step under torchrun).

Private module.

Note [interleaved repeats]: on a small, shared machine the speed drifts over seconds (other processes,
frequency scaling). Each repeat therefore runs every variant once, in an order rotated by one from the
previous repeat, and each figure is the minimum over repeats: the run least disturbed by the machine.
Ratios are taken between minima of the same run. The forward is re-run before every timed backward and is
not timed; the gc is run before each repeat and disabled during it (a ``gc.collect()`` costs tens of ms in
a process that imported torch: ``ppbackward._tools.bench.timing.gc_paused``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

__all__ = ["rotations"]

_T = TypeVar("_T")


def rotations(items: tuple[_T, ...], repeats: int) -> Iterator[tuple[_T, ...]]:
    """The order of each of ``repeats`` repeats: ``items`` rotated by one more each time (Note [interleaved
    repeats])."""
    for r in range(repeats):
        k = r % len(items)
        yield items[k:] + items[:k]
