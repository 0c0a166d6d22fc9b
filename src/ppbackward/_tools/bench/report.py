"""The benchmark's targets, its printed report and the JSON report's records.

Private module. Each target yields one row per configuration it applies to, ``PASS`` or ``MISS``
with the measured ratio and the limit; nothing here is asserted by tests (timings are noisy). The
text report is a list of renderers (:data:`SECTIONS`), one per section: each takes the report (a
``dict``, what ``ppbackward bench --json`` writes) and returns its section's text, ``""`` where the
report lacks it; ``format_text`` joins them. Their output is kept byte for byte by
``tests/bench/test_report_golden.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ppbackward._tools.text_table import format_table

__all__ = [  # private module: what other modules use
    "SECTIONS",
    "STEP_SECTIONS",
    "format_text",
    "step_parts_table",
    "summary_line",
    "target_row",
    "targets",
]

MiB = float(2**20)
REGIMES = ("first", "accumulating")  # _timing.REGIMES, without importing torch
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")

Report = dict[str, Any]
Target = dict[str, Any]


def target_row(name: str, where: str, value: float, limit: float, median: float | None = None) -> Target:
    """One target row; ``value`` (ratio of minima) decides, ``median`` (paired) is shown beside it."""
    return {
        "target": name,
        "where": where,
        "value": value,
        "median_paired": median,
        "limit": limit,
        "status": "PASS" if value <= limit else "MISS",
    }


# --- targets, one generator per feature measured, in the order of the printed table ---


def _plain_targets(report: Report) -> Iterator[Target]:
    """ppbackward's B+W against plain autograd, on the 16-layer configurations (d 256 and d 64)."""
    for regime in REGIMES:
        for c in report["configs"]:
            r, pm = c["ratio_to_plain"][regime], c["paired_ratio_median"][regime]
            where = f"{c['label']}, {regime}"
            if c["layers"] == 16 and c["d_model"] == 256:
                yield target_row(
                    "ppbackward B+W <= 1.15x plain (16 layers, d 256)", where, r["ppbackward_bw"], 1.15,
                    pm["ppbackward_bw/plain"],
                )
            if c["layers"] == 16 and c["d_model"] == 64:
                yield target_row(
                    "ppbackward B+W <= 2.0x plain (16 layers, d 64)", where, r["ppbackward_bw"], 2.0,
                    pm["ppbackward_bw/plain"],
                )


def _upstream_targets(report: Report) -> Iterator[Target]:
    """ppbackward's B+W never slower than torch's, per configuration and regime."""
    for regime in REGIMES:
        for c in report["configs"]:
            t, pm = c["time_ms"][regime], c["paired_ratio_median"][regime]
            yield target_row(
                "ppbackward B+W never slower than upstream B+W", f"{c['label']}, {regime}",
                t["ppbackward_bw"] / t["upstream_bw"], 1.0, pm["ppbackward_bw/upstream_bw"],
            )


def _loop_targets(report: Report) -> Iterator[Target]:
    """The microbatch loop with ppbackward never slower than with torch's split."""
    for c in report["configs"]:
        t = c["loop"]["time_ms"]
        yield target_row(
            "ppbackward microbatch loop never slower than upstream's", c["label"], t["ppbackward"] / t["upstream"], 1.0
        )


def _schedule_targets(report: Report) -> Iterator[Target]:
    """The zero-bubble schedule steps under torchrun: against Interleaved1F1B, torch's, and their saved bytes."""
    sched = report.get("schedule")
    if not (sched and "step_ms" in sched):
        return
    ms, mem = sched["step_ms"], sched["memory"]
    for zb in ZERO_BUBBLE:
        pp, up = f"{zb}/ppbackward", f"{zb}/upstream"
        where = f"{zb}, torchrun {sched['ranks']} ranks"
        for backward in ("ppbackward", "merged"):
            if f"{zb}/{backward}" in ms:
                yield target_row(
                    f"zero-bubble step ({backward}) <= 1.0x Interleaved1F1B step (torch)", where,
                    sched["ratio_to_1f1b"][f"{zb}/{backward}"], 1.0,
                )
        yield target_row("zero-bubble step: ppbackward <= 0.9x torch's", where, ms[pp] / ms[up], 0.9)
        yield target_row(
            "zero-bubble peak live saved bytes: ppbackward <= torch's", where,
            mem[pp]["saved_peak_bytes"] / mem[up]["saved_peak_bytes"], 1.0,
        )


