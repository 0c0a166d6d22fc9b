"""Smoke test of the benchmark (``ppbackward bench``, ``ppbackward._tools.bench``).

Cheap, no-process checks first: the quick configuration once, one repeat; the report's structure
and that its memory figures are consistent (W cannot read more than B left alive). No timing is
asserted anywhere: timings are the benchmark's output, not a test criterion. Last, the schedule step
under torchrun, which runs the harness worker's ``--mode bench`` through the harness launcher: every
variant exact, and a hung rank stopped by the hang clock (Note [hang clock] in
``ppbackward._tools.harness.launch``).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from ppbackward._tools.bench import loop as _loop
from ppbackward._tools.bench import report as _report
from ppbackward._tools.bench import timing as _timing
from ppbackward._tools.bench.records import SplitCosts
from ppbackward._tools.cli.bench import main
from ppbackward._tools.harness import models as _models
from ppbackward._tools.harness.launch import alive
from ppbackward._tools.harness.records import ScheduleBench, StepParts, from_json, to_json
from ppbackward._tools.harness.schedule_bench import ScheduleBenchError, run_schedule
from ppbackward._tools.repeats import rotations


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "report.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--quick", "--repeats", "1", "--json", str(path)])
    return rc, json.loads(path.read_text()), out.getvalue()


def test_quick_run_succeeds_and_is_exact(quick_report):
    rc, report, _ = quick_report
    assert rc == 0
    (cfg,) = report["configs"]
    assert cfg["name"] == _models.QUICK and cfg["repeats"] == 1
    assert cfg["grads_match"] == {"upstream": True, "ppbackward": True, "full": True}
    assert cfg["param_groups"]["upstream"] > 0 and cfg["param_groups"]["ppbackward"] > 0


def test_report_structure(quick_report):
    _, report, _ = quick_report
    meta = report["meta"]
    assert {"date", "torch", "cpu_count", "threads", "argv"} <= meta.keys()
    assert meta["threads"] == 1
    (cfg,) = report["configs"]
    assert set(cfg["time_ms"]) == set(_timing.REGIMES) == {"first", "accumulating"}
    for regime in _timing.REGIMES:
        assert set(cfg["time_ms"][regime]) == set(_timing.KEYS)
        assert all(v > 0 for v in cfg["time_ms"][regime].values())
        assert cfg["ratio_to_plain"][regime]["plain"] == pytest.approx(1.0)
        assert set(cfg["paired_ratio_median"][regime]) == set(_timing.PAIRS)
        assert all(v > 0 for v in cfg["paired_ratio_median"][regime].values())
        assert set(cfg["allocations"][regime]) == {"plain", "upstream", "ppbackward", "full"}
        assert all(a["allocations"] > 0 and a["bytes"] > 0 for a in cfg["allocations"][regime].values())
    loop = cfg["loop"]
    assert loop["microbatches"] == _loop.MICROBATCHES and loop["repeats"] >= 1
    assert set(loop["time_ms"]) == set(_loop.VARIANTS) and loop["ratio_to_plain"]["plain"] == pytest.approx(1.0)
    points = report["analysis_scaling"]["points"]
    assert [p["layers"] for p in points] == [1, 2, 4]
    assert all(a["size"] < b["size"] for a, b in zip(points, points[1:]))
    assert {t["status"] for t in report["targets"]} <= {"PASS", "MISS"}
    assert any("held between B and W" in t["target"] for t in report["targets"])


@pytest.mark.parametrize("impl", ["upstream", "ppbackward"])
def test_memory_figures_are_sane(quick_report, impl):
    _, report, _ = quick_report
    mem = report["configs"][0]["memory"][impl]
    assert 0 < mem["floor_bytes"] <= mem["held_bytes"] <= mem["saved_bytes"]
    # the hook-free and the hooked forward count the same saved storages
    assert mem["saved_bytes"] == mem["saved_bytes_hooked"]
    assert mem["held_over_floor"] == pytest.approx(mem["held_bytes"] / mem["floor_bytes"])
    assert mem["held_after_gc_bytes"] <= mem["held_bytes"]


@pytest.mark.parametrize("impl", ["upstream", "ppbackward"])
def test_hooked_memory_figures_are_sane(quick_report, impl):
    hooked = quick_report[1]["configs"][0]["memory"][impl]["hooked"]
    assert 0 <= hooked["floor_bytes"] <= hooked["held_bytes"] <= hooked["packed_bytes"]
    assert hooked["packed_bytes"] > 0 and hooked["after_w_bytes"] == 0
    if impl == "ppbackward":  # B did W's work: nothing packed is left for W to read, nothing held
        assert hooked["held_bytes"] == hooked["floor_bytes"] == 0 and hooked["held_over_floor"] == 1.0
    else:  # torch's split holds every packed copy, W reads part of them
        assert hooked["held_bytes"] == hooked["packed_bytes"] > hooked["floor_bytes"] > 0


def test_ppbackward_frees_every_saved_activation_after_w(quick_report):
    _, report, _ = quick_report
    assert report["configs"][0]["memory"]["ppbackward"]["after_w_bytes"] == 0


def test_tables_printed(quick_report):
    _, report, out = quick_report
    for heading in ("Time:", "Microbatch loop:", "Allocator:", "Memory:", "Memory with a user's saved-tensor hooks",
                    "Graph analysis", "Targets (docs/performance.md)"):
        assert heading in out
    assert out.count("PASS") + out.count("MISS") >= len(report["targets"])


def test_where_time_goes_counts():
    from ppbackward._tools.bench.profile import where_time_goes

    prof = where_time_goes(_models.Config(1, 64, 16), reps=1)
    plain = prof["plain"]
    assert plain["node_calls"] > 0 and plain["matmuls"] > 0
    assert plain["accumulate_grad"] == prof["params"] + 1  # every parameter and the stage input
    for impl in ("upstream", "ppbackward"):
        d = prof[impl]
        assert d["param_groups"] > 0
        assert d["b"]["node_calls"] > 0 and d["w"]["node_calls"] > 0
        for phase in ("b", "w"):
            shares = d["profile"][phase]
            assert shares["engine_calls"] >= 1
            assert set(shares) >= {"total_ms", "engine_ms", "analysis_ms", "hooks_ms", "python_other_ms"}


@pytest.mark.parametrize("phase", ["b", "w"])
def test_the_profile_phase_leaves_no_profiler_and_the_gc_as_it_was_when_b_or_w_raises(monkeypatch, phase):
    """A B or W that raises under the bench's profile (cProfile per phase, the automatic gc paused) leaves the
    caller's process with no profiler set and the gc switched on (it left cProfile on before)."""
    from ppbackward._tools.bench import profile as _profile

    def fail(*args):
        raise RuntimeError(f"{phase} failed")

    monkeypatch.setattr(_profile, f"run_{phase}", fail)
    with pytest.raises(RuntimeError, match=f"{phase} failed"):
        _profile._profile_phase(_models.build(_models.Config(1, 16, 4)), "ppbackward", 1)
    assert sys.getprofile() is None
    assert gc.isenabled()


