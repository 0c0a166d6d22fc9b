"""Interleaved, min-of-N timing of the backward variants.

Private module. Timed the way of Note [interleaved repeats] (``ppbackward._tools.repeats``: the
order of the repeats; the minimum over them). The helpers :func:`fit_repeats` and :func:`gc_paused` are
shared with the microbatch loop (``loop``), the split's cost (``split``) and the one-rank step
(``one_rank``), as are :func:`device_clock` (a clock that waits for the device) and :func:`loadavg` (the
machine's load, in the report's ``meta``).

Note [regimes]: a stage's first microbatch of a step finds every parameter's ``.grad`` ``None``; the
others accumulate into existing grads, which is a different path in ``AccumulateGrad`` (an add into
the held grad, or a fresh tensor) and a different allocation pattern. Each repeat runs one round in
each regime: ``first`` (every ``.grad`` set to ``None`` before each variant) and ``accumulating``
(grads kept, so each variant adds into what the previous one left). The stage input's ``.grad`` is
reset before every variant in both: a pipeline stage gets fresh inputs per microbatch.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from ppbackward._gc_pause import automatic_gc_paused
from ppbackward._tools.bench.impls import VARIANTS, run_variant
from ppbackward._tools.harness.models import Config, Stage, build, reset_grads
from ppbackward._tools.repeats import rotations

__all__ = [  # private module: what other modules use
    "KEYS",
    "PAIRS",
    "REGIMES",
    "device_clock",
    "fit_repeats",
    "gc_paused",
    "loadavg",
    "one_torch_thread",
    "prepare_regime",
    "time_config",
]

# Keys of the result, each the minimum over repeats, in seconds.
KEYS = ("plain", "upstream_b", "upstream_w", "upstream_bw", "ppbackward_b", "ppbackward_w", "ppbackward_bw", "full")


REGIMES = ("first", "accumulating")


def fit_repeats(repeats: int, budget_s: float | None, per_repeat_s: float) -> int:
    """N, the repeats to time: ``repeats``, lowered so that N repeats of ``per_repeat_s`` seconds take
    about ``budget_s`` seconds, but never below 3 (nor above ``repeats``); ``repeats`` itself when there
    is no budget (``None``) or ``per_repeat_s`` is not positive."""
    if budget_s is None or per_repeat_s <= 0:
        return repeats
    return max(min(repeats, 3), min(repeats, int(budget_s / per_repeat_s)))


def device_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter``, after waiting for the device's queued work (CUDA runs asynchronously)."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def loadavg() -> float | None:
    """The 1-minute load average, rounded to 0.01; ``None`` where the platform has none. Other processes
    share the cores: a high value means noisy timings (Note [interleaved repeats])."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op thread count at 1 for the block, restored after: every timing of the bench runs one
    thread, so a ratio compares host work, not how many cores an op spread over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect, then keep the automatic gc off for the block (Note [interleaved repeats]) and as it was after: through
    ppbackward's pause (Note [no collection inside B and W] in ``ppbackward._gc_pause``), so a caller's switched-off
    collector stays off and a B on another thread keeps its pause."""
    gc.collect()
    with automatic_gc_paused(always=True):
        yield


def prepare_regime(stage: Stage, regime: str) -> None:
    if regime == "first" or any(p.grad is None for p in stage.params):
        reset_grads(stage)
        if regime == "accumulating":  # grads to accumulate into
            out = stage.model(stage.x)
            out.backward(stage.grad)
    stage.x.grad = None


def _one_round(stage: Stage, order: tuple[str, ...], regime: str) -> dict[str, float]:
    got: dict[str, float] = {}
    with gc_paused():
        for name in order:
            prepare_regime(stage, regime)
            t = run_variant(name, stage)
            if name in ("plain", "full"):
                got[name] = t["total"]
            else:
                got[f"{name}_b"], got[f"{name}_w"], got[f"{name}_bw"] = t["b"], t["w"], t["total"]
    return got


def time_config(
    cfg: Config, repeats: int, budget_s: float | None = None, stage: Stage | None = None
) -> tuple[dict[str, dict[str, float]], int, dict[str, dict[str, float]]]:
    """Per regime (Note [regimes]): min-of-N seconds for every key of :data:`KEYS`; the N used; and
    per regime :func:`paired_medians`.

    Two warm-up repeats run first (not counted); the second sizes N. With ``budget_s``, N is lowered (never below 3,
    nor above ``repeats``) so that the repeats take about that long: big configurations get fewer.
    """
    stage = stage or build(cfg)
    for regime in REGIMES:  # warm-up (first-time allocations)
        _one_round(stage, VARIANTS, regime)
    t0 = time.perf_counter()
    for regime in REGIMES:  # not counted either; sizes N
        _one_round(stage, VARIANTS, regime)
    n = fit_repeats(repeats, budget_s, time.perf_counter() - t0)
    rounds: dict[str, list[dict[str, float]]] = {regime: [] for regime in REGIMES}
    for order in rotations(VARIANTS, n):
        for regime in REGIMES:
            rounds[regime].append(_one_round(stage, order, regime))
    reset_grads(stage)
    mins = {regime: {key: min(got[key] for got in rs) for key in KEYS} for regime, rs in rounds.items()}
    return mins, n, {regime: paired_medians(rs) for regime, rs in rounds.items()}


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