def _full_targets(report: Report) -> Iterator[Target]:
    """ppbackward's full stage backward against plain autograd, per configuration and regime."""
    for regime in REGIMES:
        for c in report["configs"]:
            yield target_row(
                "full stage_backward within 5% of plain", f"{c['label']}, {regime}",
                c["ratio_to_plain"][regime]["full"], 1.05, c["paired_ratio_median"][regime]["full/plain"],
            )


def _device_work_targets(report: Report) -> Iterator[Target]:
    """B+W's counted kernels and FLOPs against the full backward's, and the bytes held between B and W
    against those with the norm and bias gradients deferred to W (configurations with device work)."""
    for c in report["configs"]:
        dw = c.get("device_work")
        if not dw:
            continue
        for regime, work in dw["regimes"].items():
            diff = _kernel_diff(work, "ppbackward")
            name = "device work: B+W kernels = full backward's (count of differing kernels <= 0)"
            if regime == "first":  # docs/performance.md, "Device work": the copies into an empty .grad
                diff = _without_grad_copies(diff)
                name = "device work: B+W kernels = full backward's, .grad copies aside (others <= 0)"
            yield target_row(name, f"{c['label']}, {regime}", sum(map(abs, diff.values())), 0)
            yield target_row(
                "device work: B+W FLOPs <= 1.000x full backward's", f"{c['label']}, {regime}",
                work["ppbackward"]["flops"] / max(work["full"]["flops"], 1), 1.0,
            )
        yield target_row(
            "held between B and W <= 0.80x with norm/bias gradients deferred to W", c["label"],
            dw["held_bytes"] / max(dw["held_deferred_bytes"], 1), 0.80,
        )


def _memory_targets(report: Report) -> Iterator[Target]:
    """The bytes held between B and W equal to what W reads: without hooks, then with saved-tensor hooks."""
    for c in report["configs"]:
        yield target_row(
            "bytes held between B and W = bytes W reads (1.00x)", c["label"],
            c["memory"]["ppbackward"]["held_over_floor"], 1.0,
        )
    for c in report["configs"]:
        yield target_row(
            "with saved-tensor hooks too: held = what W unpacks (1.00x)", c["label"],
            c["memory"]["ppbackward"]["hooked"]["held_over_floor"], 1.0,
        )


def _scaling_targets(report: Report) -> Iterator[Target]:
    """The benchmark's own check: the graph analysis' cost per node and edge stays flat as the graph grows."""
    fit = (report.get("analysis_scaling") or {}).get("fit") or {}
    if "per_unit_growth" in fit:
        sweep = "1..32 layers" if len(report["analysis_scaling"]["points"]) > 3 else "quick"
        yield target_row(
            "[bench check] analysis linear: us/(node+edge) largest/smallest <= 1.5", sweep,
            fit["per_unit_growth"], 1.5,
        )


TARGETS: tuple[Callable[[Report], Iterator[Target]], ...] = (
    _plain_targets, _upstream_targets, _loop_targets, _schedule_targets, _full_targets, _device_work_targets,
    _memory_targets, _scaling_targets,
)


def targets(report: Report) -> list[Target]:
    """The benchmark's targets (docs/performance.md, "Targets of 0.1.0") evaluated on ``report``: the records of
    :func:`target_row` of every generator of :data:`TARGETS`, in its order."""
    return [row for evaluate in TARGETS for row in evaluate(report)]


def _kernel_diff(work: dict[str, Any], impl: str) -> dict[str, int]:
    """Kernels by name ``impl`` ran more (+) or fewer (-) times than the full backward."""
    mine, full = work[impl]["kernels"], work["full"]["kernels"]
    diff = {k: mine.get(k, 0) - full.get(k, 0) for k in sorted(set(mine) | set(full))}
    return {k: n for k, n in diff.items() if n}


def _without_grad_copies(diff: dict[str, int]) -> dict[str, int]:
    """``diff`` less the first microbatch's copies into ``.grad``: with ``.grad`` empty, W's ``AccumulateGrad``
    copies each weight gradient B computed (one ``new_empty_strided`` and one ``copy_`` each), which B holds
    until W, where a full backward's ``AccumulateGrad`` takes its gradient over without a copy. Left in where
    the two counts differ (then something else ran too). The number of pairs is not checked here: the bench
    does not know how many gradients B computed; ``tests/core/test_device_work.py`` asserts every count."""
    copies = diff.get("copy_", 0)
    if copies <= 0 or diff.get("new_empty_strided", 0) != copies:
        return diff
    return {k: n for k, n in diff.items() if k not in ("copy_", "new_empty_strided")}