@pytest.mark.parametrize("bad", ["4x64", "4x63x16", "axbxc", ""])
def test_bad_configs_are_a_usage_error(bad):
    with pytest.raises(SystemExit) as info:
        main(["--configs", bad])
    assert info.value.code == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "-5", "--quick"], "--budget -5: must be a positive number of seconds"),
        (["--budget", "nan"], "--budget nan: must be a positive number of seconds"),
        (["--schedule-timeout", "0"], "--schedule-timeout 0: must be a positive number of seconds"),
        (["--json", "/nonexistent/b.json"], "--json /nonexistent/b.json: its folder /nonexistent does not exist"),
        (["--repeats", "0"], "--repeats and --schedule-repeats must be >= 1"),
        # hostile review: each exited 1 after a run, or was ignored
        (["--device", "cuda", "--configs", "1x8x2"], "--device cuda: only with --split or --compile"),
        (["--compile", "--compile-backend", "nope"], "--compile-backend 'nope': not a torch.compile backend"),
        (["--profile-config", "junk"], "--profile-config: 'junk' is not LAYERSxDMODELxSEQ"),
        (["--split", "--device", "cuda:x"], "--device 'cuda:x': cpu or cuda (cuda:N)"),
        (["--configs", "100000x100000x100000"], "--configs: '100000x100000x100000': its parameters alone take"),
        pytest.param(["--split", "--device", "cuda"], "--device cuda: no such CUDA device available",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available")),
        pytest.param(["--json", "/sys/b.json"], "--json /sys/b.json: ",  # not writable, even for root
                     marks=pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="no sysfs")),
    ],
)
def test_bad_options_are_refused_before_anything_is_measured(capsys, args, message):
    """Issues 21 and 23: ``--budget -5`` ran a minute, ``--json`` to a missing folder failed after the run."""
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_option_imports_no_measurement_module():
    """Issue 23: a bad bench option took 6-7 s (check: 1-2 s); the options are now checked before any
    measurement module (pipelining, the profiler, torchrun) is imported."""
    code = (
        "import sys\nfrom ppbackward._tools.cli.bench import main\n"
        "try:\n    main(['--budget', '-5', '--configs', '4x64x16'])\nexcept SystemExit as e:\n    print(e.code)\n"
        "print(sorted(m for m in sys.modules if m.startswith('ppbackward._tools.bench.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split("\n")[:2] == ["2", "[]"], proc.stdout + proc.stderr
    code = (  # the options only torch can judge come last: a bad path answers without torch._dynamo
        "import sys\nfrom ppbackward._tools.cli.bench import main\n"
        "try:\n    main(['--compile', '--json', '/nonexistent/x.json'])\nexcept SystemExit as e:\n    print(e.code)\n"
        "print('torch._dynamo' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split("\n")[:2] == ["2", "False"], proc.stdout + proc.stderr


def _running(pattern: str) -> list[str]:
    """``ps`` lines (pid, state, command) of the live processes whose command line contains ``pattern``."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,stat=,args="], capture_output=True, text=True, check=True)
    return [line for line in ps.stdout.splitlines() if pattern in line and line.split()[1][0] != "Z"]


def _wait_until_gone(pattern: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while _running(pattern) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILLed; only the reaping can still be pending
    assert not _running(pattern), "left behind after the timeout:\n" + "\n".join(_running(pattern))


def test_the_allocator_header_names_every_setting_that_changes_ws_cost(monkeypatch):
    """The meta's allocator line: glibc's MALLOC_* variables with or without the trailing underscore
    (MALLOC_ARENA_MAX has none), GLIBC_TUNABLES' malloc entries, a preloaded allocator; else the defaults."""
    from ppbackward._tools.cli.bench import _allocator

    for name in [k for k in os.environ if k.startswith("MALLOC_")] + ["GLIBC_TUNABLES", "LD_PRELOAD"]:
        monkeypatch.delenv(name, raising=False)
    assert _allocator() == "glibc defaults"
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1073741824")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX2:glibc.malloc.trim_threshold=1073741824")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert _allocator() == (
        "MALLOC_ARENA_MAX=2, MALLOC_TRIM_THRESHOLD_=1073741824, GLIBC_TUNABLES glibc.malloc.trim_threshold=1073741824, "
        "LD_PRELOAD jemalloc"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)  # a backstop only: the hang clock bounds the launch
def test_a_hung_schedule_bench_is_stopped_by_the_hang_clock_and_leaves_no_process(tmp_path):
    """The bench goes through the harness launcher: a rank blocked in a receive (``--hang-rank``) makes no
    progress, so the launch is killed ``timeout_s`` after every rank started, whatever the machine's speed."""
    with pytest.raises(ScheduleBenchError, match="timed out: no rank made progress for 3s") as info:
        run_schedule(repeats=1, timeout_s=3.0, out_dir=str(tmp_path), worker_args=["--hang-rank", "1"])
    msg = str(info.value)
    assert "torch.distributed.run" in msg and "--mode bench" in msg
    assert "--hang-rank 1: blocking in dist.recv from rank 0" in msg  # rank 1's own log, in the message
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILLed; only the reaping can still be pending
    assert not any(alive(p) for p in pids)
    _wait_until_gone(str(tmp_path))


def test_repeats_fit_the_budget_and_orders_rotate():
    assert _timing.fit_repeats(100, None, 1.0) == 100
    assert _timing.fit_repeats(100, 20.0, 1.0) == 20
    assert _timing.fit_repeats(100, 1.0, 1.0) == 3  # never below 3 ...
    assert _timing.fit_repeats(2, 1.0, 1.0) == 2  # ... nor above the repeats asked for
    assert _timing.fit_repeats(100, 20.0, 0.0) == 100
    orders = list(rotations(("a", "b", "c"), 4))
    assert orders == [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c")]


def test_microbatch_loop_plan_is_a_valid_zero_bubble_order():
    """Each microbatch of each stage runs F, then B, then W; all of them, once."""
    steps = _loop.plan()
    assert len(steps) == 2 * 3 * _loop.MICROBATCHES
    for stage in (0, 1):
        for mb in range(_loop.MICROBATCHES):
            kinds = [kind for s, kind, m in steps if (s, m) == (stage, mb)]
            assert kinds == ["F", "B", "W"], (stage, mb, kinds)
    # torch's own planner gives the plan kept as the fallback for releases without it
    assert " ".join(f"{'02'[s]}{k.replace('B', 'I')}{m}" for s, k, m in steps) == _loop._FALLBACK


def test_microbatch_loop_variants_run_and_are_exact():
    """The loop's variants accumulate the same gradients over the microbatches."""
    loop = _loop._Loop(_models.Config(2, 32, 8), 4)
    grads = {}
    for variant in _loop.VARIANTS:
        loop.run(variant)
        grads[variant] = [p.grad.clone() for stage in loop.stages for p in stage.params]
    for variant in ("upstream", "ppbackward"):
        for a, b in zip(grads[variant], grads["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_step_parts_table_has_the_worker_s_parts_in_its_order():
    """The columns are the records' kinds (the fields of records.StepParts but "step"), whatever they are."""
    parts = {"F": 1.0, "B": 2.0, "W": 3.0, "wait": 0.5, "send": 0.25, "other": 0.25, "step": 7.0}
    lines = _report.step_parts_table({"parts_ms": {"ZBV/ppbackward": [parts]}}, {"ZBV/ppbackward": 6.0}).splitlines()
    assert lines[2].split() == ["variant", "rank", "step", "F", "B", "W", "wait", "send", "other", "replayed"]
    assert lines[4].split() == ["ZBV/ppbackward", "0", "7.0", "1.0", "2.0", "3.0", "0.5", "0.2", "0.2", "6.0"]


@pytest.mark.slow
def test_schedule_step_runs_every_variant_exactly():
    """One real torchrun launch: three schedules x two backwards (and the two zero-bubble ones merged),
    gradients equal, memory and each rank's step parts measured (Note [step parts])."""
    result = to_json(run_schedule(repeats=1, timeout_s=600))
    assert result["grads_match"] is True
    assert len(result["variants"]) == 8 and set(result["step_ms"]) == set(result["variants"])
    assert {v for v in result["variants"] if v.endswith("/merged")} == {
        "InterleavedZeroBubble/merged", "ZBVZeroBubble/merged"
    }
    for name in result["variants"]:
        ranks = result["parts_ms"][name]
        assert len(ranks) == result["ranks"]
        for parts in ranks:  # the parts add up to the rank's step; each kind ran where the schedule runs it
            total = sum(parts[k] for k in ("F", "full", "B", "W", "wait", "other"))
            assert total == pytest.approx(parts["step"], abs=0.01)  # each part rounded to a microsecond
            assert parts["F"] > 0 and (parts["full"] > 0 or parts["B"] > 0)
            assert (parts["B"] > 0) == (parts["W"] > 0)
            if name.startswith("Interleaved1F1B"):
                assert parts["B"] == 0
        if name.startswith("ZBVZeroBubble/merged"):
            assert any(parts["full"] > 0 for parts in ranks)  # the merge ran full backwards
    assert result["ratio_to_1f1b"]["Interleaved1F1B/upstream"] == pytest.approx(1.0)
    from ppbackward._tools.bench import trace as _trace  # the real step's Chrome traces (Note [step traces])

    for name in result["variants"]:
        trace = json.loads(json.dumps(_trace.step_trace(from_json(ScheduleBench, result), name)))
        _check_trace(trace, result["parts_ms"][name])
    for name in result["variants"]:
        mem = result["memory"][name]
        assert mem["saved_peak_bytes"] > 0
        assert mem["rss_peak_bytes"] is None or mem["rss_peak_bytes"] > 0


def _check_trace(trace: dict, parts_by_rank: list[dict]) -> None:
    """Every rank's slices tile its step without overlap, and their durations add up to its parts."""
    from ppbackward._tools.bench.trace import NAMES

    for rank, parts in enumerate(parts_by_rank):
        mine = sorted((e for e in trace["traceEvents"] if e["pid"] == rank and e["ph"] == "X"), key=lambda e: e["ts"])
        for a, b in zip(mine, mine[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 0.01, (a, b)  # no overlap (rounded to 1 ns)
        for kind, name in NAMES.items():
            total = sum(e["dur"] for e in mine if e["name"] == name) / 1e3
            assert total == pytest.approx(parts[kind], abs=0.01 * (1 + len(mine))), kind
        assert sum(e["dur"] for e in mine) / 1e3 == pytest.approx(parts["step"], abs=0.01)


def test_trace_of_synthetic_slices_tiles_the_step_and_the_replay_follows(tmp_path):
    from ppbackward._tools.bench import trace as _trace

    slices = [["F", 1.0, 2.0, 0, 0], ["wait", 3.0, 1.0, None, None], ["B", 4.5, 2.0, 1, 0], ["W", 6.5, 1.0, 1, 0]]
    parts = {"F": 2.0, "full": 0.0, "B": 2.0, "W": 1.0, "wait": 1.0, "other": 2.0, "step": 8.0}
    sched = ScheduleBench(
        ranks=2, stages=4, layers_per_stage=1, d_model=8, seq=1, microbatches=4, microbatch_size=1, repeats=1,
        variants=["ZBVZeroBubble/ppbackward"], step_ms={}, ratio_to_1f1b={}, memory={},
        parts_ms={"ZBVZeroBubble/ppbackward": [StepParts(**parts), StepParts(**parts)]},
        slices_ms={"ZBVZeroBubble/ppbackward": [slices, slices]}, grads_match=True,
    )
    costs = SplitCosts(F=1.0, full=2.0, B=1.2, W=1.0)
    (path,) = _trace.write_traces(tmp_path / "traces", sched, costs)
    trace = json.loads(path.read_text())
    _check_trace(trace, [parts, parts])
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"rank 0", "rank 1", "replayed ideal rank 0", "replayed measured rank 1", "replayed merged rank 0"} <= names
    b = next(e for e in trace["traceEvents"] if e["pid"] == 0 and e["name"] == "B")
    assert b["args"] == {"stage": 1, "microbatch": 0} and b["ts"] == 4500.0 and b["dur"] == 2000.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trace", "x"], "--trace: only with --schedule"),
        (["--plot", "x"], "--plot: only with --split"),
        (["--split", "--plot", "/proc/ppbackward-x"], "--plot /proc/ppbackward-x: cannot be created"),
    ],
)
def test_trace_and_plot_options_are_checked_first(capsys, args, message):
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == 2 and message in capsys.readouterr().err


def test_an_output_folder_under_a_file_is_named_as_such(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for args, message in (
        (["--split", "--plot", str(afile)], f"--plot {afile}: exists and is not a folder"),
        (["--json", str(afile / "x.json")], f"--json {afile / 'x.json'}: {afile} is not a folder"),
    ):
        with pytest.raises(SystemExit):
            main(args)
        assert message in capsys.readouterr().err


def test_plot_without_matplotlib_refuses_in_one_line_naming_the_extra(capsys, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit):
        main(["--split", "--plot", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(  # ppbackward is not on the package index: 'ppbackward[plot]' would fail
        "--plot: needs matplotlib, which is not installed: pip install matplotlib "
        "(in a clone, the plot extra: pip install -e '.[plot]')"
    )


def _made_up_step() -> dict:
    """``golden/report.json``'s made-up schedule step, with one slice per rank (it has none)."""
    from pathlib import Path

    sched = json.loads((Path(__file__).parent / "golden" / "report.json").read_text())["schedule"]
    grads_match = sched.pop("grads_match")  # the last field, as the bench writes it
    sched["slices_ms"] = {name: [[["F", 0.0, 1.0, 0, 0]]] * sched["ranks"] for name in sched["variants"]}
    sched["grads_match"] = grads_match
    return sched


def test_trace_alone_runs_the_schedule_step_only(tmp_path, monkeypatch, capsys):
    """A newcomer's ``bench --schedule --trace DIR`` ran the whole one-process benchmark (10 minutes) before
    the traced step; now the step alone runs, and only its sections are printed."""
    from ppbackward._tools.bench import profile as _profile
    from ppbackward._tools.bench import scaling as _scaling
    from ppbackward._tools.cli import bench as _cli

    sched = _made_up_step()
    measured = []

    def step(args):
        measured.append(args.schedule_repeats)
        return sched, False

    monkeypatch.setattr(_cli, "_measure_schedule", step)
    for module, name in ((_cli, "_measure_config"), (_scaling, "measure"), (_profile, "where_time_goes")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("a one-process table was measured"))
    assert main(["--schedule", "--trace", str(tmp_path / "traces"), "--json", str(tmp_path / "r.json")]) == 0
    out, err = capsys.readouterr()
    assert measured == [8]
    written = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert written == sorted(v.replace("/", "-") + ".json" for v in sched["variants"])
    assert "bench: --trace: the schedule step only (--configs all adds the one-process tables)" in err
    assert out.startswith("ppbackward bench  ") and "\nSchedule step (torchrun 2 ranks" in out
    assert "\nTime: backward only" not in out and "\nAllocator:" not in out and "\nTargets (" in out
    assert json.loads((tmp_path / "r.json").read_text())["configs"] == []


@pytest.mark.parametrize(
    "args, step_only, n_configs",
    [
        (["--schedule", "--trace", "T"], True, 0),
        (["--schedule", "--trace", "T", "--quick"], True, 0),  # --quick: 2 repeats of the step, no table
        (["--schedule", "--trace", "T", "--configs", "all"], False, 8),  # the tables asked for: all of them
        (["--schedule", "--trace", "T", "--configs", "4x64x16"], False, 1),
        (["--split", "--schedule", "--trace", "T"], False, 0),  # --split measures its own six, as always
        (["--schedule"], False, 8),
    ],
)
def test_trace_runs_the_one_process_tables_only_when_configs_asks_for_them(tmp_path, args, step_only, n_configs):
    from ppbackward._tools.cli.bench import _parser, _validate

    parser = _parser()
    request = _validate(parser, parser.parse_args([str(tmp_path / a) if a == "T" else a for a in args]))
    assert (request.step_only, len(request.configs)) == (step_only, n_configs)


def test_split_prints_a_progress_line_per_configuration_on_stderr(capsys):
    """A newcomer's ``bench --split`` ran 141 s without a word: each configuration now says it starts."""
    rc = main(["--split", "--configs", "2x16x4,2x32x4", "--repeats", "1", "--budget", "1"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("ppbackward bench --split  ")
    lines = [line for line in err.splitlines() if line.startswith("bench --split: ")]
    assert [line.split(" (elapsed ")[0] for line in lines] == [
        "bench --split: configuration 1/2: L2 d16 s4 (2x16x4)", "bench --split: configuration 2/2: L2 d32 s4 (2x32x4)",
        "bench --split: the slow paths",
    ]
    assert all(line.endswith(" s)") for line in lines)


def test_split_times_each_slow_path_beside_the_default_path(tmp_path):
    """Issue 36, item 5: what a tensor hook on an intermediate and saved-tensor hooks cost, timed (Note [slow
    paths timed]): a configuration per path in the JSON, and its lines under the default path's row."""
    path = tmp_path / "split.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--split", "--quick", "--repeats", "1", "--json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    assert sorted(report["slow_paths"]) == ["saved-tensor hooks", "tensor hook"]
    for timed in report["slow_paths"].values():
        assert timed["name"] == "4x64x16" and timed["nodes"] > 0
        for regime in ("first", "accumulating"):
            assert set(timed["time_ms"][regime]) == {"fwd", "full", "pp_b", "pp_w", "pp_bw"}
    text = out.getvalue()
    block = text[text.index("Slow paths timed") :].splitlines()[1:7]
    assert [line.split()[0:2] for line in block] == [
        ["default", "first"], ["default", "accumulating"], ["tensor", "hook"], ["tensor", "hook"],
        ["saved-tensor", "hooks"], ["saved-tensor", "hooks"],
    ]


def test_plots_are_written_and_read_back(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    path = tmp_path / "split.json"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["--split", "--quick", "--repeats", "1", "--plot", str(tmp_path / "png"), "--json", str(path)])
    assert rc == 0
    pngs = sorted((tmp_path / "png").iterdir())
    assert [p.name for p in pngs] == ["replayed-4x64x16.png", "split-cost.png"]
    for png in pngs:
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # drawn, not blank


def test_schedule_bench_collects_every_rank_s_variants_into_one_result():
    """The launcher's side of the bench: the slowest rank's step, the largest memory figure (a rank without
    one does not count), parts per rank, and grads_match only when every rank's every variant passed."""
    from ppbackward._tools.harness import records, schedule_bench

    def verdict(rank: int, step_ms: float, rss: int | None, failed: str = "") -> records.RankVerdict:
        cases = []
        for i, name in enumerate(schedule_bench.variant_name(s, b) for s, _, b in schedule_bench.VARIANTS):
            parts = records.StepParts(F=float(rank), step=step_ms + i)
            memory = records.MemoryRecord(rss, None, 100 * rank + i)
            bench = records.VariantRecord(step_ms + i, parts, [["F", 0.0, 1.0, rank, 0]], memory)
            cases.append(records.CaseRecord(id=name, status="fail" if name == failed else "pass", bench=bench))
        return records.RankVerdict(rank, 2, "upstream", mode="bench", cases=cases)

    config = schedule_bench.BenchConfig()
    result = schedule_bench.collect([verdict(0, 10.0, None), verdict(1, 20.0, 4096)], config, repeats=3)
    assert result.grads_match is True and result.ranks == 2 and result.stages == 4 and result.repeats == 3
    assert result.step_ms["Interleaved1F1B/upstream"] == 20.0 and result.step_ms["ZBVZeroBubble/merged"] == 27.0
    assert result.ratio_to_1f1b["ZBVZeroBubble/merged"] == 27.0 / 20.0
    assert result.memory["ZBVZeroBubble/merged"] == records.MemoryRecord(4096, None, 107)
    assert [p.F for p in result.parts_ms["Interleaved1F1B/ppbackward"]] == [0.0, 1.0]
    data = json.loads(json.dumps(to_json(result)))  # the report's schedule object, keys as report.py reads them
    assert list(data["parts_ms"]["Interleaved1F1B/upstream"][0]) == ["F", "full", "B", "W", "wait", "other", "step"]
    assert records.from_json(records.ScheduleBench, data) == result
    failed = [verdict(0, 10.0, None), verdict(1, 20.0, None, failed="InterleavedZeroBubble/merged")]
    assert schedule_bench.collect(failed, config, repeats=3).grads_match is False
    missing = verdict(1, 20.0, None)
    missing.cases[2].bench = None
    with pytest.raises(ValueError, match=r"^InterleavedZeroBubble/upstream: 1 rank\(s\) without the variant's"):
        schedule_bench.collect([verdict(0, 10.0, None), missing], config, repeats=3)


def test_a_json_that_cannot_be_written_at_the_end_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    """Every bench mode (the default, ``--split``, ``--compile``) hands its report to ``_written``: a write that
    fails when the run ends is one line naming ``--json``, exit 1 (``--split``/``--compile`` had a traceback)."""
    import argparse

    from ppbackward._tools.cli import bench as bench_cli
    from ppbackward._tools.cli import paths

    def full_disk(path: str, text: str) -> None:
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(paths, "write_output", full_disk)
    path = str(tmp_path / "r.json")
    assert bench_cli._written(argparse.Namespace(json=path), 0, {"a": 1}) == 1
    assert capsys.readouterr().err == f"ppbackward bench: error: --json {path}: No space left on device\n"
    assert bench_cli._written(argparse.Namespace(json=None), 0, {}) == 0
    monkeypatch.undo()
    assert bench_cli._written(argparse.Namespace(json=path), 1, {"a": 1}) == 1
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
