"""The split's cost where compilation removes the host's: ``ppbackward bench --compile``.

Private module (issue 37). Note [compiled split cost]: eager, a stage's backward is one autograd node per
op, and the split pays per node (Note [split cost] in ``bench.split``: host-bound, 4 layers d 16 seq 4,
B+W about 3x one full backward). With every layer a ``torch.compile(layer)`` child, each layer is one
node, a compiled region whose backward ppbackward splits in two (Note [compiled regions split in two] in
``ppbackward._compiled``): B runs each region's input-gradient graph, W its weight-gradient graph. What is
left of the split's cost there is measured two ways:

* in this process (:func:`measure`): the bench's host-bound configuration (:data:`CONFIG`) with its layers
  compiled, ppbackward's B then W against the compiled full backward (ppbackward's ``stage_backward``,
  each region's compiled backward run whole), timed as ``--split`` times the eager stage (interleaved
  repeats, both regimes, the minima: ``split.measure_config``), under ``ppbackward.install()`` (the
  backward graphs are compiled through its splitting compiler). Torch's own split is not timed: its B
  keeps the graph, which a compiled region's donated buffers refuse. First, one microbatch's B then W is
  compared with the compiled full backward's grads, and the regions B split are counted: a region run
  whole in B would time something else than the split (``CompiledSplit.regions_per_b``);
* with ``--schedule``, the real torchrun step with the same compiled layers (Note [compiled schedule
  benchmark] in ``ppbackward._tools.harness.schedule_bench``): ppbackward's ``ZBVZeroBubble`` and
  ``InterleavedZeroBubble`` against ``Interleaved1F1B`` with torch's backward, side by side in one launch.

The targets (:data:`LIMIT_BW`, ``split.STEP_LIMITS``) are in docs/performance.md, "The split's host cost".
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import torch

import ppbackward
import ppbackward.backward as _ours
from ppbackward._tools.bench import split as _split
from ppbackward._tools.bench.records import CompiledSplit, CompileRun
from ppbackward._tools.bench.timing import REGIMES, loadavg, one_torch_thread
from ppbackward._tools.harness.models import Config, Stage, build, reset_grads
from ppbackward._tools.harness.records import Tolerance
from ppbackward._tools.harness.schedule_bench import compile_layers
from ppbackward._tools.text_table import format_table

__all__ = ["BACKEND", "CONFIG", "LIMIT_BW", "format_run", "measure", "run", "targets"]  # private module

#: The host-bound configuration of ``--split`` (4 layers d 16 seq 4), its layers compiled.
CONFIG = Config(4, 16, 4)
#: The target on B+W over the compiled full backward.
LIMIT_BW = 1.2
#: The default ``torch.compile`` backend (``--compile-backend``).
BACKEND = "inductor"
#: B then W against the compiled full backward: the same graph cut in two, compiled by the same backend.
TOLERANCE = Tolerance(rtol=1e-5, atol=1e-6)


def _grads(stage: Stage) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in stage.params]


def check_split(stage: Stage) -> tuple[bool, int]:
    """One microbatch of the compiled ``stage``: ppbackward's B then W against the compiled full backward
    (parameter and input grads within :data:`TOLERANCE`), and the regions B split; compiles every region's
    forward, backward and halves. Grads are reset after."""
    reset_grads(stage)
    out = stage.model(stage.x)
    (want_x,) = _ours.stage_backward((out,), (stage.grad,), [stage.x])
    want = _grads(stage)
    reset_grads(stage)
    out = stage.model(stage.x)
    (got_x,), groups = _ours.stage_backward_input((out,), (stage.grad,), [stage.x], iter(stage.params))
    split = sum(len(group.regions) for group in groups)
    _ours.stage_backward_weight(iter(stage.params), groups)
    del groups, out
    pairs = [(got_x, want_x), *zip(_grads(stage), want)]
    ok = all(a is not None and b is not None and not bool(TOLERANCE.outside(a, b).any()) for a, b in pairs)
    reset_grads(stage)
    return ok, split


def measure(
    cfg: Config = CONFIG, repeats: int = 60, budget_s: float | None = 15.0, backend: str = BACKEND,
    device: torch.device | str = "cpu",
) -> CompiledSplit:
    """Note [compiled split cost], in this process: ``cfg`` with every layer compiled by ``backend``, checked
    (:func:`check_split`), then B, W and B+W against the compiled full backward, both regimes, torch's thread
    count at 1."""
    was_installed = ppbackward.is_installed()
    with one_torch_thread():
        try:
            ppbackward.install()  # the backward graphs are compiled through ppbackward's splitting compiler
            eager_nodes = _split.graph_nodes(_split.on_device(build(cfg), device))
            stage = _split.on_device(build(cfg), device)
            compile_layers(stage.model, backend)
            exact, per_b = check_split(stage)
            config = _split.measure_config(cfg, repeats, budget_s, device=device, stage=stage, torch_split=False)
        finally:
            if not was_installed:
                ppbackward.uninstall()
    return CompiledSplit(
        backend=backend, device=str(torch.device(device)), config=dataclasses.replace(config, limit_bw=LIMIT_BW),
        regions=cfg.layers, eager_nodes=eager_nodes, regions_per_b=per_b, grads_match=exact,
    )


def targets(run: CompileRun) -> list[dict[str, Any]]:
    """B+W <= :data:`LIMIT_BW` x the compiled full backward, per regime; with the real step, its
    zero-bubble targets (``split._real_step_targets``, ``compiled real step``)."""
    from ppbackward._tools.bench.report import target_row

    c = run.compiled
    rows = []
    for regime in REGIMES:
        pp = c.config.ratios_of(regime)["pp"].bw
        where = f"{c.config.label}, {regime}, {c.device}, {c.backend}"
        name = f"compiled split: B+W <= {LIMIT_BW:.2f}x compiled full backward"
        rows.append(target_row(name, where, pp.min_ratio, LIMIT_BW, pp.median))
    if run.schedule is not None:
        rows += _split._real_step_targets(run.schedule, "compiled real step")
    return rows


def split_problems(run: CompileRun) -> list[str]:
    """What makes the run's figures not those of the split: grads that differ, a region run whole in B."""
    c, problems = run.compiled, []
    if not c.grads_match:
        problems.append("B then W's grads differ from the compiled full backward's")
    if c.regions_per_b != c.regions:
        problems.append(f"B split {c.regions_per_b} of the stage's {c.regions} compiled regions (the others ran "
                        "whole in B: not split into B and W)")
    sched = run.schedule
    if sched is not None:
        if not sched.grads_match:
            problems.append("the real step's grads differ from the reference's")
        for name, regions in sched.regions.items():
            if not regions.all_split:
                problems.append(f"real step {name}: B calls split {regions.fewest}-{regions.most} compiled regions, "
                                f"{regions.expected} expected")
    return problems


