"""``ppbackward bench``: the stage-backward benchmark of issue 6 (time and memory, upstream vs ours).

Private package of measurements; the command (options, validation, the run) is ``ppbackward._tools.cli.bench``,
whose :func:`main` this package re-exports (``ppbackward bench``, ``python -m ppbackward._tools.bench`` and
``benchmarks/bench_backward.py`` all call it). Modules:
``models`` (configurations), ``impls`` (the variants timed), ``timing`` (interleaved min-of-N),
``memory`` (saved activations held between B and W against what W reads), ``loop`` (one stage
pair's microbatch loop in a zero-bubble schedule's order), ``alloc`` (the allocator's work),
``scaling`` (graph analysis time against graph size), ``profile`` (where the time of B and W goes),
(schedule steps under torchrun: ``ppbackward._tools.harness.schedule_bench``), ``split`` and ``replay`` (the
split's cost per microbatch-stage, and a schedule step replayed from it: ``--split``), ``report`` (targets, tables,
JSON). Method and results: ``docs/performance.md``.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``ppbackward bench``: see :func:`ppbackward._tools.cli.bench.main`."""
    from ppbackward._tools.cli.bench import main as bench_main

    return bench_main(argv)

