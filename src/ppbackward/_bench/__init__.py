"""``ppbackward bench``: the stage-backward benchmark of issue 6 (time and memory, upstream vs ours).

Private package of measurements; the command (options, validation, the run) is ``ppbackward._cli.bench``,
whose :func:`main` this package re-exports (``ppbackward bench``, ``python -m ppbackward._bench`` and
``benchmarks/bench_backward.py`` all call it). Modules:
``_models`` (configurations), ``_impls`` (the variants timed), ``_timing`` (interleaved min-of-N),
``_memory`` (saved activations held between B and W against what W reads), ``_loop`` (one stage
pair's microbatch loop in a zero-bubble schedule's order), ``_alloc`` (the allocator's work),
``_scaling`` (graph analysis time against graph size), ``_profile`` (where the time of B and W goes),
``_schedule`` and ``_schedule_worker`` (schedule steps under torchrun), ``_split`` and ``_replay`` (the
split's cost per microbatch-stage, and a schedule step replayed from it: ``--split``), ``_report`` (targets, tables,
JSON). Method and results: ``docs/performance.md``.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``ppbackward bench``: see :func:`ppbackward._cli.bench.main`."""
    from ppbackward._cli.bench import main as bench_main

    return bench_main(argv)