def _diff_text(diff: dict[str, int]) -> str:
    return ", ".join(f"{'+' if n > 0 else ''}{n} {k}" for k, n in diff.items()) or "none"


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _mib(nbytes: int | None, digits: int = 1) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.{digits}f}"


# --- the text report: one renderer per section ---


def header_section(report: Report) -> str:
    """The run's first line (date, torch, python, cores, threads, platform) and, when the report has a
    commit or a load average, a second one (ppbackward's version and commit, the 1-min load average at
    start and end)."""
    m = report["meta"]
    text = (
        f"ppbackward bench  {m['date']}  torch {m['torch']}  python {m['python']}  "
        f"{m['cpu_count']} CPU cores, {m['threads']} torch thread  {m['platform']}"
    )
    if m.get("ppbackward_commit") or m.get("loadavg_start") is not None:
        text += (
            f"\nppbackward {m.get('ppbackward')} ({m.get('ppbackward_commit') or 'commit unknown'}); "
            f"1-min load average {m.get('loadavg_start')} at start, {m.get('loadavg_end')} at end"
        )
    return text


def _time_row(c: dict[str, Any], regime: str) -> list[str]:
    """One configuration's row of the time table in ``regime``."""
    t, r = c["time_ms"][regime], c["ratio_to_plain"][regime]
    return [
        c["label"], regime, str(c["repeats"]), f"{t['plain']:.2f}",
        f"{t['upstream_b']:.2f}", f"{t['upstream_w']:.2f}", f"{t['upstream_bw']:.2f}", _x(r["upstream_bw"]),
        f"{t['ppbackward_b']:.2f}", f"{t['ppbackward_w']:.2f}", f"{t['ppbackward_bw']:.2f}", _x(r["ppbackward_bw"]),
        f"{t['full']:.2f}", _x(r["full"]), f"{t['ppbackward_bw'] / t['upstream_bw']:.2f}",
        f"{c['param_groups']['upstream']}/{c['param_groups']['ppbackward']}",
        "yes" if all(c["grads_match"].values()) else "NO",
    ]


def time_section(report: Report) -> str:
    """The backward's time table: per configuration and regime, ms of plain autograd, torch's B, W and
    B+W, ppbackward's B, W, B+W and full backward, ratios to plain, param groups, exactness."""
    rows = [_time_row(c, regime) for c in report["configs"] for regime in REGIMES]
    return (
        "\nTime: backward only, ms, min of N interleaved repeats; (x) = ratio to plain autograd.backward;"
        " regime first: every .grad None, accumulating: grads kept\n"
        + format_table(
            ["config", "regime", "N", "plain", "up B", "up W", "up B+W", "(x)", "pp B", "pp W", "pp B+W", "(x)",
             "pp full", "(x)", "pp/up", "groups up/pp", "exact"],
            rows, left=2,
        )
    )


def loop_section(report: Report) -> str:
    """The microbatch loop's table: ms of a zero-bubble order of F, B, W per configuration, plain, with
    torch's split and with ppbackward's; ``""`` without a configuration."""
    rows = []
    for c in report["configs"]:
        lp = c["loop"]
        t, r = lp["time_ms"], lp["ratio_to_plain"]
        rows.append([
            c["label"], str(lp["repeats"]), f"{t['plain']:.1f}", f"{t['upstream']:.1f}", _x(r["upstream"]),
            f"{t['ppbackward']:.1f}", _x(r["ppbackward"]), f"{t['ppbackward'] / t['upstream']:.2f}",
        ])
    if not rows:
        return ""
    lp = report["configs"][0]["loop"]
    return (
        f"\nMicrobatch loop: one rank's F, B, W of 2 stages (half the layers each) x {lp['microbatches']} "
        "microbatches in ScheduleInterleavedZeroBubble's order, grads accumulating, forwards included; "
        "ms, min of N; plain = full backward at B, nothing at W\n"
        + format_table(["config", "N", "plain", "upstream", "(x)", "ppbackward", "(x)", "pp/up"], rows)
    )


