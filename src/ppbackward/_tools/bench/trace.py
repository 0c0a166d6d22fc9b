"""Chrome traces of the schedule step: the measured step per rank, and the replayed step beside it.

Private module. Note [step traces]: ``ppbackward bench --schedule --trace DIR`` writes one file per
schedule variant in the Chrome trace event format (``{"traceEvents": [...]}``, complete events ``"ph":
"X"`` with microsecond ``ts`` and ``dur``), which Perfetto (ui.perfetto.dev) and ``chrome://tracing``
open as they are, as they open what ``torch.profiler`` exports. One process per rank, named ``rank R``:
one slice per timed call of the variant's fastest step (Note [step parts] in
``ppbackward._tools.harness.bench_probes``: ``F``, ``full backward``,
``B``, ``W``, ``waiting for a peer``), with its stage and microbatch in ``args``, and ``the rest`` filling
every gap up to the step's end (the schedule's own Python, posting sends, the loss), so the slices of a
rank tile its step and their durations add up to the parts ``--schedule`` prints. With ``--split``
measuring the same stage shape, the replayed step (Note [replayed step]) follows as further processes,
``replayed <costing> rank R`` for ``ideal``, ``measured`` and ``merged``, one slice per action.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ppbackward._tools.bench.records import SplitCosts
from ppbackward._tools.harness.records import ScheduleBench

__all__ = ["step_trace", "write_traces"]

NAMES = {"F": "F", "full": "full backward", "B": "B", "W": "W", "wait": "waiting for a peer", "other": "the rest"}
_REPLAY_NAMES = {"F": "F", "B": "full backward", "I": "B", "W": "W"}
_REPLAY_PID = 100  # replayed processes follow the ranks


def _complete(name: str, pid: int, ts_ms: float, dur_ms: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": 0, "ts": round(ts_ms * 1e3, 3),
            "dur": round(dur_ms * 1e3, 3), "args": args}


def _process(pid: int, name: str) -> dict[str, Any]:
    return {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}


def rank_events(rank: int, slices: list[list], step_ms: float) -> list[dict[str, Any]]:
    """The events of one rank's measured step: its slices (``[kind, start ms, ms, stage, microbatch]``,
    the bench's ``records.PartsRecord.slices``) and ``the rest`` in every gap before ``step_ms``."""
    events = [_process(rank, f"rank {rank}")]
    cursor = 0.0
    for kind, start, dur, stage, microbatch in sorted(slices, key=lambda s: s[1]):
        if start > cursor:
            events.append(_complete(NAMES["other"], rank, cursor, start - cursor, {}))
        args = {} if stage is None else {"stage": stage, "microbatch": microbatch}
        events.append(_complete(NAMES[kind], rank, start, dur, args))
        cursor = max(cursor, start + dur)
    if step_ms > cursor:
        events.append(_complete(NAMES["other"], rank, cursor, step_ms - cursor, {}))
    return events


def replay_events(schedule: str, costs: SplitCosts, ranks: int, microbatches: int) -> list[dict[str, Any]]:
    """The replayed step of ``schedule`` (a class name) from the measured ``costs`` (ms per stage action),
    one process per costing and rank: ``ideal`` and ``measured`` (zero-bubble schedules),
    ``merged``; the plain schedule gets its one costing, ``measured``."""
    from ppbackward._tools.bench.replay import action_lists, costings_of, timeline

    costings = costings_of(costs)
    runs = {"measured": (action_lists(schedule, ranks, microbatches), costings["measured"])}
    if "ZeroBubble" in schedule:
        runs["ideal"] = (runs["measured"][0], costings["ideal"])
        runs["merged"] = (action_lists(schedule, ranks, microbatches, merged=True), costings["measured"])
    events: list[dict[str, Any]] = []
    for k, (name, (lists, c)) in enumerate(sorted(runs.items())):
        for rank, acts in enumerate(timeline(lists, c)):
            pid = _REPLAY_PID + k * ranks + rank
            events.append(_process(pid, f"replayed {name} rank {rank}"))
            for a, start, end in acts:
                args = {"stage": a.stage, "microbatch": a.microbatch}
                events.append(_complete(_REPLAY_NAMES[a.kind], pid, start, end - start, args))
    return events


def step_trace(sched: ScheduleBench, variant: str, costs: SplitCosts | None = None) -> dict[str, Any]:
    """The Chrome trace (a JSON-ready dict) of ``variant`` (e.g. ``"ZBVZeroBubble/ppbackward"``) of a
    ``--schedule`` result (``schedule_bench.run_schedule()``), with the replayed step when ``costs`` (the
    ``--split`` costs of the same stage shape) are given."""
    events: list[dict[str, Any]] = []
    for rank, (slices, parts) in enumerate(zip(sched.slices_ms[variant], sched.parts_ms[variant])):
        events += rank_events(rank, slices, parts.step)
    if costs is not None:
        schedule = "Schedule" + variant.split("/")[0]
        events += replay_events(schedule, costs, sched.ranks, sched.microbatches)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"variant": variant}}


def write_traces(folder: str | Path, sched: ScheduleBench, costs: SplitCosts | None = None) -> list[Path]:
    """One ``<variant>.json`` per variant of ``sched`` in ``folder`` (made if missing); their paths."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for variant in sched.slices_ms:
        path = out / (re.sub(r"[^A-Za-z0-9_.-]+", "-", variant) + ".json")
        path.write_text(json.dumps(step_trace(sched, variant, costs)))
        paths.append(path)
    return paths
