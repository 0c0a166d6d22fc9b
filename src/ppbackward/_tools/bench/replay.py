"""A schedule step replayed from measured action costs, with zero communication.

Private module (issue 22). Note [replayed step]: torch's own planner gives every rank's action list
(``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``: the schedule's lowering run
on mock stages). The replay runs those lists as an event simulation: a rank runs its actions in list
order, each starting when the rank is free and its inputs exist (a forward of stage ``s`` after the
forward of stage ``s - 1`` of the same microbatch; an input backward, B (``I``) or full, of stage
``s`` after the input backward of stage ``s + 1``; W after its own B, which list order already
ensures), and lasting the measured cost of its kind (every stage costs the same). Sending is free
and instant. The step is the last rank's finish. Three costings of the zero-bubble lists:

* ``measured``: F, B and W as measured (``split``);
* ``ideal``: B and W scaled so that B + W = the full backward (a split that costs nothing), in the
  measured proportion of B to W;
* ``merged``: the measured costs, with every B directly followed on its rank by the W of the same
  stage and microbatch run as one full backward instead (``ppbackward.install(merge_bw=True)``:
  ``ppbackward._merge.merge_actions``, Note [merged B and W]); ``merged_share`` is the fraction of W
  actions so merged.

``ScheduleInterleaved1F1B`` runs F and full backwards and is the reference of every ratio.
"""

from __future__ import annotations

from typing import NamedTuple

from ppbackward._merge import merge_actions
from ppbackward._tools.bench.records import ReplayRecord, SplitCosts
from ppbackward._tools.harness.actions import compute_kind

__all__ = [  # private module: what other modules use
    "SCHEDULES",
    "Action",
    "action_lists",
    "costings_of",
    "replay",
    "simulate",
    "timeline",
]

SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


class Action(NamedTuple):
    """One compute action: ``kind`` is ``"F"``, ``"B"`` (full backward), ``"I"`` (B, input grads) or ``"W"``."""

    stage: int
    kind: str
    microbatch: int


def action_lists(
    schedule: str, ranks: int, microbatches: int, stages_per_rank: int = 2, merged: bool = False
) -> list[list[Action]]:
    """Every rank's compute actions of ``schedule`` (a class name in ``torch...schedules``), in order;
    ``merged``: as ``install(merge_bw=True)`` runs them (each B directly followed by its own W one full
    backward).

    Raises:
        RuntimeError: the installed torch has no planner (``_schedule_visualizer``) or it fails.
    """
    try:
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        ops = get_schedule_ops(getattr(schedules, schedule), ranks, microbatches, stages_per_rank)
    except Exception as e:  # older torch, or a planner that changed signature
        raise RuntimeError(f"no action lists for {schedule}: {type(e).__name__}: {e}") from e
    out = []
    for rank_ops in ops:
        if merged:
            rank_ops = merge_actions(rank_ops)[0]
        acts = []
        for a in rank_ops:
            kind = compute_kind(a)
            if kind and a is not None and a.microbatch_index is not None:
                acts.append(Action(a.stage_index, kind, a.microbatch_index))
        out.append(acts)
    return out


def simulate(lists: list[list[Action]], costs: dict[str, float]) -> float:
    """The step time (units of ``costs``: keys ``F``, ``B``, ``I``, ``W``) of ``lists`` (Note [replayed step]).

    Raises:
        RuntimeError: the lists deadlock (an action waits for one that never runs).
    """
    return max((end for acts in timeline(lists, costs) for _, _, end in acts), default=0.0)


def timeline(lists: list[list[Action]], costs: dict[str, float]) -> list[list[tuple[Action, float, float]]]:
    """Each rank's actions of ``lists`` with their start and end (units of ``costs``), as :func:`simulate`
    runs them (Note [replayed step]).

    Raises:
        RuntimeError: the lists deadlock (an action waits for one that never runs).
    """
    n_stages = 1 + max(a.stage for acts in lists for a in acts)
    done: dict[tuple[str, int, int], float] = {}
    ran: list[list[tuple[Action, float, float]]] = [[] for _ in lists]
    pos = [0] * len(lists)
    free = [0.0] * len(lists)
    remaining = sum(map(len, lists))
    while remaining:
        progressed = False
        for r, acts in enumerate(lists):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind == "F":
                    deps = [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
                elif a.kind in "BI":
                    deps = [("F", a.stage, a.microbatch)]
                    if a.stage < n_stages - 1:
                        deps.append(("grad", a.stage + 1, a.microbatch))
                else:
                    deps = [("grad", a.stage, a.microbatch)]
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                free[r] = start + costs[a.kind]
                ran[r].append((a, start, free[r]))
                done["F" if a.kind == "F" else ("grad" if a.kind in "BI" else "W"), a.stage, a.microbatch] = free[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("replayed schedule deadlocked")
    return ran


def costings_of(costs: SplitCosts) -> dict[str, dict[str, float]]:
    """The ``measured`` and ``ideal`` costs per action kind (``F``, ``B``: full, ``I``: B, ``W``; ms) from
    the measured ``costs`` (Note [replayed step])."""
    f, full, b, w = costs.F, costs.full, costs.B, costs.W
    scale = full / (b + w)
    return {
        "measured": {"F": f, "B": full, "I": b, "W": w},
        "ideal": {"F": f, "B": full, "I": b * scale, "W": w * scale},
    }


def replay(costs: SplitCosts, ranks: int = 2, microbatches: int = 8) -> ReplayRecord:
    """Replay the three schedules from ``costs`` (ms per stage action) at ``ranks`` ranks and ``microbatches``:
    every zero-bubble schedule in each costing, the plain one measured (Note [replayed step])."""
    costings = costings_of(costs)
    step = {SCHEDULES[0]: simulate(action_lists(SCHEDULES[0], ranks, microbatches), costings["measured"])}
    share = {}
    for zb in SCHEDULES[1:]:
        lists = action_lists(zb, ranks, microbatches)
        for name, c in costings.items():
            step[f"{zb}/{name}"] = simulate(lists, c)
        merged = action_lists(zb, ranks, microbatches, merged=True)
        step[f"{zb}/merged"] = simulate(merged, costings["measured"])
        n_w = sum(a.kind == "W" for acts in lists for a in acts)
        n_left = sum(a.kind == "W" for acts in merged for a in acts)
        share[zb] = (n_w - n_left) / n_w if n_w else 0.0
    ref = step[SCHEDULES[0]]
    return ReplayRecord(
        ranks=ranks,
        microbatches=microbatches,
        step_ms=step,
        ratio_to_1f1b={k: v / ref for k, v in step.items()},
        merged_share=share,
    )
