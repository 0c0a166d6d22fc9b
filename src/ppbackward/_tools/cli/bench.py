"""``ppbackward bench``: the stage-backward benchmark's command (options, validation, the run, the output).

Private module. Every option is checked before the measurement modules are imported (a bad value is
refused in the time ``import ppbackward`` takes); the measurements are ``ppbackward._tools.bench``'s modules.
Method and results: ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
from typing import Any, NamedTuple

from ppbackward._tools.cli.paths import output_dir_problem, output_file_problem, written

__all__ = ["main"]

_EXIT_CODES = """exit codes:
  0  every measurement ran (a missed target is reported, not an error)
  1  an implementation's gradients differ from plain autograd, or the schedule run failed
  2  a bad option (nothing was measured)"""


def _parser() -> argparse.ArgumentParser:
    """The options of ``ppbackward bench``, feature by feature (in the order ``--help`` lists them)."""
    p = argparse.ArgumentParser(
        prog="ppbackward bench",
        description=(
            "Time, memory and counted device work of the pipeline stage backward: plain autograd, torch's B+W, "
            "ppbackward's B+W and full backward, side by side (one process, 1 thread), with grads None "
            "and accumulating; a microbatch loop in zero-bubble order; the allocator's counts; the kernels, "
            "FLOPs and bytes B+W dispatch against a full backward. "
            "Method and results: docs/performance.md."
        ),
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for add in (_add_run_options, _add_schedule_options, _add_split_options, _add_compile_options,
                _add_output_options, _add_section_options):
        add(p)
    return p


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """What is measured and for how long: ``--configs``, ``--repeats``, ``--budget``, ``--json``, ``--quick``."""
    p.add_argument(
        "--configs",
        default=None,
        help="'all' (4,16 layers x d 64,256 x seq 16,128; with --split, its own six) or a comma-separated list "
        "of LAYERSxDMODELxSEQ, e.g. 16x64x16,16x256x16 (default: all; with --trace and without --split: none, "
        "the schedule step only)",
    )
    p.add_argument(
        "--repeats", type=int, default=None,
        help="max timed repeats per config (default 100, 20 with --quick; --split and --compile: 60, 3 with --quick)"
    )
    p.add_argument(
        "--budget", type=float, default=20.0,
        help="seconds of timed repeats per config (the microbatch loop gets half as much again): N is lowered "
        "(not below 3) to fit (default 20; not with --quick)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON to PATH")
    p.add_argument(
        "--quick", action="store_true",
        help="only 4x64x16, few repeats, small scaling sweep, no profile (smoke test, CI); overrides --configs, "
        "and the schedule steps run 2 repeats whatever --schedule-repeats says",
    )


def _add_schedule_options(p: argparse.ArgumentParser) -> None:
    """The schedule step under torchrun: ``--schedule``, ``--schedule-repeats``, ``--schedule-timeout``."""
    p.add_argument(
        "--schedule", action="store_true",
        help="also time the schedule step under torchrun (2 ranks, gloo): Interleaved1F1B, InterleavedZeroBubble "
        "and ZBVZeroBubble with torch's backward, ppbackward's and merged (install(merge_bw=True)), with where "
        "each rank's time goes and, without --split, the peak memory of the rank that used most",
    )
    p.add_argument(
        "--schedule-repeats", type=int, default=8,
        help="timed steps per schedule variant, of --schedule and --one-rank-step (default 8)"
    )
    p.add_argument(
        "--schedule-timeout", type=float, default=300.0,
        help="seconds without progress of any rank before the torchrun launch is killed (default 300)",
    )


def _add_split_options(p: argparse.ArgumentParser) -> None:
    """The split's cost: ``--split``, ``--one-rank-step``, ``--device``; and ``--schedule-d-model``, the
    stage width of both schedule steps."""
    p.add_argument(
        "--split", action="store_true",
        help="only the cost of splitting the backward: B, W, B+W against one full backward per microbatch-stage "
        "on --configs (default here: six, from host-bound to compute-bound: "
        "4x16x4,4x128x16,4x256x16,16x64x16,16x256x16,4x512x64; a progress line per configuration on stderr), "
        "the replayed zero-bubble steps, and with --schedule the real torchrun step; targets and verdicts",
    )
    p.add_argument(
        "--one-rank-step", action="store_true",
        help="with --split: also time one schedule step with every stage on one rank in this process (world-1 "
        "process group, 2 stages x 4 layers d --schedule-d-model, --schedule-repeats repeats; tiny with --quick) on "
        "--device: Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble with torch's backward, ppbackward's "
        "and merged; no bubble, so it shows the runtime's and the split's overhead",
    )
    p.add_argument("--device", default="cpu", help="device of the --split measurement: cpu (default) or cuda")
    p.add_argument(
        "--schedule-d-model", type=int, default=None,
        help="d_model of the --schedule and --one-rank-step stages (default 128; 256 with --compile)"
    )


def _add_compile_options(p: argparse.ArgumentParser) -> None:
    """The split's cost on compiled stages: ``--compile``, ``--compile-backend``."""
    p.add_argument(
        "--compile", action="store_true",
        help="only the split's cost where every layer is torch.compile'd (one compiled region each, split by "
        "ppbackward into B and W): B, W, B+W against the compiled full backward on the host-bound 4x16x4 (or the "
        "one --configs names), in this process; with --schedule also the real torchrun step with compiled layers "
        "(2 ranks, 4 stages x 4 layers d --schedule-d-model, 8 microbatches): ppbackward's ZBVZeroBubble and "
        "InterleavedZeroBubble against Interleaved1F1B; targets and verdicts",
    )
    p.add_argument(
        "--compile-backend", default="inductor", metavar="BACKEND",
        help="with --compile: the torch.compile backend of every layer (default inductor; aot_eager compiles in "
        "seconds, a smoke test)",
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Pictures of the run: ``--trace`` (Chrome traces of the real step), ``--plot`` (PNGs of the split)."""
    p.add_argument(
        "--trace", metavar="DIR",
        help="with --schedule: write one Chrome trace per schedule variant to DIR (open in Perfetto or "
        "chrome://tracing): one process per rank, a slice per F, full backward, B, W, wait and the rest; with "
        "--split the replayed step (ideal, measured, merged) beside it. Tracing alone is quick: without --split, "
        "--trace runs the schedule step only (its tables and the traces) unless --configs asks for the "
        "one-process tables too (--configs all: the whole benchmark, minutes)",
    )
    p.add_argument(
        "--plot", metavar="DIR",
        help="with --split: write PNGs to DIR: the split's cost against the stage's size, and each replayed "
        "schedule step per rank (needs matplotlib: pip install matplotlib, or in a clone pip install -e '.[plot]')",
    )


def _add_section_options(p: argparse.ArgumentParser) -> None:
    """The report's optional sections: ``--no-scaling``, ``--no-profile``, ``--profile-config``."""
    p.add_argument("--no-scaling", action="store_true", help="skip the graph-analysis scaling sweep")
    p.add_argument("--no-profile", action="store_true", help="skip the where-the-time-goes profile")
    p.add_argument("--profile-config", default="16x64x16", help="configuration profiled (default 16x64x16)")


class _Request(NamedTuple):
    """What the options ask for, validated."""

    configs: list[Any]  # ppbackward._tools.harness.models.Config
    profile_config: Any
    repeats: int
    budget: float | None  # None: --quick (no time budget, the repeat count alone)
    step_only: bool  # --trace without --split or --configs: the schedule step alone, no one-process tables


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> _Request:
    """Every option checked before any measurement module is imported; a bad one exits with code 2."""
    for flag, value in (("--budget", args.budget), ("--schedule-timeout", args.schedule_timeout)):
        if not math.isfinite(value) or value <= 0:
            parser.error(f"{flag} {value:g}: must be a positive number of seconds")
    if args.schedule_d_model is None:
        args.schedule_d_model = 256 if args.compile else 128
    if args.compile and (args.split or args.one_rank_step or args.plot):
        parser.error("--compile: not with --split, --one-rank-step or --plot (it measures the compiled split alone)")
    if args.compile_backend != "inductor" and not args.compile:
        parser.error("--compile-backend: only with --compile")
    repeats = args.repeats if args.repeats is not None else (20 if args.quick else 100)
    if repeats < 1 or args.schedule_repeats < 1:
        parser.error("--repeats and --schedule-repeats must be >= 1")
    if args.schedule_d_model < 4 or args.schedule_d_model % 4:
        parser.error(f"--schedule-d-model {args.schedule_d_model}: must be a positive multiple of 4 (nhead)")
    if args.one_rank_step and not args.split:
        parser.error("--one-rank-step: only with --split")
    kind, _, index = args.device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        parser.error(f"--device {args.device!r}: cpu or cuda (cuda:N)")
    if kind != "cpu" and not (args.split or args.compile):
        parser.error(f"--device {args.device}: only with --split or --compile (the other measurements run on the CPU)")
    if args.json:
        problem = output_file_problem(args.json)
        if problem:
            parser.error(f"--json {args.json}: {problem}")
    if args.trace and not args.schedule:
        parser.error("--trace: only with --schedule (it draws the real schedule step)")
    if args.plot and not args.split:
        parser.error("--plot: only with --split (it draws the split's cost and the replayed steps)")
    for flag, folder in (("--trace", args.trace), ("--plot", args.plot)):
        problem = folder and output_dir_problem(folder)
        if problem:
            parser.error(f"{flag} {folder}: {problem}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(
            "--plot: needs matplotlib, which is not installed: pip install matplotlib "
            "(in a clone, the plot extra: pip install -e '.[plot]')"
        )
    from ppbackward._tools.harness import models as _models  # the zoo: the parse needs no measurement module

    step_only = bool(args.trace) and not (args.split or args.compile) and args.configs is None
    asked = "all" if args.configs is None else args.configs
    try:
        if args.split:  # --split reads its own configurations (ppbackward._tools.bench.split.CONFIGS for 'all')
            configs = [] if asked == "all" else _models.parse_configs(asked)
        elif args.compile:  # one configuration: 4x16x4 (ppbackward._tools.bench.compiled.CONFIG) or the one named
            configs = [] if asked == "all" else _models.parse_configs(asked)
            if len(configs) > 1:
                parser.error(f"--compile: one configuration at a time, --configs {asked} names {len(configs)}")
        elif step_only:
            configs = []
        else:
            configs = [_models.Config(4, 64, 16)] if args.quick else _models.parse_configs(asked)
    except ValueError as e:
        parser.error(str(e))
    try:
        profile_config = _models.parse_configs(args.profile_config)[0]
    except ValueError as e:
        parser.error(str(e).replace("--configs", "--profile-config", 1))
    _check_torch_options(parser, args)  # last: it imports torch (and, with --compile, torch._dynamo)
    return _Request(configs, profile_config, repeats, None if args.quick else args.budget, step_only)


def _check_torch_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The options only torch can judge (after the cheap ones: a bad path or configuration answers without
    importing torch): a CUDA ``--device`` this machine has, a ``--compile-backend`` torch.compile knows."""
    if args.device.startswith("cuda"):
        import torch

        index = int(args.device.partition(":")[2] or 0)  # digits: checked in _validate
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: no such CUDA device available")
    if args.compile:
        from torch._dynamo import list_backends

        if args.compile_backend not in list_backends(exclude_tags=()):
            parser.error(f"--compile-backend {args.compile_backend!r}: not a torch.compile backend of this torch "
                         f"(e.g. inductor, aot_eager, eager)")


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", ".."],
            capture_output=True, text=True, timeout=10,
        )
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _meta(argv: list[str]) -> dict[str, Any]:
    import torch

    import ppbackward
    from ppbackward._tools.bench.timing import loadavg as _loadavg

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "ppbackward": ppbackward.__version__,
        "ppbackward_commit": _git_commit(),
        "argv": argv,
        "loadavg_start": _loadavg(),
        "allocator": _allocator(),
    }


def _allocator() -> str:
    """The CPU allocator settings that change W's cost (docs/performance.md, "The allocator"): every
    ``MALLOC_*`` variable (glibc's ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_ARENA_MAX``, ...; jemalloc's
    ``MALLOC_CONF``), the ``glibc.malloc.*`` entries of ``GLIBC_TUNABLES`` (the same thresholds set the
    newer way) and an ``LD_PRELOAD``ed jemalloc or tcmalloc; ``"glibc defaults"`` without any."""
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")]
    tunables = os.environ.get("GLIBC_TUNABLES", "").split(":")
    settings += [f"GLIBC_TUNABLES {t}" for t in tunables if t.startswith("glibc.malloc.")]
    preload = os.environ.get("LD_PRELOAD", "")
    settings += [f"LD_PRELOAD {name}" for name in ("jemalloc", "tcmalloc") if name in preload]
    return ", ".join(settings) or "glibc defaults"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _measure_config(cfg: Any, request: _Request) -> dict[str, Any]:
    """One configuration: exactness, memory, param groups, timings, the microbatch loop, allocations."""
    from ppbackward._tools.bench import alloc as _alloc
    from ppbackward._tools.bench import device_work as _device_work
    from ppbackward._tools.bench import impls as _impls
    from ppbackward._tools.bench import loop as _loop
    from ppbackward._tools.bench import memory as _memory
    from ppbackward._tools.bench import timing as _timing
    from ppbackward._tools.harness import models as _models

    _log(f"bench: {cfg.name} ...")
    stage = _models.build(cfg)
    exact = _impls.grads_match(stage)
    device_work = _device_work.bench_work(stage)
    memory = {
        impl: {**_memory.measure_split(impl, stage), "hooked": _memory.measure_hooked(impl, stage)}
        for impl in ("upstream", "ppbackward")
    }
    groups = {}
    for impl in ("upstream", "ppbackward"):
        out = stage.model(stage.x)
        g = _impls.run_b(impl, stage, out)
        groups[impl] = len(g)
        _impls.run_w(impl, stage, g)
        del g, out
    _models.reset_grads(stage)
    secs, n, paired = _timing.time_config(cfg, request.repeats, request.budget, stage)
    ms = {regime: {k: v * 1e3 for k, v in t.items()} for regime, t in secs.items()}
    _log(f"bench: {cfg.name} microbatch loop ...")
    loop = _loop.time_loop(cfg, request.repeats, None if request.budget is None else request.budget / 2)
    return {
        "name": cfg.name, "label": cfg.label, "layers": cfg.layers, "d_model": cfg.d_model,
        "seq": cfg.seq, "batch": cfg.batch, "nhead": cfg.nhead, "dim_feedforward": 4 * cfg.d_model,
        "repeats": n, "time_ms": ms,
        "ratio_to_plain": {regime: {k: v / t["plain"] for k, v in t.items()} for regime, t in ms.items()},
        "paired_ratio_median": paired, "loop": loop, "allocations": _alloc.measure(stage),
        "param_groups": groups, "grads_match": exact, "memory": memory, "device_work": device_work,
    }


def _measure_schedule(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """The schedule step under torchrun; returns its report and whether it failed."""
    from ppbackward._tools.harness import schedule_bench as _schedule
    from ppbackward._tools.harness.records import to_json

    _log("bench: schedule step under torchrun ...")
    try:
        result = to_json(_schedule.run_schedule(
            repeats=2 if args.quick else args.schedule_repeats, timeout_s=args.schedule_timeout,
            d_model=args.schedule_d_model,
        ))
    except _schedule.ScheduleBenchError as e:
        return {"error": str(e)}, True
    return result, not result["grads_match"]


def _measure(args: argparse.Namespace, request: _Request, argv: list[str]) -> tuple[dict[str, Any], bool]:
    """Every measurement the options ask for; returns the report and whether a run failed."""
    from ppbackward._tools.bench import report as _report
    from ppbackward._tools.bench import scaling as _scaling
    from ppbackward._tools.bench.timing import loadavg as _loadavg

    report: dict[str, Any] = {"meta": _meta(argv), "configs": []}
    if request.step_only:
        _log("bench: --trace: the schedule step only (--configs all adds the one-process tables)")
    for cfg in request.configs:
        report["configs"].append(_measure_config(cfg, request))
    if not (args.no_scaling or request.step_only):
        _log("bench: graph analysis scaling ...")
        depths = _scaling.QUICK_DEPTHS if args.quick else _scaling.DEPTHS
        report["analysis_scaling"] = _scaling.measure(depths, repeats=3 if args.quick else 15)
    if not (args.quick or args.no_profile or request.step_only):
        from ppbackward._tools.bench import profile as _profile

        _log(f"bench: profile {args.profile_config} ...")
        report["profile"] = _profile.where_time_goes(request.profile_config)
    failed = False
    if args.schedule:
        report["schedule"], failed = _measure_schedule(args)
        if args.trace and "slices_ms" in report["schedule"]:
            from ppbackward._tools.bench import trace as _trace
            from ppbackward._tools.harness.records import ScheduleBench, from_json

            for path in _trace.write_traces(args.trace, from_json(ScheduleBench, report["schedule"], "schedule")):
                _log(f"bench: wrote {path}")
    report["targets"] = _report.targets(report)
    report["meta"]["loadavg_end"] = _loadavg()
    return report, failed


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the tables (stdout) and optionally write JSON.

    Args:
        argv: command-line arguments without the program name (``None``: ``sys.argv[1:]``).

    Returns:
        0 when every measurement ran (targets may be missed: that is reported, not an error);
        1 when an implementation's gradients differ from plain autograd, the schedule run failed or
        ``--json`` could not be written.
        A bad option exits with code 2 (``SystemExit``, as argparse does) before anything is measured.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    request = _validate(parser, args)

    if args.split:
        from ppbackward._tools.bench import split as _split

        return _written(args, *_split.run(args, _meta(argv)))
    if args.compile:
        from ppbackward._tools.bench import compiled as _compiled_bench

        return _written(args, *_compiled_bench.run(args, _meta(argv)))

    from ppbackward._tools.bench import report as _report
    from ppbackward._tools.bench.timing import one_torch_thread

    with one_torch_thread():
        report, failed = _measure(args, request, argv)
    print(_report.format_text(report, _report.STEP_SECTIONS if request.step_only else _report.SECTIONS))
    problem = _report.summary_line(report)
    if problem:
        print(problem)
    return _written(args, 1 if (problem or failed) else 0, report)


def _written(args: argparse.Namespace, code: int, report: dict[str, Any]) -> int:
    """``code``, once ``report`` is written to ``--json`` if given (``paths.written``); 1 where that fails."""
    if args.json and not written("bench", "--json", args.json, json.dumps(report, indent=1)):
        return 1
    return code
