"""Targets of issues 6 and 13, the printed tables and the JSON report of the benchmark.

Private module. Each target yields one row per configuration it applies to, ``PASS`` or ``MISS``
with the measured ratio and the limit; nothing here is asserted by tests (timings are noisy).
"""

from __future__ import annotations

from typing import Any

from ppbackward._tools.text_table import format_table

__all__: list[str] = []  # private module

MiB = float(2**20)
REGIMES = ("first", "accumulating")  # _timing.REGIMES, without importing torch
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def _target(name: str, where: str, value: float, limit: float, median: float | None = None) -> dict[str, Any]:
    """One target row; ``value`` (ratio of minima) decides, ``median`` (paired) is shown beside it."""
    return {
        "target": name,
        "where": where,
        "value": value,
        "median_paired": median,
        "limit": limit,
        "status": "PASS" if value <= limit else "MISS",
    }


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of issues 6 and 13 (and the benchmark's own linearity check), evaluated on ``report``."""
    rows = []
    for regime in REGIMES:
        for c in report["configs"]:
            r, pm = c["ratio_to_plain"][regime], c["paired_ratio_median"][regime]
            where = f"{c['label']}, {regime}"
            if c["layers"] == 16 and c["d_model"] == 256:
                rows.append(_target(
                    "ppbackward B+W <= 1.15x plain (16 layers, d 256)", where, r["ppbackward_bw"], 1.15,
                    pm["ppbackward_bw/plain"],
                ))
            if c["layers"] == 16 and c["d_model"] == 64:
                rows.append(_target(
                    "ppbackward B+W <= 2.0x plain (16 layers, d 64)", where, r["ppbackward_bw"], 2.0,
                    pm["ppbackward_bw/plain"],
                ))
    for regime in REGIMES:
        for c in report["configs"]:
            t, pm = c["time_ms"][regime], c["paired_ratio_median"][regime]
            rows.append(_target(
                "ppbackward B+W never slower than upstream B+W", f"{c['label']}, {regime}",
                t["ppbackward_bw"] / t["upstream_bw"], 1.0, pm["ppbackward_bw/upstream_bw"],
            ))
    for c in report["configs"]:
        t = c["loop"]["time_ms"]
        rows.append(_target(
            "ppbackward microbatch loop never slower than upstream's", c["label"], t["ppbackward"] / t["upstream"], 1.0
        ))
    sched = report.get("schedule")
    if sched and "step_ms" in sched:
        ms, mem = sched["step_ms"], sched["memory"]
        for zb in ZERO_BUBBLE:
            pp, up = f"{zb}/ppbackward", f"{zb}/upstream"
            where = f"{zb}, torchrun {sched['ranks']} ranks"
            for backward in ("ppbackward", "merged"):
                if f"{zb}/{backward}" in ms:
                    rows.append(_target(
                        f"zero-bubble step ({backward}) <= 1.0x Interleaved1F1B step (torch)", where,
                        sched["ratio_to_1f1b"][f"{zb}/{backward}"], 1.0,
                    ))
            rows.append(_target("zero-bubble step: ppbackward <= 0.9x torch's", where, ms[pp] / ms[up], 0.9))
            rows.append(_target(
                "zero-bubble peak live saved bytes: ppbackward <= torch's", where,
                mem[pp]["saved_peak_bytes"] / mem[up]["saved_peak_bytes"], 1.0,
            ))
    for regime in REGIMES:
        for c in report["configs"]:
            rows.append(_target(
                "full stage_backward within 5% of plain", f"{c['label']}, {regime}",
                c["ratio_to_plain"][regime]["full"], 1.05, c["paired_ratio_median"][regime]["full/plain"],
            ))
    for c in report["configs"]:
        dw = c.get("device_work")
        if not dw:
            continue
        for regime, work in dw["regimes"].items():
            rows.append(_target(
                "device work: B+W kernels = full backward's (count of differing kernels <= 0)",
                f"{c['label']}, {regime}", sum(map(abs, _kernel_diff(work, "ppbackward").values())), 0,
            ))
            rows.append(_target(
                "device work: B+W FLOPs <= 1.000x full backward's", f"{c['label']}, {regime}",
                work["ppbackward"]["flops"] / max(work["full"]["flops"], 1), 1.0,
            ))
        rows.append(_target(
            "held between B and W <= 0.80x with norm/bias gradients deferred to W", c["label"],
            dw["held_bytes"] / max(dw["held_deferred_bytes"], 1), 0.80,
        ))
    for c in report["configs"]:
        rows.append(_target(
            "bytes held between B and W = bytes W reads (1.00x)", c["label"],
            c["memory"]["ppbackward"]["held_over_floor"], 1.0,
        ))
    for c in report["configs"]:
        rows.append(_target(
            "with saved-tensor hooks too: held = what W unpacks (1.00x)", c["label"],
            c["memory"]["ppbackward"]["hooked"]["held_over_floor"], 1.0,
        ))
    fit = (report.get("analysis_scaling") or {}).get("fit") or {}
    if "per_unit_growth" in fit:
        sweep = "1..32 layers" if len(report["analysis_scaling"]["points"]) > 3 else "quick"
        rows.append(_target(
            "[bench check] analysis linear: us/(node+edge) largest/smallest <= 1.5", sweep,
            fit["per_unit_growth"], 1.5,
        ))
    return rows


def _kernel_diff(work: dict[str, Any], impl: str) -> dict[str, int]:
    """Kernels by name ``impl`` ran more (+) or fewer (-) times than the full backward."""
    mine, full = work[impl]["kernels"], work["full"]["kernels"]
    diff = {k: mine.get(k, 0) - full.get(k, 0) for k in sorted(set(mine) | set(full))}
    return {k: n for k, n in diff.items() if n}


def _diff_text(diff: dict[str, int]) -> str:
    return ", ".join(f"{'+' if n > 0 else ''}{n} {k}" for k, n in diff.items()) or "none"


def device_work_section(configs: list[dict[str, Any]]) -> str:
    """The counted device work of B+W against one full backward, torch's split beside it, per
    configuration and regime; and the saved bytes held between B and W (ppbackward._tools.bench.device_work)."""
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
            rows, left=2,
        )
        + "\nSaved activations held between B and W (MiB): ppbackward with the norm and bias gradients"
        " deferred to W (before), computed in B (now), and what W's deferred matmuls read\n"
        + format_table(["config", "before", "now", "now/before", "W reads"], held)
    )


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _mib(nbytes: int | None, digits: int = 1) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.{digits}f}"


