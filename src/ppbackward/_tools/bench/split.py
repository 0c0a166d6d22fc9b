"""The split's cost: B, W and B+W per microbatch-stage against one full backward of the same graph.

Private module (issue 22). Note [split cost]: a zero-bubble schedule pays for its smaller bubble with
the B/W split: B then W run the same matrix products as one full backward, so the floor of B+W over
the full backward is 1.0x; what lies above it is the split's own work (graph analysis, hooks, engine
entries, W's node calls). Per configuration and regime (Note [regimes] in ``timing``), each repeat
runs, in an order rotated by one from the previous repeat (Note [interleaved repeats]), ppbackward's
full ``stage_backward`` and its B then W on a fresh forward each (forward untimed), plus torch's own
B then W for contrast; the figures are the minima over repeats and, beside them, the median and the
spread (first and third quartile) of the ratios taken within one repeat. B alone is B's time in the
split variant. ``extra`` maps more variant names to ``(B, W)`` pairs of callables with ppbackward's
signatures, timed the same way (e.g. an older ppbackward imported under another name, to compare a
change side by side in one run).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from typing import Any, Callable

import torch

import ppbackward.backward as _ours
from ppbackward._tools.bench import calls as _calls
from ppbackward._tools.bench.impls import UPSTREAM_B, UPSTREAM_W
from ppbackward._tools.bench.records import (
    HeldBytes,
    RatioStats,
    SplitConfig,
    SplitCosts,
    SplitResult,
    SplitRun,
    split_key,
)
from ppbackward._tools.bench.timing import (
    REGIMES,
    device_clock,
    fit_repeats,
    gc_paused,
    loadavg,
    one_torch_thread,
    prepare_regime,
)
from ppbackward._tools.harness.models import Config, Stage, build, reset_grads
from ppbackward._tools.harness.records import ScheduleBench
from ppbackward._tools.repeats import rotations

__all__ = ["CONFIGS", "replayed_steps", "run"]  # private module: what other modules use

# The configurations, from host-bound (4x16x4: the host's per-node cost is everything) to compute-bound
# (4x512x64), and the limits on B+W over the full backward (docs/performance.md, "The split's host cost"; issue 36 set
# 4x128x16 to 1.25).
CONFIGS = (
    Config(4, 16, 4), Config(4, 128, 16), Config(4, 256, 16), Config(16, 64, 16), Config(16, 256, 16),
    Config(4, 512, 64),
)
LIMITS = {
    "4x16x4": 1.5, "4x128x16": 1.25, "4x256x16": 1.15, "16x64x16": 1.5, "16x256x16": 1.15, "4x512x64": 1.05,
}

Split = tuple[Callable[..., Any], Callable[..., Any]]


def _time_full(stage: Stage) -> dict[str, float]:
    clock = device_clock(stage.x.device)
    t0 = clock()
    out = stage.model(stage.x)
    t1 = clock()
    _ours.stage_backward((out,), (stage.grad,), [stage.x])
    return {"fwd": t1 - t0, "full": clock() - t1}


def _time_split(name: str, pair: Split, stage: Stage) -> dict[str, float]:
    b, w = pair
    clock = device_clock(stage.x.device)
    out = stage.model(stage.x)
    t0 = clock()
    _, groups = b((out,), (stage.grad,), [stage.x], iter(stage.params))
    t1 = clock()
    w(iter(stage.params), groups)
    t2 = clock()
    return {split_key(name, "b"): t1 - t0, split_key(name, "w"): t2 - t1, split_key(name, "bw"): t2 - t0}


def _variants(extra: dict[str, Split], torch_split: bool = True) -> dict[str, Callable[[Stage], dict[str, float]]]:
    pairs: dict[str, Split] = {
        "pp": (_ours.stage_backward_input, _ours.stage_backward_weight),
        **({"torch": (UPSTREAM_B, UPSTREAM_W)} if torch_split else {}),
        **extra,
    }
    runners: dict[str, Callable[[Stage], dict[str, float]]] = {"full": _time_full}
    for name, pair in pairs.items():
        runners[name] = functools.partial(_time_split, name, pair)
    return runners


def _round(stage: Stage, runners: dict, order: tuple[str, ...], regime: str) -> dict[str, float]:
    got: dict[str, float] = {}
    with gc_paused():
        for name in order:
            prepare_regime(stage, regime)
            got.update(runners[name](stage))
    return got


def _stats(rounds: list[dict[str, float]], num: str, den: str) -> RatioStats:
    ratios = sorted(r[num] / r[den] for r in rounds)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return RatioStats(
        min_ratio=min(r[num] for r in rounds) / min(r[den] for r in rounds),
        median=statistics.median(ratios),
        q1=q[0],
        q3=q[2],
    )


def on_device(stage: Stage, device: torch.device | str) -> Stage:
    """``stage`` with its model, input and output gradient on ``device``."""
    device = torch.device(device)
    if device.type == "cpu":
        return stage
    model = stage.model.to(device)
    x = stage.x.detach().to(device).requires_grad_()
    return Stage(model, list(model.parameters()), x, stage.grad.to(device))


def measure_config(
    cfg: Config,
    repeats: int,
    budget_s: float | None,
    extra: dict[str, Split] | None = None,
    device: torch.device | str = "cpu",
    stage: Stage | None = None,
    torch_split: bool = True,
) -> SplitConfig:
    """One configuration: min-of-N ms of every figure per regime, and the ratios to the full backward
    (ppbackward's ``stage_backward``), for every split variant (``pp``, ``torch`` unless ``torch_split`` is
    false, and ``extra``'s; Note [split keys] in ``bench.records``); without ``costs_ms`` and ``replay``
    (``measure`` adds them). ``stage``: ``cfg`` built already (``bench.compiled``: its layers compiled)."""
    stage = stage if stage is not None else on_device(build(cfg), device)
    runners = _variants(extra or {}, torch_split)
    names = tuple(runners)
    for regime in REGIMES:  # warm-up
        _round(stage, runners, names, regime)
    t0 = time.perf_counter()
    for regime in REGIMES:
        _round(stage, runners, names, regime)
    n = fit_repeats(repeats, budget_s, time.perf_counter() - t0)
    rounds: dict[str, list[dict[str, float]]] = {regime: [] for regime in REGIMES}
    for order in rotations(names, n):
        for regime in REGIMES:
            rounds[regime].append(_round(stage, runners, order, regime))
    reset_grads(stage)
    keys = [k for k in rounds[REGIMES[0]][0] if k not in ("full", "fwd")]
    return SplitConfig(
        name=cfg.name,
        label=cfg.label,
        batch=cfg.batch,
        nodes=graph_nodes(stage),
        repeats=n,
        limit_bw=LIMITS.get(cfg.name),
        time_ms={rg: {k: 1e3 * min(r[k] for r in rs) for k in ["fwd", "full", *keys]} for rg, rs in rounds.items()},
        ratios={rg: {k: _stats(rs, k, "full") for k in keys} for rg, rs in rounds.items()},
        held_bytes=held_bytes(stage) if stage.x.device.type == "cuda" else None,
    )


# Note [slow paths timed]: what B's other paths (the graphs of Note [slow paths counted] in ``bench.calls``: a
# tensor hook on every linear layer's output, the forward under an identity ``saved_tensors_hooks`` pair) cost
# in time, on the first of the counted configurations (4x16x4, the host-bound stage, where a path's host cost
# shows most). Each path is a configuration of its own (:func:`measure_config` on the stage taking that path on
# every forward): ppbackward's full backward and its B then W on the same hooked graph, interleaved, both
# regimes, on the CPU (``--device cuda`` runs none); printed beside the default path's figures of the same
# configuration from the same run, so that B's and W's ms say what the path adds and B+W over the full
# backward what the split costs on such a graph.
def measure_slow_paths(cfg: Config, repeats: int, budget_s: float | None) -> dict[str, SplitConfig]:
    """Each of ``bench.calls.SLOW_PATHS`` on ``cfg``, timed as a :class:`SplitConfig` (Note [slow paths timed])."""
    out: dict[str, SplitConfig] = {}
    with one_torch_thread():  # as measure's
        for path in _calls.SLOW_PATHS:
            stage, handles = _calls.slow_path_stage(cfg, path)
            try:
                out[path] = measure_config(cfg, repeats, budget_s, stage=stage, torch_split=False)
            finally:
                for h in handles:
                    h.remove()
    return out


def _slow_path_lines(report: SplitRun) -> list[str]:
    """The slow paths' lines (Note [slow paths timed]): per path and regime, the full backward's, B's and W's ms
    and B+W over that full backward, under the default path's row of the same configuration where it ran."""
    if not report.slow_paths:
        return []
    name = next(iter(report.slow_paths.values())).name
    rows: list[tuple[str, SplitConfig]] = [("default", c) for c in report.split.configs if c.name == name]
    rows += list(report.slow_paths.items())
    lines = [
        f"\nSlow paths timed (Note [slow paths timed]; {name}): ms (min of N), B+W over ppbackward's full "
        "backward of the same graph (min/min; median)"
    ]
    for path, c in rows:
        for regime in REGIMES:
            t, ratios = c.times(regime), c.ratios_of(regime)
            if "pp" not in ratios:
                continue
            ms, bw = t.variants["pp"], ratios["pp"].bw
            lines.append(
                f"  {path:<20} {regime:<12} N={c.repeats:<3} full {t.full:6.2f}  B {ms.b:6.2f}  W {ms.w:6.2f}  "
                f"B+W {bw.min_ratio:.2f}x ({bw.median:.2f})"
            )
    return lines


def graph_nodes(stage: Stage) -> int:
    """The number of autograd nodes one microbatch's backward of ``stage`` walks (its graph below the
    output, down to the stage input and the parameters' ``AccumulateGrad`` nodes)."""
    from ppbackward._graph import analyze, gradient_edge

    out = stage.model(stage.x)
    return len(analyze([gradient_edge(out)], {gradient_edge(stage.x).node}).structure.nodes)


def held_bytes(stage: Stage) -> HeldBytes:
    """CUDA allocator bytes alive between B and W beyond what the stage holds after W, per split
    (``pp``, ``torch``): ``memory_allocated`` right after B minus right after W, the stage output
    kept alive throughout as ``PipelineStage`` keeps it (the parameter grads exist before: accumulating
    regime, so W allocates none)."""
    out_bytes: dict[str, int] = {}
    prepare_regime(stage, "accumulating")
    splits: dict[str, Split] = {
        "pp": (_ours.stage_backward_input, _ours.stage_backward_weight),
        "torch": (UPSTREAM_B, UPSTREAM_W),
    }
    for name, (b, w) in splits.items():
        stage.x.grad = None
        out = stage.model(stage.x)
        _, groups = b((out,), (stage.grad,), [stage.x], iter(stage.params))
        torch.cuda.synchronize()
        after_b = torch.cuda.memory_allocated()
        w(iter(stage.params), groups)
        del groups
        torch.cuda.synchronize()
        out_bytes[name] = after_b - torch.cuda.memory_allocated()
        del out
    reset_grads(stage)
    return HeldBytes(pp=out_bytes["pp"], torch=out_bytes["torch"])


def measure(
    configs: tuple[Config, ...] | list[Config] = CONFIGS,
    repeats: int = 60,
    budget_s: float | None = 15.0,
    extra: dict[str, Split] | None = None,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> SplitResult:
    """:func:`measure_config` for each configuration (torch's thread count at 1), each with the
    replayed steps (``_replay.replay``, 2 and 4 ranks, 8 microbatches) from its accumulating-regime
    costs (a step's microbatches after the first accumulate). ``progress``: called with
    ``"configuration i/n: <label>"`` as each configuration starts (``run`` prints it on stderr)."""
    from ppbackward._tools.bench import replay as _replay

    with one_torch_thread():
        out = []
        for i, cfg in enumerate(configs, 1):
            if progress is not None:
                progress(f"configuration {i}/{len(configs)}: {cfg.label} ({cfg.name})")
            c = measure_config(cfg, repeats, budget_s, extra, device)
            t = c.times("accumulating")
            costs = SplitCosts(F=t.fwd, full=t.full, B=t.variants["pp"].b, W=t.variants["pp"].w)
            replay = {f"{r} ranks": _replay.replay(costs, ranks=r) for r in (2, 4)}
            out.append(dataclasses.replace(c, costs_ms=costs, replay=replay))
        return SplitResult(device=str(torch.device(device)), configs=out)


def targets(result: SplitResult, schedule: ScheduleBench | None = None) -> list[dict[str, Any]]:
    """The split's targets as rows of ``report.targets`` (``report.target_row``): B+W over the full
    backward per configuration and regime, B alone <= the full backward; with the real torchrun step
    (``schedule``, from ``schedule_bench.run_schedule``), :func:`_real_step_targets`."""
    from ppbackward._tools.bench.report import target_row

    rows = []
    for c in result.configs:
        for regime in REGIMES:
            pp = c.ratios_of(regime)["pp"]
            where = f"{c.label}, {regime}, {result.device}"
            if c.limit_bw is not None:
                name = f"split: B+W <= {c.limit_bw:.2f}x full backward"
                rows.append(target_row(name, where, pp.bw.min_ratio, c.limit_bw, pp.bw.median))
            rows.append(target_row("split: B alone <= 1.00x full backward", where, pp.b.min_ratio, 1.0, pp.b.median))
    if schedule is not None:
        rows += _real_step_targets(schedule)
    return rows


#: The real step's targets: each zero-bubble schedule's step over the Interleaved1F1B step (torch's backward).
STEP_LIMITS = {"ZBVZeroBubble": 1.0, "InterleavedZeroBubble": 1.05}


def _real_step_targets(schedule: ScheduleBench, label: str = "real step") -> list[dict[str, Any]]:
    """The real step's targets: ppbackward's full backward in Interleaved1F1B <= 1.01x torch's,
    ZBVZeroBubble <= 1.00x and InterleavedZeroBubble <= 1.05x the Interleaved1F1B step (each variant that
    ran); ``label`` starts each target's name (``bench --compile``: ``compiled real step``)."""
    from ppbackward._tools.bench.report import target_row

    rows = []
    where = f"torchrun {schedule.ranks} ranks, d {schedule.d_model}, {schedule.microbatches} microbatches"
    if schedule.compile:
        where += f", {schedule.compile}"
    plain = schedule.ratio_to_1f1b.get("Interleaved1F1B/ppbackward")
    if plain is not None:  # a user who installs ppbackward for correctness must not pay in a plain schedule
        name = f"{label}: Interleaved1F1B, ppbackward's full backward <= 1.01x torch's"
        rows.append(target_row(name, where, plain, 1.01))
    for zb, limit in STEP_LIMITS.items():
        for backward in ("ppbackward", "merged"):
            value = schedule.ratio_to_1f1b.get(f"{zb}/{backward}")
            if value is not None:
                name = f"{label}: {zb} ({backward}) <= {limit:.2f}x Interleaved1F1B"
                rows.append(target_row(name, where, value, limit))
    return rows


def format_split(result: SplitResult) -> str:
    """The split table: per configuration and regime, ms and ratios to the full backward (and, on CUDA,
    the allocator bytes held between B and W); then the host cost per node (:func:`_per_node_lines`) and the
    replayed steps (:func:`_replay_lines`), each heading directly above its own rows."""
    lines = [
        "Split cost per microbatch-stage: ms (min of N) and ratio to ppbackward's full stage_backward "
        "(min/min; median [q1-q3] of per-repeat ratios)"
    ]
    for c in result.configs:
        for regime in REGIMES:
            t, ratios = c.times(regime), c.ratios_of(regime)
            cells = [f"{c.label:<13} {regime:<12} N={c.repeats:<3} full {t.full:7.2f}"]
            for v in sorted(ratios):
                ms, bw, b = t.variants[v], ratios[v].bw, ratios[v].b
                cells.append(
                    f"{v}: B {ms.b:.2f} W {ms.w:.2f} B+W {bw.min_ratio:.2f}x "
                    f"({bw.median:.2f} [{bw.q1:.2f}-{bw.q3:.2f}]) B/full {b.min_ratio:.2f}x"
                )
            lines.append("  ".join(cells))
        if c.held_bytes is not None:
            h = c.held_bytes
            lines.append(
                f"{'':<13} CUDA allocator bytes held between B and W (freed by W): pp {h.pp}, torch {h.torch}"
            )
    return "\n".join(lines + _per_node_lines(result) + _replay_lines(result))


def _replay_lines(result: SplitResult) -> list[str]:
    """Per configuration and rank count, each zero-bubble schedule's replayed step over Interleaved1F1B's:
    ideal, measured and merged costings (Note [replayed step]), with the share of W merged."""
    lines = [
        "\nReplayed step (Note [replayed step]: torch's action lists, these costs, zero communication; "
        "ratio to Interleaved1F1B; merged: B directly followed by its W run as one full backward)"
    ]
    for c in result.configs:
        for ranks, rp in c.replay.items():
            r = rp.ratio_to_1f1b
            cells = [f"{c.label:<13} {ranks}, {rp.microbatches} mb:"]
            for zb in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"):
                short = zb.replace("Schedule", "").replace("ZeroBubble", "ZB")
                cells.append(
                    f"{short} ideal {r[zb + '/ideal']:.2f}x measured {r[zb + '/measured']:.2f}x "
                    f"merged {r[zb + '/merged']:.2f}x ({rp.merged_share[zb]:.0%} of W merged)"
                )
            lines.append("  ".join(cells))
    return lines


def _per_node_lines(result: SplitResult) -> list[str]:
    """Host cost per autograd node (accumulating regime): the full backward's, B's, W's and what B+W cost
    beyond the full backward, in µs per node of the stage's graph (configurations without a node count
    are left out)."""
    lines = ["\nHost cost per autograd node (accumulating, us per node of the stage graph)"]
    for c in result.configs:
        nodes = c.nodes
        if not nodes:
            continue
        t = c.times("accumulating")
        pp = t.variants["pp"]
        full, b, w, bw = (1e3 * ms / nodes for ms in (t.full, pp.b, pp.w, pp.bw))
        lines.append(
            f"  {c.label:<13} {nodes:5d} nodes  full {full:6.2f}  B {b:6.2f}"
            f"  W {w:6.2f}  B+W - full {bw - full:+6.2f}"
        )
    return lines


def run(args: Any, meta: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``ppbackward bench --split``: measure, replay, optionally the real torchrun step and the one-rank
    step (``one_rank``); print. Returns the exit code (0, or 1 when a schedule run failed or its grads differ)
    and the JSON report (``records.SplitRun.to_report``), which ``bench`` writes to ``--json``."""
    from ppbackward._tools.bench import report as _report
    from ppbackward._tools.harness import models as _models

    configs = list(CONFIGS) if args.configs in (None, "all") else _models.parse_configs(args.configs)
    if args.quick:
        configs = [Config(4, 64, 16)]
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 60)
    device = torch.device(args.device)  # a CUDA device the machine has: checked with the options
    t0 = time.perf_counter()

    def progress(what: str) -> None:  # one line per configuration and run on stderr, as check's progress
        print(f"bench --split: {what} (elapsed {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

    split = measure(configs, repeats, None if args.quick else args.budget, device=device, progress=progress)
    report = SplitRun(meta=meta, split=split)
    report.calls = [c._asdict() for c in _calls.count_all()]
    if device.type == "cpu":  # Note [slow paths timed]
        progress("the slow paths")
        report.slow_paths = measure_slow_paths(
            configs[0] if args.quick else _calls.COUNT_CONFIGS[0], repeats, None if args.quick else args.budget
        )
    if args.schedule:
        progress("the real step under torchrun")
    failed = _real_step(args, report) if args.schedule else False
    if args.trace and report.schedule is not None:
        _write_traces(args.trace, report)
    if args.plot:
        from ppbackward._tools.bench import plots as _plots

        for path in _plots.write_plots(args.plot, report.split):
            print(f"bench: wrote {path}", file=sys.stderr)
    if args.one_rank_step:
        progress("the one-rank step")
        report.one_rank_step = _one_rank_step(args, device)
        failed = failed or not report.one_rank_step.get("grads_match", False)
    report.targets = targets(report.split, report.schedule)
    report.meta["loadavg_end"] = loadavg()
    print(format_run(report, _report))
    return (1 if failed else 0), report.to_report()


def _real_step(args: Any, report: SplitRun) -> bool:
    """``--schedule``: the real torchrun step into ``report`` (or why it failed); whether it failed or its
    grads differ."""
    from ppbackward._tools.harness import schedule_bench as _schedule

    try:
        report.schedule = _schedule.run_schedule(
            repeats=2 if args.quick else args.schedule_repeats, timeout_s=args.schedule_timeout,
            d_model=args.schedule_d_model,
        )
    except _schedule.ScheduleBenchError as e:
        report.schedule_error = str(e)
        return True
    return not report.schedule.grads_match


def _config_of(split: SplitResult, sched: ScheduleBench) -> SplitConfig | None:
    """The split configuration of the real step's stage shape (``layers_per_stage``, ``d_model``, ``seq``)
    and microbatch size; ``None`` when none was measured."""
    shape = f"{sched.layers_per_stage}x{sched.d_model}x{sched.seq}"  # Config.name
    config = next((c for c in split.configs if c.name == shape), None)
    return config if config is not None and config.batch == sched.microbatch_size else None


def _write_traces(folder: str, report: SplitRun) -> None:
    """``--trace``: the real step's traces, with the replayed step where ``--split`` measured the same stage
    shape and microbatch size (Note [step traces])."""
    from ppbackward._tools.bench import trace as _trace

    assert report.schedule is not None
    config = _config_of(report.split, report.schedule)
    for path in _trace.write_traces(folder, report.schedule, config.costs_ms if config else None):
        print(f"bench: wrote {path}", file=sys.stderr)


def _one_rank_step(args: Any, device: torch.device) -> dict[str, Any]:
    """``--one-rank-step``: ``_one_rank.measure`` (tiny with ``--quick``), or ``{"error": why}``."""
    from ppbackward._tools.bench import one_rank as _one_rank

    cfg = _one_rank.QUICK if args.quick else _one_rank.OneRankConfig(
        d_model=args.schedule_d_model, repeats=args.schedule_repeats
    )
    try:
        return _one_rank.measure(cfg, device)
    except RuntimeError as e:
        return {"error": str(e)}


def replayed_steps(split: SplitResult, sched: ScheduleBench) -> dict[str, float]:
    """``{real-step variant name: replayed step ms}`` from the split configuration of the real step's stage
    shape and microbatch size (:func:`_config_of`) replayed at its rank and microbatch counts; ``{}`` when
    none was. ppbackward's variants get the replay of ppbackward's costs (``merged``: the merged replay);
    torch's zero-bubble variants have none (the replay is of ppbackward's split)."""
    config = _config_of(split, sched)
    rp = None if config is None else config.replay.get(f"{sched.ranks} ranks")
    if rp is None or rp.microbatches != sched.microbatches:
        return {}
    ms = rp.step_ms
    out = {f"Interleaved1F1B/{b}": ms["ScheduleInterleaved1F1B"] for b in ("upstream", "ppbackward")}
    for zb in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        out[f"{zb}/ppbackward"] = ms[f"Schedule{zb}/measured"]
        out[f"{zb}/merged"] = ms[f"Schedule{zb}/merged"]
    return out


def format_run(report: SplitRun, rep: Any) -> str:
    """The ``--split`` report: header, split and replay tables, the real step (:func:`_real_step_text`),
    the one-rank step, the targets; ``rep`` is ``bench.report``."""
    m = report.meta
    parts = [
        f"ppbackward bench --split  {m['date']}  torch {m['torch']}  device {report.split.device}  "
        f"{m['cpu_count']} CPU cores, 1 torch thread; ppbackward {m.get('ppbackward_commit')}; "
        f"1-min load average {m.get('loadavg_start')} at start, {m.get('loadavg_end')} at end; "
        f"CPU allocator: {m.get('allocator', 'not recorded')}",
        format_split(report.split),
        *_calls.format_calls([_calls.CallCounts(**c) for c in report.calls]),
        *_slow_path_lines(report),
    ]
    if report.schedule_error is not None:
        parts.append(f"\nReal step: ERROR\n{report.schedule_error}")
    elif report.schedule is not None:
        parts.append(_real_step_text(report.schedule, report.split, rep))
    if report.one_rank_step is not None:
        from ppbackward._tools.bench.one_rank import format_one_rank

        parts.append(format_one_rank(report.one_rank_step))
    parts.append(rep.targets_table(report.targets, 'docs/performance.md, "The split\'s host cost"'))
    return "\n".join(parts)


def _real_step_text(sched: ScheduleBench, split: SplitResult, rep: Any) -> str:
    """The real step's line of ratios to Interleaved1F1B, then its step parts beside the replayed steps."""
    from ppbackward._tools.harness.records import to_json

    return (
        f"\nReal step (torchrun {sched.ranks} ranks, {sched.stages} stages x "
        f"{sched.layers_per_stage} layers d {sched.d_model} s {sched.seq}, "
        f"{sched.microbatches} microbatches; min of {sched.repeats} steps; ratio to Interleaved1F1B "
        "with torch's backward; merged: built under install(merge_bw=True), each B directly followed by "
        "its own W run as one full backward; on shared cores these ratios move by tens of percent between "
        "runs, docs/performance.md): "
        + "  ".join(f"{k} {v:.2f}x" for k, v in sched.ratio_to_1f1b.items())
        + rep.step_parts_table(to_json(sched), replayed_steps(split, sched))
    )