def allocator_section(report: Report) -> str:
    """The allocator's table: allocations and MiB allocated during one backward, per configuration and
    regime, of plain autograd, torch's B+W, ppbackward's B+W and full backward."""
    rows = []
    for c in report["configs"]:
        for regime in REGIMES:
            a = c["allocations"][regime]
            rows.append([c["label"], regime] + [
                f"{a[v]['allocations']} / {a[v]['bytes'] / MiB:.2f}"
                for v in ("plain", "upstream", "ppbackward", "full")
            ])
    return (
        "\nAllocator: allocations / MiB allocated during one backward (torch.profiler, profile_memory)\n"
        + format_table(["config", "regime", "plain", "upstream B+W", "ppbackward B+W", "ppbackward full"], rows, left=2)
    )


def _memory_table(report: Report, pick: Callable[[dict[str, Any]], dict[str, Any]], total: str) -> str:
    """Held against floor bytes per configuration, for ``pick(config["memory"][impl])``; ``total``
    names the figure of everything saved (``saved_bytes`` or ``packed_bytes``)."""
    rows = []
    for c in report["configs"]:
        u, p = pick(c["memory"]["upstream"]), pick(c["memory"]["ppbackward"])
        rows.append([
            c["label"], f"{u[total + '_bytes'] / MiB:.3f}",
            f"{u['held_bytes'] / MiB:.3f}", f"{u['floor_bytes'] / MiB:.3f}", _x(u["held_over_floor"]),
            f"{p['held_bytes'] / MiB:.3f}", f"{p['floor_bytes'] / MiB:.3f}", _x(p["held_over_floor"]),
            f"{u['after_w_bytes']}/{p['after_w_bytes']}",
        ])
    return format_table(
        ["config", total, "up held", "up floor", "up held/floor", "pp held", "pp floor", "pp held/floor",
         "bytes after W up/pp"],
        rows,
    )


def memory_section(report: Report) -> str:
    """The saved activations alive between B and W against what W reads, torch's and ppbackward's."""
    return (
        "\nMemory: saved activations (MiB, unique storages, parameters excluded) alive between B and W;"
        " floor = what W reads\n" + _memory_table(report, lambda m: m, "saved")
    )


def hooked_memory_section(report: Report) -> str:
    """The same with a user's saved-tensor hooks: the packed copies alive between B and W against what W
    unpacks."""
    return (
        "\nMemory with a user's saved-tensor hooks (pack keeps a copy, as offloading does): MiB of those copies"
        " alive between B and W; floor = what W unpacks (ppbackward's B does W's work where hooks are)\n"
        + _memory_table(report, lambda m: m["hooked"], "packed")
    )


def _device_work_rows(configs: list[dict[str, Any]]) -> list[list[str]]:
    """Rows of the device work table: per configuration and regime, the full backward's kernel count,
    then torch's and ppbackward's FLOPs and bytes over the full backward's and their kernels' difference."""
    rows = []
    for c in configs:
        for regime, work in c["device_work"]["regimes"].items():
            full = work["full"]
            row = [c["label"], regime, str(sum(full["kernels"].values()))]
            for impl in ("upstream", "ppbackward"):
                w = work[impl]
                row += [
                    f"{w['flops'] / full['flops']:.3f}x" if full["flops"] else "-",
                    f"{w['allocated_bytes'] / full['allocated_bytes']:.3f}x" if full["allocated_bytes"] else "-",
                    _diff_text(_kernel_diff(work, impl)),
                ]
            rows.append(row)
    return rows


def device_work_section(configs: list[dict[str, Any]]) -> str:
    """The counted device work of B+W against one full backward, torch's split beside it, per
    configuration and regime; and the saved bytes held between B and W (ppbackward._tools.bench.device_work)."""
    held = [
        [c["label"], _mib(c["device_work"]["held_deferred_bytes"], 3), _mib(c["device_work"]["held_bytes"], 3),
         _x(c["device_work"]["held_bytes"] / c["device_work"]["held_deferred_bytes"]),
         _mib(c["device_work"]["floor_bytes"], 3)]
        for c in configs
    ]
    return (
        "\nDevice work of one microbatch's backward, counted (every ATen op dispatched, views aside; FLOPs by"
        " torch.utils.flop_counter): B+W against the full backward; 'kernels' lists what B+W ran more (+) or"
        " fewer (-) times\n"
        + format_table(
            ["config", "regime", "full kernels", "up FLOPs", "up bytes", "up kernels", "pp FLOPs", "pp bytes",
             "pp kernels"],
            _device_work_rows(configs), left=2,
        )
        + "\nSaved activations held between B and W (MiB): ppbackward with the norm and bias gradients"
        " deferred to W (before), computed in B (now), and what W's deferred matmuls read\n"
        + format_table(["config", "before", "now", "now/before", "W reads"], held)
    )


