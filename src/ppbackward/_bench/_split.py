"""The split's cost: B, W and B+W per microbatch-stage against one full backward of the same graph.

Private module (issue 22). Note [split cost]: a zero-bubble schedule pays for its smaller bubble with
the B/W split: B then W run the same matrix products as one full backward, so the floor of B+W over
the full backward is 1.0x; what lies above it is the split's own work (graph analysis, hooks, engine
entries, W's node calls). Per configuration and regime (Note [regimes] in ``_timing``), each repeat
runs, in an order rotated by one from the previous repeat (Note [interleaved repeats]), ppbackward's
full ``stage_backward`` and its B then W on a fresh forward each (forward untimed), plus torch's own
B then W for contrast; the figures are the minima over repeats and, beside them, the median and the
spread (first and third quartile) of the ratios taken within one repeat. B alone is B's time in the
split variant. ``extra`` maps more variant names to ``(B, W)`` pairs of callables with ppbackward's
signatures, timed the same way (e.g. an older ppbackward imported under another name, to compare a
change side by side in one run).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch

import ppbackward.backward as _ours
from ppbackward._bench._impls import UPSTREAM_B, UPSTREAM_W
from ppbackward._bench._models import Config, Stage, build, reset_grads
from ppbackward._bench._timing import REGIMES, _fit_repeats, _gc_paused, _rotations, prepare_regime

__all__: list[str] = []  # private module

# The configurations and its limits on B+W over the full backward (Targets of issue 22).
CONFIGS = (Config(4, 128, 16), Config(4, 256, 16), Config(16, 64, 16), Config(16, 256, 16))
LIMITS = {"4x128x16": 1.30, "4x256x16": 1.15, "16x64x16": 1.5, "16x256x16": 1.15}

Split = tuple[Callable[..., Any], Callable[..., Any]]


def _time_full(stage: Stage) -> dict[str, float]:
    out = stage.model(stage.x)
    t0 = time.perf_counter()
    _ours.stage_backward((out,), (stage.grad,), [stage.x])
    return {"full": time.perf_counter() - t0}


def _time_split(name: str, pair: Split, stage: Stage) -> dict[str, float]:
    b, w = pair
    out = stage.model(stage.x)
    t0 = time.perf_counter()
    _, groups = b((out,), (stage.grad,), [stage.x], iter(stage.params))
    t1 = time.perf_counter()
    w(iter(stage.params), groups)
    t2 = time.perf_counter()
    return {f"{name}_b": t1 - t0, f"{name}_w": t2 - t1, f"{name}_bw": t2 - t0}


def _variants(extra: dict[str, Split]) -> dict[str, Callable[[Stage], dict[str, float]]]:
    pairs: dict[str, Split] = {
        "pp": (_ours.stage_backward_input, _ours.stage_backward_weight),
        "torch": (UPSTREAM_B, UPSTREAM_W),
        **extra,
    }
    runners: dict[str, Callable[[Stage], dict[str, float]]] = {"full": _time_full}
    for name, pair in pairs.items():
        runners[name] = lambda stage, name=name, pair=pair: _time_split(name, pair, stage)
    return runners


def _round(stage: Stage, runners: dict, order: tuple[str, ...], regime: str) -> dict[str, float]:
    got: dict[str, float] = {}
    with _gc_paused():
        for name in order:
            prepare_regime(stage, regime)
            got.update(runners[name](stage))
    return got


def _stats(rounds: list[dict[str, float]], num: str, den: str) -> dict[str, float]:
    ratios = sorted(r[num] / r[den] for r in rounds)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {
        "min_ratio": min(r[num] for r in rounds) / min(r[den] for r in rounds),
        "median": statistics.median(ratios),
        "q1": q[0],
        "q3": q[2],
    }


def measure_config(
    cfg: Config, repeats: int, budget_s: Optional[float], extra: Optional[dict[str, Split]] = None
) -> dict[str, Any]:
    """One configuration: min-of-N ms of every figure per regime, and the ratios to the full backward.

    Returns:
        ``{"name", "label", "repeats", "time_ms": {regime: {key: ms}}, "ratios": {regime: {key:
        {"min_ratio", "median", "q1", "q3"}}}}`` where the keys are ``<variant>_b``, ``<variant>_w``,
        ``<variant>_bw`` for every split variant (``pp``, ``torch`` and ``extra``'s), ratios taken
        against ``full`` (ppbackward's ``stage_backward``).
    """
    stage = build(cfg)
    runners = _variants(extra or {})
    names = tuple(runners)
    for regime in REGIMES:  # warm-up
        _round(stage, runners, names, regime)
    t0 = time.perf_counter()
    for regime in REGIMES:
        _round(stage, runners, names, regime)
    n = _fit_repeats(repeats, budget_s, time.perf_counter() - t0)
    rounds: dict[str, list[dict[str, float]]] = {regime: [] for regime in REGIMES}
    for order in _rotations(names, n):
        for regime in REGIMES:
            rounds[regime].append(_round(stage, runners, order, regime))
    reset_grads(stage)
    keys = [k for k in rounds[REGIMES[0]][0] if k != "full"]
    return {
        "name": cfg.name,
        "label": cfg.label,
        "repeats": n,
        "limit_bw": LIMITS.get(cfg.name),
        "time_ms": {rg: {k: 1e3 * min(r[k] for r in rs) for k in ["full", *keys]} for rg, rs in rounds.items()},
        "ratios": {rg: {k: _stats(rs, k, "full") for k in keys} for rg, rs in rounds.items()},
    }


def measure(
    configs: tuple[Config, ...] | list[Config] = CONFIGS,
    repeats: int = 60,
    budget_s: Optional[float] = 15.0,
    extra: Optional[dict[str, Split]] = None,
) -> dict[str, Any]:
    """:func:`measure_config` for each configuration, with torch's thread count at 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"configs": [measure_config(cfg, repeats, budget_s, extra) for cfg in configs]}
    finally:
        torch.set_num_threads(threads)


def format_split(result: dict[str, Any]) -> str:
    """The split table: per configuration and regime, ms and ratios to the full backward."""
    lines = [
        "Split cost per microbatch-stage: ms (min of N) and ratio to ppbackward's full stage_backward "
        "(min/min; median [q1-q3] of per-repeat ratios)"
    ]
    for c in result["configs"]:
        for regime in REGIMES:
            t, r = c["time_ms"][regime], c["ratios"][regime]
            variants = sorted({k.rsplit("_", 1)[0] for k in r})
            cells = [f"{c['label']:<13} {regime:<12} N={c['repeats']:<3} full {t['full']:7.2f}"]
            for v in variants:
                bw, b = r[f"{v}_bw"], r[f"{v}_b"]
                cells.append(
                    f"{v}: B {t[v + '_b']:.2f} W {t[v + '_w']:.2f} B+W {bw['min_ratio']:.2f}x "
                    f"({bw['median']:.2f} [{bw['q1']:.2f}-{bw['q3']:.2f}]) B/full {b['min_ratio']:.2f}x"
                )
            lines.append("  ".join(cells))
    return "\n".join(lines)
