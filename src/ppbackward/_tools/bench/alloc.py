"""The allocator's work during one backward: how many allocations, how many bytes.

Private module. ``torch.profiler`` with ``profile_memory=True`` records every allocation of the CPU
allocator (``[memory]`` events, positive sizes); this counts them around one backward of each
variant, after two unrecorded rounds, in both regimes (Note [regimes] in ``timing``). A split that
allocates what a plain backward does not (a gradient copied because something still references it,
a buffer held from B to W) shows here as extra allocations or bytes; allocations the same in number
and size but in a different order (what the allocator then has to find or map fresh) do not:
compare the timings of the regimes for that.
"""

from __future__ import annotations

from typing import Any

from ppbackward._tools.bench.impls import RUNNERS, VARIANTS, run_variant
from ppbackward._tools.bench.quiet import quiet_profiler
from ppbackward._tools.bench.timing import REGIMES, prepare_regime
from ppbackward._tools.harness.models import Stage, reset_grads

__all__ = ["measure"]  # private module: what other modules use


def _count(stage: Stage, variant: str) -> tuple[int, int]:
    """Allocations and bytes allocated during one backward of ``variant`` (its forward not counted)."""
    from torch.profiler import ProfilerActivity, profile

    out = stage.model(stage.x)
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        RUNNERS[variant](stage, out, lambda: 0.0)
    del out
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    grown = [b for b in sizes if b > 0]
    return len(grown), sum(grown)


def measure(stage: Stage) -> dict[str, Any]:
    """``{regime: {variant: {"allocations": n, "bytes": b}}}`` for one backward of each variant
    (regimes: Note [regimes] in ``timing``)."""
    result: dict[str, Any] = {}
    for regime in REGIMES:
        rows = {}
        for variant in VARIANTS:
            for _ in range(2):  # unrecorded: first-call allocations
                prepare_regime(stage, regime)
                run_variant(variant, stage)
            prepare_regime(stage, regime)
            n, nbytes = _count(stage, variant)
            rows[variant] = {"allocations": n, "bytes": nbytes}
        result[regime] = rows
    reset_grads(stage)
    return result