def device_work_report_section(report: Report) -> str:
    """:func:`device_work_section` of the report's configurations; ``""`` unless every one has device work."""
    if not all("device_work" in c for c in report["configs"]):
        return ""
    return device_work_section(report["configs"])


def scaling_section(report: Report) -> str:
    """The graph analysis' time against the graph's size (layers, nodes, edges; ppbackward's and torch's
    analysis in us), then the linear fit's line when there is one; ``""`` without the sweep."""
    scaling = report.get("analysis_scaling")
    if not scaling:
        return ""
    rows = [
        [str(p["layers"]), str(p["nodes"]), str(p["edges"]), str(p["size"]), f"{p['analyze_us']:.0f}",
         f"{p['us_per_unit']:.3f}", f"{p['upstream_us']:.0f}" if "upstream_us" in p else "-"]
        for p in scaling["points"]
    ]
    fit = scaling["fit"]
    return (
        "\nGraph analysis (ppbackward._graph.analyze) vs graph size, d 64 s 16\n"
        + format_table(["layers", "nodes", "edges", "nodes+edges", "analyze us", "us/(node+edge)", "upstream us"], rows)
        + (
            f"\nfit: t = {fit['intercept_us']:.0f} us + {fit['us_per_unit']:.3f} us x (nodes+edges), "
            f"R^2 = {fit['r2']:.4f}; us/(node+edge) largest/smallest = {fit['per_unit_growth']:.2f}"
            if fit else ""
        )
    )


def profile_section(report: Report) -> str:
    """Where the time goes: per implementation and phase (B, W), the engine calls, node calls, matmuls,
    AccumulateGrad calls and cProfile's ms split into engine, analysis, hooks and other Python, then one
    line per implementation of its param groups and its work beyond plain autograd; ``""`` without it."""
    prof = report.get("profile")
    if not prof:
        return ""
    rows = []
    for impl in ("upstream", "ppbackward"):
        d = prof[impl]
        for phase in ("b", "w"):
            s, c = d["profile"][phase], d[phase]
            rows.append([
                impl, phase.upper(), f"{s['engine_calls']:.0f}", str(c["node_calls"]), str(c["matmuls"]),
                str(c["accumulate_grad"]), f"{s['total_ms']:.2f}", f"{s['engine_ms']:.2f}",
                f"{s['analysis_ms']:.2f}", f"{s['hooks_ms']:.2f}", f"{s['python_other_ms']:.2f}",
            ])
    pl = prof["plain"]
    return (
        f"\nWhere the time goes ({prof['config']}, {prof['params']} parameters; plain backward: 1 engine call, "
        f"{pl['node_calls']} node calls, {pl['matmuls']} matmuls, {pl['accumulate_grad']} AccumulateGrad; "
        "times: cProfile, ms per call, inflated by profiling)\n"
        + format_table(
            ["impl", "phase", "engine calls", "node calls", "matmuls", "AccumulateGrad", "total", "engine",
             "analysis", "hooks", "python other"],
            rows, left=2,
        )
        + "\n"
        + "\n".join(
            f"{impl}: {prof[impl]['param_groups']} param groups; B+W minus plain: "
            f"{prof[impl]['extra_node_calls']} node calls, {prof[impl]['extra_matmuls']} matmuls"
            for impl in ("upstream", "ppbackward")
        )
    )


def schedule_section(report: Report) -> str:
    """The schedule step under torchrun: per variant (schedule and backward), the step's ms, its ratio to
    Interleaved1F1B's and to torch's backward, peak RSS, RSS growth and peak saved MiB, then
    :func:`step_parts_table`; the error when the run failed; ``""`` without it."""
    sched = report.get("schedule")
    if not sched:
        return ""
    if "error" in sched:
        return f"\nSchedule step: ERROR\n{sched['error']}"
    rows = []
    for name in sched["variants"]:
        m = sched["memory"][name]
        schedule, backward = name.split("/")
        other = f"{schedule}/upstream"
        rows.append([
            schedule, backward, f"{sched['step_ms'][name]:.1f}", _x(sched["ratio_to_1f1b"][name]),
            f"{sched['step_ms'][name] / sched['step_ms'][other]:.2f}" if backward != "upstream" else "",
            _mib(m["rss_peak_bytes"]), _mib(m["rss_growth_bytes"]), _mib(m["saved_peak_bytes"], 2),
        ])
    return (
        f"\nSchedule step (torchrun {sched['ranks']} ranks gloo, 1 thread each; {sched['stages']} stages x "
        f"{sched['layers_per_stage']} layers d {sched['d_model']} s {sched['seq']}, {sched['microbatches']} "
        f"microbatches of {sched['microbatch_size']}, static stage metadata; step ms = slowest rank, min of "
        f"{sched['repeats']}, variants alternated; memory: max over ranks, MiB; grads match 1F1B/torch: "
        f"{'yes' if sched['grads_match'] else 'NO'})\n"
        + format_table(
            ["schedule", "backward", "step ms", "vs 1F1B", "pp/up", "peak RSS", "RSS growth", "saved peak"],
            rows, left=2,
        )
        + step_parts_table(sched)
    )


