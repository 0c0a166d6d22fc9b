"""Where the time of B and W goes: engine calls, node calls, matmuls, Python analysis and hooks.

Private module. Two measurements on one configuration (by default 16 layers, d 64, seq 16):

* **counts** (``torch.profiler``, CPU events): the autograd node calls (events named
  ``...Backward<N>``, whether the engine or Python called the node; ``AccumulateGrad`` counted
  apart) and the matrix products (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``) in B, in W and in a
  plain backward of the same graph. ``B + W - plain`` node calls are nodes run a second time;
  ``B + W - plain`` matmuls are products computed twice (work a split should not add).
* **profile** (``cProfile`` over a few B and W calls): the number of engine calls
  (``torch.autograd.graph._engine_run_backward``), and the time inside the engine (which includes
  the Python hooks and custom-Function backwards it calls), in the Python hooks themselves, in
  the graph analysis, and in the remaining Python glue. cProfile slows Python code down more than
  C++ code: read the shares, not the absolute times (the unprofiled times are in the timing table).
"""

from __future__ import annotations

import collections
import cProfile
import functools
import pstats
import re
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from ppbackward._gc_pause import automatic_gc_paused
from ppbackward._tools.bench.impls import run_b, run_w
from ppbackward._tools.bench.quiet import quiet_profiler
from ppbackward._tools.harness.models import Config, Stage, build, reset_grads

__all__ = ["where_time_goes"]  # private module: what other modules use

_ANALYSIS = {
    "upstream": ("construct_reverse_graph", "get_param_groups"),
    "ppbackward": ("analyze",),
}
_HOOK_NAMES = ("hook", "<lambda>")
_IMPL_FILES = {"upstream": "pipelining/_backward.py", "ppbackward": "ppbackward/backward.py"}
_NODE = re.compile(r"^[A-Za-z_][A-Za-z0-9_:]*Backward\d*$")
_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


def _events(fn: Callable[[], Any]) -> dict[str, int]:
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = collections.Counter(e.name for e in prof.events())
    return {
        "node_calls": sum(n for name, n in names.items() if _NODE.match(name)),
        "accumulate_grad": names.get("torch::autograd::AccumulateGrad", 0),
        "matmuls": sum(names.get(m, 0) for m in _MATMULS),
    }


def _count_run(stage: Stage, impl: str) -> dict[str, Any]:
    reset_grads(stage)
    out = stage.model(stage.x)
    try:
        if impl == "plain":
            return _events(lambda: torch.autograd.backward((out,), (stage.grad,)))
        box: list = []
        b = _events(lambda: box.append(run_b(impl, stage, out)))
        groups = box.pop()
        n_groups = len(groups)
        w = _events(functools.partial(run_w, impl, stage, groups))
        del groups  # the partial above is gone too: nothing keeps the groups past W
    finally:
        reset_grads(stage)
    return {"param_groups": n_groups, "b": b, "w": w}


def _profile_phase(stage: Stage, impl: str, reps: int) -> dict[str, Any]:
    prof_b, prof_w = cProfile.Profile(), cProfile.Profile()
    for _ in range(reps):
        reset_grads(stage)
        out = stage.model(stage.x)
        with automatic_gc_paused(always=True):
            # runcall: a B or W that raises leaves no profiler on in the caller's process
            groups = prof_b.runcall(run_b, impl, stage, out)
            prof_w.runcall(run_w, impl, stage, groups)
        del groups, out
    reset_grads(stage)
    return {"b": _split(prof_b, impl, reps), "w": _split(prof_w, impl, reps)}


def _split(prof: cProfile.Profile, impl: str, reps: int) -> dict[str, float]:
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = engine = hooks = analysis = 0.0
    engine_calls = 0
    for (filename, _, func), (_, ncalls, _tottime, cumtime, _) in stats.items():
        fn = filename.replace("\\", "/")
        if func == "_engine_run_backward" and fn.endswith("autograd/graph.py"):
            engine += cumtime
            engine_calls += ncalls
        elif fn.endswith(_IMPL_FILES[impl]):
            if func in ("stage_backward_input", "stage_backward_weight"):
                total += cumtime
            elif func in _HOOK_NAMES:
                hooks += cumtime
            elif func in _ANALYSIS[impl]:
                analysis += cumtime
        elif impl == "ppbackward" and fn.endswith("ppbackward/_graph.py") and func == "analyze":
            analysis += cumtime
    ms = 1e3 / reps
    return {
        "total_ms": total * ms,
        "engine_ms": (engine - hooks) * ms,  # engine work excluding the Python hooks it calls
        "hooks_ms": hooks * ms,
        "analysis_ms": analysis * ms,
        "python_other_ms": max(0.0, total - engine - analysis) * ms,
        "engine_calls": engine_calls / reps,
    }


def where_time_goes(cfg: Config, reps: int = 5) -> dict[str, Any]:
    """Counts and profile shares of B and W for both implementations on ``cfg``."""
    stage = build(cfg)
    result: dict[str, Any] = {"config": cfg.name, "params": len(stage.params)}
    result["plain"] = _count_run(stage, "plain")
    for impl in ("upstream", "ppbackward"):
        counts = _count_run(stage, impl)
        for key in ("node_calls", "matmuls"):
            counts[f"extra_{key}"] = counts["b"][key] + counts["w"][key] - result["plain"][key]
        result[impl] = {**counts, "profile": _profile_phase(stage, impl, reps)}
    return result