def _split_table(c: CompiledSplit) -> str:
    rows = []
    for regime in REGIMES:
        t, r = c.config.times(regime), c.config.ratios_of(regime)["pp"]
        pp = t.variants["pp"]
        rows.append([
            regime, str(c.config.repeats), f"{t.full:.3f}", f"{pp.b:.3f}", f"{pp.w:.3f}", f"{pp.bw:.3f}",
            f"{r.bw.min_ratio:.2f}x", f"{r.bw.median:.2f} [{r.bw.q1:.2f}-{r.bw.q3:.2f}]", f"{r.b.min_ratio:.2f}x",
        ])
    nodes = f"{c.config.nodes} autograd nodes" + (f" ({c.eager_nodes} eager)" if c.eager_nodes else "")
    return (
        f"\nCompiled stage: B, W and B+W against the compiled full backward per microbatch-stage, ms (min of N; "
        f"ratios min/min, median [q1-q3] of per-repeat ratios); {c.config.label}, every layer "
        f"torch.compile(layer, backend={c.backend!r}): {c.regions} compiled regions, {nodes}; B split "
        f"{c.regions_per_b} regions; grads {'equal' if c.grads_match else 'DIFFER from'} the compiled full "
        "backward's\n"
        + format_table(["regime", "N", "full", "B", "W", "B+W", "B+W/full", "median [q1-q3]", "B/full"], rows,
                       left=1)
    )