def targets_section(report: Report) -> str:
    """:func:`targets_table` of the report's targets, set in docs/performance.md."""
    return targets_table(report["targets"], "docs/performance.md")


#: The sections of the text report, in their order.
SECTIONS: tuple[Callable[[Report], str], ...] = (
    header_section, time_section, loop_section, allocator_section, memory_section, hooked_memory_section,
    device_work_report_section, scaling_section, profile_section, schedule_section, targets_section,
)


#: The sections of ``bench --schedule --trace DIR`` without ``--configs``: the schedule step alone.
STEP_SECTIONS: tuple[Callable[[Report], str], ...] = (header_section, schedule_section, targets_section)


def format_text(report: Report, sections: tuple[Callable[[Report], str], ...] = SECTIONS) -> str:
    """The tables of ``report`` as plain text (also valid inside a Markdown code block): the text of
    every renderer of ``sections`` (default :data:`SECTIONS`, all of them) that has one, joined by newlines
    (each section after the header begins with one, so an empty line parts them)."""
    return "\n".join(text for text in (render(report) for render in sections) if text)


def step_parts_table(sched: dict[str, Any], replayed: dict[str, float] | None = None) -> str:
    """Where the real step's time goes, per variant and rank (Note [step parts] in ``harness.bench_probes``):
    ms of F, full backwards, B, W, waiting for a peer and the rest, in each variant's fastest step;
    ``replayed``: ``{variant: replayed step ms}`` (the replay of the same stage shape, sending free),
    shown beside the slowest rank's step."""
    parts = sched.get("parts_ms")
    if not parts:
        return ""
    first = next(iter(parts.values()))[0]
    kinds = [k for k in first if k != "step"]  # the worker's kinds, in its order (records.StepParts), "other" last
    rows = []
    for name, ranks in parts.items():
        replay = (replayed or {}).get(name)
        for r, p in enumerate(ranks):
            rows.append([
                name if r == 0 else "", str(r), f"{p['step']:.1f}", *(f"{p[k]:.1f}" for k in kinds),
                f"{replay:.1f}" if replay is not None and r == 0 else "",
            ])
    why = "" if replayed else (
        "; replayed: none here, as the split configurations do not include the real step's stage shape "
        "(add it with --configs, e.g. 4x128x16; --quick measures 4x64x16 only)" if replayed is not None else ""
    )
    return (
        "\nStep parts (Note [step parts]: ms on each rank in the variant's fastest step; wait = blocked on a "
        "peer's send or receive, other = the schedule's own work, posting sends, the loss; replayed = the "
        f"same step replayed from the split's costs, sending free{why})\n"
        + format_table(["variant", "rank", "step", *kinds, "replayed"], rows, left=1)
    )


def targets_table(targets: list[dict[str, Any]], source: str) -> str:
    """The targets of a report (records of :func:`target_row`) as a table with a verdict per row, then one
    ``N PASS, M MISS`` line; ``source`` names where the targets are set (e.g. ``docs/performance.md``)."""
    rows = [
        [t["status"], t["target"], t["where"], f"{t['value']:.2f}",
         "-" if t.get("median_paired") is None else f"{t['median_paired']:.2f}", f"{t['limit']:.2f}"]
        for t in targets
    ]
    n_miss = sum(t["status"] == "MISS" for t in targets)
    return (
        f"\nTargets ({source}); measured = ratio of minima (decides), median = median of per-repeat ratios\n"
        + format_table(["", "target", "where", "measured", "median", "limit"], rows, left=3)
        + f"\n{len(targets) - n_miss} PASS, {n_miss} MISS"
    )


def summary_line(report: dict[str, Any]) -> str | None:
    bad = [c["label"] for c in report["configs"] if not all(c["grads_match"].values())]
    return f"gradient mismatch against plain autograd on: {', '.join(bad)}" if bad else None
