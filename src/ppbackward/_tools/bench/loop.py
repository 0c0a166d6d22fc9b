"""The microbatch loop: one rank's F, B and W actions in the order ``ScheduleInterleavedZeroBubble`` runs them.

Private module. Note [microbatch loop]: a rank of ``ScheduleInterleavedZeroBubble`` (2 ranks, 2 stages
per rank, 8 microbatches) runs its two stages' forwards, input backwards (B) and weight backwards (W)
interleaved; that order comes from torch itself (``_schedule_visualizer.get_schedule_ops``, the
schedule's own planner run on mock stages; a fixed copy of torch 2.13's plan where it is missing). The
loop replays it in one process, without communication: each stage is a stack of encoder layers, the
gradient arriving at a stage's output is a fixed random tensor, parameter grads start at ``None`` and
accumulate over the microbatches, as in one schedule step. Variants: ``plain`` (each B a full
``torch.autograd.backward``, W nothing: the loop of a schedule without the split), ``upstream``
(torch's B and W) and ``ppbackward``. Timed as a whole, interleaved min-of-N (Note [interleaved
repeats] in ``timing``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ppbackward._tools.bench.impls import SPLIT
from ppbackward._tools.bench.timing import fit_repeats, gc_paused
from ppbackward._tools.harness.models import Config, build
from ppbackward._tools.repeats import rotations

__all__ = ["MICROBATCHES", "VARIANTS", "plan", "time_loop"]  # private module: what other modules use

MICROBATCHES = 8
VARIANTS = ("plain", "upstream", "ppbackward")

# torch 2.13's plan for rank 0 (stages 0 and 2) of 2 ranks, 8 microbatches, where the planner is missing.
_FALLBACK = (
    "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 0F4 2I3 2W3 0F5 0I2 0W2 2F4 "
    "0I3 0W3 2F5 2I4 2W4 0F6 2I5 2W5 0F7 0I4 0W4 2F6 0I5 0W5 2F7 2I6 2W6 2I7 2W7 0I6 0W6 0I7 0W7"
)


def plan(n_microbatches: int = MICROBATCHES) -> list[tuple[int, str, int]]:
    """``(local stage 0 or 1, "F" | "B" | "W", microbatch)`` for rank 0, in the schedule's order."""
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
        from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

        actions = [str(a) for a in get_schedule_ops(ScheduleInterleavedZeroBubble, 2, n_microbatches, 2)[0] if a]
    except Exception:  # older torch: no planner, or another signature
        actions = _FALLBACK.split() if n_microbatches == MICROBATCHES else []
    steps = []
    for text in actions:
        stage, kind, mb = int(text[0]), text[1], int(text[2:])
        if kind in "FIW":
            steps.append((0 if stage == 0 else 1, "B" if kind == "I" else kind, mb))
    if not steps:
        raise RuntimeError(f"no ScheduleInterleavedZeroBubble plan for {n_microbatches} microbatches")
    return steps


class _Loop:
    """Two stages (half of ``cfg``'s layers each) with their microbatches and output gradients."""

    def __init__(self, cfg: Config, n_microbatches: int) -> None:
        half = Config(max(1, cfg.layers // 2), cfg.d_model, cfg.seq, cfg.batch, cfg.nhead)
        self.stages = [build(half, seed=s) for s in (0, 1)]
        gen = torch.Generator().manual_seed(3)
        shape = (cfg.batch, cfg.seq, cfg.d_model)
        self.inputs = [
            [torch.randn(shape, generator=gen).requires_grad_() for _ in range(n_microbatches)] for _ in self.stages
        ]
        self.grads = [torch.randn(shape, generator=gen) for _ in self.stages]
        self.steps = plan(n_microbatches)

    def run(self, variant: str) -> float:
        for stage in self.stages:
            for p in stage.params:
                p.grad = None
        outs: dict[tuple[int, int], torch.Tensor] = {}
        groups: dict[tuple[int, int], Any] = {}
        t0 = time.perf_counter()
        for s, kind, mb in self.steps:
            stage, key = self.stages[s], (s, mb)
            if kind == "F":
                outs[key] = stage.model(self.inputs[s][mb])
            elif kind == "B":
                out = outs.pop(key)
                if variant == "plain":
                    torch.autograd.backward((out,), (self.grads[s],))
                else:
                    b, _ = SPLIT[variant]
                    _, groups[key] = b((out,), (self.grads[s],), [self.inputs[s][mb]], iter(stage.params))
                del out
            elif variant != "plain":
                _, w = SPLIT[variant]
                w(iter(stage.params), groups.pop(key))
        elapsed = time.perf_counter() - t0
        for xs in self.inputs:
            for x in xs:
                x.grad = None
        return elapsed


def time_loop(
    cfg: Config, repeats: int, budget_s: float | None = None, n_microbatches: int = MICROBATCHES
) -> dict[str, Any]:
    """Min-of-N seconds of the whole loop per variant, interleaved; and the plan it replays.

    One warm-up round sizes N as in ``_timing.time_config`` (``_timing.fit_repeats``): with ``budget_s``
    (seconds), N is lowered (not below 3, nor above ``repeats``) so that the repeats take about that long.
    """
    loop = _Loop(cfg, n_microbatches)
    t0 = time.perf_counter()
    for variant in VARIANTS:  # warm-up
        loop.run(variant)
    repeats = fit_repeats(repeats, budget_s, time.perf_counter() - t0)
    best = {v: float("inf") for v in VARIANTS}
    for order in rotations(VARIANTS, repeats):
        with gc_paused():
            for variant in order:
                best[variant] = min(best[variant], loop.run(variant))
    return {
        "microbatches": n_microbatches,
        "plan": " ".join(f"{'02'[s]}{k}{m}" for s, k, m in loop.steps),
        "repeats": repeats,
        "time_ms": {v: t * 1e3 for v, t in best.items()},
        "ratio_to_plain": {v: t / best["plain"] for v, t in best.items()},
    }