def _memory_table(report: dict[str, Any], pick: Any, total: str) -> str:
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


def format_text(report: dict[str, Any]) -> str:
    """All tables of ``report`` as plain text (also valid inside a Markdown code block)."""
    m = report["meta"]
    parts = [
        f"ppbackward bench  {m['date']}  torch {m['torch']}  python {m['python']}  "
        f"{m['cpu_count']} CPU cores, {m['threads']} torch thread  {m['platform']}",
    ]
    if m.get("ppbackward_commit") or m.get("loadavg_start") is not None:
        parts.append(
            f"ppbackward {m.get('ppbackward')} ({m.get('ppbackward_commit') or 'commit unknown'}); "
            f"1-min load average {m.get('loadavg_start')} at start, {m.get('loadavg_end')} at end"
        )
    rows = []
    for c in report["configs"]:
        for regime in REGIMES:
            t, r = c["time_ms"][regime], c["ratio_to_plain"][regime]
            rows.append([
                c["label"], regime, str(c["repeats"]), f"{t['plain']:.2f}",
                f"{t['upstream_b']:.2f}", f"{t['upstream_w']:.2f}", f"{t['upstream_bw']:.2f}", _x(r["upstream_bw"]),
                f"{t['ppbackward_b']:.2f}", f"{t['ppbackward_w']:.2f}", f"{t['ppbackward_bw']:.2f}",
                _x(r["ppbackward_bw"]),
                f"{t['full']:.2f}", _x(r["full"]), f"{t['ppbackward_bw'] / t['upstream_bw']:.2f}",
                f"{c['param_groups']['upstream']}/{c['param_groups']['ppbackward']}",
                "yes" if all(c["grads_match"].values()) else "NO",
            ])
    parts.append(
        "\nTime: backward only, ms, min of N interleaved repeats; (x) = ratio to plain autograd.backward;"
        " regime first: every .grad None, accumulating: grads kept\n"
        + format_table(
            ["config", "regime", "N", "plain", "up B", "up W", "up B+W", "(x)", "pp B", "pp W", "pp B+W", "(x)",
             "pp full", "(x)", "pp/up", "groups up/pp", "exact"],
            rows, left=2,
        )
    )
    rows = []
    for c in report["configs"]:
        lp = c["loop"]
        t, r = lp["time_ms"], lp["ratio_to_plain"]
        rows.append([
            c["label"], str(lp["repeats"]), f"{t['plain']:.1f}", f"{t['upstream']:.1f}", _x(r["upstream"]),
            f"{t['ppbackward']:.1f}", _x(r["ppbackward"]), f"{t['ppbackward'] / t['upstream']:.2f}",
        ])
    if rows:
        lp = report["configs"][0]["loop"]
        parts.append(
            f"\nMicrobatch loop: one rank's F, B, W of 2 stages (half the layers each) x {lp['microbatches']} "
            "microbatches in ScheduleInterleavedZeroBubble's order, grads accumulating, forwards included; "
            "ms, min of N; plain = full backward at B, nothing at W\n"
            + format_table(["config", "N", "plain", "upstream", "(x)", "ppbackward", "(x)", "pp/up"], rows)
        )
    rows = []
    for c in report["configs"]:
        for regime in REGIMES:
            a = c["allocations"][regime]
            rows.append([c["label"], regime] + [
                f"{a[v]['allocations']} / {a[v]['bytes'] / MiB:.2f}"
                for v in ("plain", "upstream", "ppbackward", "full")
            ])
    parts.append(
        "\nAllocator: allocations / MiB allocated during one backward (torch.profiler, profile_memory)\n"
        + format_table(["config", "regime", "plain", "upstream B+W", "ppbackward B+W", "ppbackward full"], rows, left=2)
    )
    parts.append(
        "\nMemory: saved activations (MiB, unique storages, parameters excluded) alive between B and W;"
        " floor = what W reads\n" + _memory_table(report, lambda m: m, "saved")
    )
    parts.append(
        "\nMemory with a user's saved-tensor hooks (pack keeps a copy, as offloading does): MiB of those copies"
        " alive between B and W; floor = what W unpacks (ppbackward's B does W's work where hooks are)\n"
        + _memory_table(report, lambda m: m["hooked"], "packed")
    )
    if all("device_work" in c for c in report["configs"]):
        parts.append(device_work_section(report["configs"]))
    scaling = report.get("analysis_scaling")
    if scaling:
        rows = [
            [str(p["layers"]), str(p["nodes"]), str(p["edges"]), str(p["size"]), f"{p['analyze_us']:.0f}",
             f"{p['us_per_unit']:.3f}", f"{p['upstream_us']:.0f}" if "upstream_us" in p else "-"]
            for p in scaling["points"]
        ]
        fit = scaling["fit"]
        parts.append(
            "\nGraph analysis (ppbackward._graph.analyze) vs graph size, d 64 s 16\n"
            + format_table(
                ["layers", "nodes", "edges", "nodes+edges", "analyze us", "us/(node+edge)", "upstream us"], rows
            )
            + (
                f"\nfit: t = {fit['intercept_us']:.0f} us + {fit['us_per_unit']:.3f} us x (nodes+edges), "
                f"R^2 = {fit['r2']:.4f}; us/(node+edge) largest/smallest = {fit['per_unit_growth']:.2f}"
                if fit else ""
            )
        )
    prof = report.get("profile")
    if prof:
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
        parts.append(
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
    sched = report.get("schedule")
    if sched:
        if "error" in sched:
            parts.append(f"\nSchedule step: ERROR\n{sched['error']}")
        else:
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
            parts.append(
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
    parts.append(targets_table(report["targets"], "docs/performance.md"))
    return "\n".join(parts)


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
    """The targets of a report (records of :func:`_target`) as a table with a verdict per row, then one
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