def _real_step_text(sched: Any, rep: Any) -> str:
    from ppbackward._tools.harness.records import to_json

    rows = []
    for name in sched.variants:
        regions = sched.regions.get(name)
        split = "-" if regions is None else (
            f"{regions.fewest}/B" if regions.fewest == regions.most else f"{regions.fewest}-{regions.most}/B")
        rows.append([name, f"{sched.step_ms[name]:.1f}", f"{sched.ratio_to_1f1b[name]:.2f}x", split])
    return (
        f"\nReal step with compiled layers (torchrun {sched.ranks} ranks, {sched.stages} stages x "
        f"{sched.layers_per_stage} layers d {sched.d_model} s {sched.seq}, every layer torch.compile(layer, "
        f"backend={sched.compile!r}); {sched.microbatches} microbatches; min of {sched.repeats} steps; ratio to "
        "Interleaved1F1B with torch's backward and the same compiled layers; torch's own B/W refuses compiled "
        "stages in its zero-bubble schedules: not run; split = compiled regions each B call split)\n"
        + format_table(["variant", "step ms", "ratio", "split"], rows, left=1)
        + rep.step_parts_table(to_json(sched))
    )


def format_run(run: CompileRun, rep: Any) -> str:
    """The ``--compile`` report: header, the compiled stage's split, the real step, the targets; ``rep`` is
    ``bench.report``."""
    m = run.meta
    parts = [
        f"ppbackward bench --compile  {m['date']}  torch {m['torch']}  device {run.compiled.device}  backend "
        f"{run.compiled.backend}  {m['cpu_count']} CPU cores, 1 torch thread; ppbackward "
        f"{m.get('ppbackward_commit')}; 1-min load average {m.get('loadavg_start')} at start, "
        f"{m.get('loadavg_end')} at end",
        _split_table(run.compiled),
    ]
    if run.schedule_error is not None:
        parts.append(f"\nReal step: ERROR\n{run.schedule_error}")
    elif run.schedule is not None:
        parts.append(_real_step_text(run.schedule, rep))
    parts.append(rep.targets_table(run.targets, 'docs/performance.md, "The split\'s host cost"'))
    problems = split_problems(run)
    parts.append("\nsplit: " + ("; ".join(problems) if problems else "every B split every compiled region, grads "
                                "as the compiled full backward's"))
    return "\n".join(parts)


def run(args: Any, meta: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``ppbackward bench --compile``: :func:`measure`, with ``--schedule`` the real step; print. Returns the
    exit code (0, or 1 when the real step failed, grads differ or a region ran whole in B:
    :func:`split_problems`) and the JSON report (``CompileRun.to_report``), which ``bench`` writes to ``--json``."""
    from ppbackward._tools.bench import report as _report
    from ppbackward._tools.harness import models as _models
    from ppbackward._tools.harness import schedule_bench as _schedule

    (cfg, *_) = [CONFIG] if args.configs in (None, "all") else _models.parse_configs(args.configs)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 60)
    device = torch.device(args.device)  # a CUDA device the machine has: checked with the options
    t0 = time.perf_counter()

    def progress(what: str) -> None:
        print(f"bench --compile: {what} (elapsed {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

    progress(f"{cfg.label}, every layer compiled with {args.compile_backend} (compiling first)")
    report = CompileRun(meta=meta, compiled=measure(cfg, repeats, None if args.quick else args.budget,
                                                    args.compile_backend, device))
    failed = False
    if args.schedule:
        progress("the real step under torchrun (every rank compiles its stages first)")
        try:
            report.schedule = _schedule.run_schedule(
                repeats=2 if args.quick else args.schedule_repeats, timeout_s=args.schedule_timeout,
                d_model=args.schedule_d_model, compile=args.compile_backend,
            )
        except _schedule.ScheduleBenchError as e:
            report.schedule_error, failed = str(e), True
    if args.trace and report.schedule is not None:
        from ppbackward._tools.bench import trace as _trace

        for path in _trace.write_traces(args.trace, report.schedule):
            print(f"bench: wrote {path}", file=sys.stderr)
    report.targets = targets(report)
    report.meta["loadavg_end"] = loadavg()
    print(format_run(report, _report))
    return (1 if failed or split_problems(report) else 0), report.to_report()
