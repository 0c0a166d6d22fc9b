"""Interleaved, min-of-N timing of the backward variants.

Private module. Note [interleaved repeats]: on a small, shared machine the speed drifts over
seconds (other processes, frequency scaling). Each repeat therefore runs every variant once, in an
order rotated by one from the previous repeat, and each figure is the minimum over repeats: the
run least disturbed by the machine. Ratios are taken between minima of the same run. The forward
is re-run before every timed backward and is not timed; the gc is run before each repeat and
disabled during it (a ``gc.collect()`` costs tens of ms in a process that imported torch).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Optional

from ppbackward._bench._impls import VARIANTS, run_variant
from ppbackward._bench._models import Config, Stage, build, reset_grads

__all__: list[str] = []  # private module

# Keys of the result, each the minimum over repeats, in seconds.
KEYS = ("plain", "upstream_b", "upstream_w", "upstream_bw", "ppbackward_b", "ppbackward_w", "ppbackward_bw", "full")


def _one_round(stage: Stage, order: tuple[str, ...]) -> dict[str, float]:
    got: dict[str, float] = {}
    gc.collect()
    gc.disable()
    try:
        for name in order:
            reset_grads(stage)
            t = run_variant(name, stage)
            if name in ("plain", "full"):
                got[name] = t["total"]
            else:
                got[f"{name}_b"], got[f"{name}_w"], got[f"{name}_bw"] = t["b"], t["w"], t["total"]
    finally:
        gc.enable()
    return got


def time_config(
    cfg: Config, repeats: int, budget_s: Optional[float] = None, stage: Optional[Stage] = None
) -> tuple[dict[str, float], int, dict[str, float]]:
    """Min-of-N seconds for every key of :data:`KEYS`, the N used, and :func:`paired_medians`.

    Two warm-up rounds run first (not counted); the second sizes N. With ``budget_s``, N is lowered (never below 3,
    nor above ``repeats``) so that the repeats take about that long: big configurations get fewer.
    """
    stage = stage or build(cfg)
    _one_round(stage, VARIANTS)  # warm-up (first-time allocations)
    t0 = time.perf_counter()
    _one_round(stage, VARIANTS)  # not counted either; sizes N
    per_round = time.perf_counter() - t0
    n = repeats
    if budget_s is not None and per_round > 0:
        n = max(min(repeats, 3), min(repeats, int(budget_s / per_round)))
    rounds = []
    for r in range(n):
        k = r % len(VARIANTS)
        rounds.append(_one_round(stage, VARIANTS[k:] + VARIANTS[:k]))
    reset_grads(stage)
    return {key: min(got[key] for got in rounds) for key in KEYS}, n, paired_medians(rounds)


# (numerator, denominator) of the ratios whose per-repeat median is reported.
PAIRS = {
    "upstream_bw/plain": ("upstream_bw", "plain"),
    "ppbackward_bw/plain": ("ppbackward_bw", "plain"),
    "full/plain": ("full", "plain"),
    "ppbackward_bw/upstream_bw": ("ppbackward_bw", "upstream_bw"),
}


def paired_medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Median over repeats of each ratio in :data:`PAIRS`, both terms taken from the same repeat.

    A second view of the same data: the minima (the main figures) are the least disturbed runs,
    these medians compare runs made seconds apart. When the two disagree, the machine was noisy.
    """
    return {name: statistics.median(r[a] / r[b] for r in rounds) for name, (a, b) in PAIRS.items()}
