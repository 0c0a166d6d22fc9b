"""``ppbackward check``: its bad inputs, its table and verdict, and a hung launch.

Layers, cheapest first: bad requests and the table's arithmetic run in this process (no torchrun, well
under a second each; ``main(argv)`` is called directly); one subprocess proves the console script;
the end-to-end test launches torchrun twice with 2 ranks on two schedules; the hang test launches twice
and waits for both hangs to be detected (Note [hang clock] in ``ppbackward._tools.harness.launch``: the clock
starts once every rank has started, so nothing here depends on how fast the machine is).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import pytest
import torch

from ppbackward.__main__ import main
from ppbackward._tools.cli import cells as _check_cells
from ppbackward._tools.cli import check as _check
from ppbackward._tools.harness.records import (
    CaseRecord,
    Failure,
    GarbageRecord,
    HooksRecord,
    LifetimeRecord,
    NumericsRecord,
    RegionsRecord,
    StepRecord,
)


def _check_main(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["check", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--schedules", "ScheduleNope"], "unknown schedule(s) ScheduleNope; known: "),
        (["--schedules", "schedulegpipe"], "unknown schedule(s) schedulegpipe (did you mean ScheduleGPipe?); known: "),
        (["--schedules", ","], "--schedules ',': no schedule named"),
        (["--schedules", "ScheduleFlexibleInterleaved1F1B"] if not torch.__version__.startswith("2.5.")
         else ["--schedules", "ScheduleDualPipeV"], "nothing to check in transformer, lora, ddp, ac: Schedule"),
        (["--model", "mlp", "--nproc", "0"], "--nproc 0: need at least 1 rank"),
        (["--model", "mlp", "--nproc", "3", "--dp", "2"], "--nproc 3 is not a multiple of --dp 2"),
        (["--model", "mlp", "--wrap", "ddp"], "--wrap ddp needs --dp 2 or more"),
        (["--nproc", "4"], "--nproc applies to --model; a scenario fixes its own ranks and wrappers"),
        (["--dp", "2"], "--dp applies to --model; the ddp and fsdp scenarios run dp 2"),
        (["--scenario", "lora", "--model", "mlp"], "give --scenario or --model, not both"),
        (["--scenario", "lora,nope"], "unknown scenario(s) nope; known: transformer, lora, ddp, fsdp, ac"),
        (["--scenario", ""], "--scenario '': no scenario named (leave it out for the default four)"),
        (["--device", "cuda"], "--device cuda: torch.cuda.is_available() is False"),
        (["--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["--steps", "0"], "--steps 0: need at least 1 step"),
        (["--timeout", "0"], "--timeout 0: must be positive (seconds)"),
        # issue 21: values checked against sane bounds and the machine before any launch
        (["--timeout", "nan"], "--timeout nan: must be a finite number of seconds"),
        (["--timeout", "inf"], "--timeout inf: must be a finite number of seconds"),
        (["--timeout", "1e-9"], "--timeout 1e-09: must be between 1 and 86400 seconds"),
        (["--steps", "100000"], "--steps 100000: at most 1000 measured steps per case"),
        (["--microbatches", "1000000"], "--microbatches 1000000: at most 1024 per step"),
        (["--model", "mlp", "--nproc", str(4 * max(os.cpu_count() or 1, 2) + 2)],
         f"--nproc {4 * max(os.cpu_count() or 1, 2) + 2}: more than 4 ranks per CPU core"),
        # issue 21: output paths checked before anything runs
        (["--json", "/nonexistent/o.json"], "--json /nonexistent/o.json: its folder /nonexistent does not exist"),
        (["--json", "/"], "--json /: is a directory"),
        (["--logs", "/dev/null"], "--logs /dev/null: exists and is not a directory"),
        # hostile review: these failed after the whole run
        pytest.param(["--json", "/sys/c.json"], "--json /sys/c.json: ",  # not writable, even for root
                     marks=pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="no sysfs")),
        (["--json", "same.json", "--markdown", "same.json"], "--markdown same.json: the same file as --json"),
        # issue 23: a name with spaces around it is still checked (and stripped, see below)
        (["--schedules", "ScheduleGPipe, ScheduleNope"], "unknown schedule(s) ScheduleNope; known: "),
        # issue 37: a scenario of some schedules only, none of them asked for
        (["--scenario", "compiled-zb", "--schedules", "ScheduleGPipe"], "nothing to check in compiled-zb: scenario "
         "compiled-zb runs ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble only"),
    ],
)
def test_check_bad_input_is_a_clear_error(capsys, args, message):
    rc, out, err = _check_main(capsys, *args)
    assert rc == 2, out + err
    assert f"ppbackward check: error: {message}" in err
    assert "launching" not in out


def test_tables_render_as_github_markdown():
    from ppbackward._tools.text_table import format_table

    table = format_table(["case", "n"], [["a|b", "1"], ["skipped: why"]], left=1, markdown=True)
    assert table.splitlines() == ["| case | n |", "|:---|---:|", "| a\\|b | 1 |", "| skipped: why |  |"]


def test_check_unknown_schedules_message_is_bounded(capsys):
    """1,000 unknown names used to give a 10,120-character message; five are listed, then how many more."""
    names = [f"ScheduleNope{i}" for i in range(1000)]
    rc, out, err = _check_main(capsys, "--schedules", ",".join(names))
    assert rc == 2, out + err
    line = next(line for line in err.splitlines() if line.startswith("ppbackward check: error: "))
    assert "ScheduleNope0, ScheduleNope1, ScheduleNope2, ScheduleNope3, ScheduleNope4, and 995 more; known: " in line
    assert len(line) < 1000


def test_check_merge_bw_on_a_torch_without_the_lowering_is_a_clear_error(monkeypatch, capsys):
    """torch 2.5's runtime schedule has no _prepare_schedule_with_comms: refused before any launch (it
    used to launch every scenario and fail every ppbackward worker in install(merge_bw=True))."""
    from torch.distributed.pipelining import schedules

    monkeypatch.delattr(schedules._PipelineScheduleRuntime, "_prepare_schedule_with_comms")
    rc, out, err = _check_main(capsys, "--merge-bw")
    assert rc == 2, out + err
    assert "ppbackward check: error: merge_bw: torch " in err
    assert "has no _PipelineScheduleRuntime._prepare_schedule_with_comms; cannot merge B and W" in err
    assert "launching" not in out


def test_check_without_torchrun_is_a_clear_error(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    def find_spec(name, *args):
        return None if name == "torch.distributed.run" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert _check.main([]) == 2
    assert "has no torch.distributed / torchrun" in capsys.readouterr().err


def test_check_without_numpy_names_the_extra(monkeypatch, capsys):
    import importlib.util

    from ppbackward._compat import torch_release

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numpy" else real(name, *a))
    if torch_release()[:2] < (2, 6):  # static metadata there: numpy is not needed
        pytest.skip("torch before 2.6 runs the check with static metadata")
    assert _check.main([]) == 2
    err = capsys.readouterr().err  # ppbackward is not on the package index: 'ppbackward[check]' would fail
    assert "pip install numpy (in a clone, the check extra: pip install -e '.[check]')" in err


def test_schedule_names_are_stripped_before_they_reach_the_workers():
    """Issue 23: ``--schedules "ScheduleGPipe, Schedule1F1B"`` was validated stripped but passed raw to the
    workers, whose launches then failed (a user's typo reported as a ppbackward failure)."""
    from ppbackward._tools.harness.scenarios import SCENARIOS

    only = _check._schedule_names(" ScheduleGPipe, Schedule1F1B ,")
    assert only == ["ScheduleGPipe", "Schedule1F1B"]
    args = _check._parser().parse_args(["--schedules", "ScheduleGPipe, Schedule1F1B"])
    worker = _check.worker_args("ppbackward", SCENARIOS["mlp"], args, only)
    assert worker[worker.index("--schedules") + 1] == "ScheduleGPipe,Schedule1F1B"
    assert _check._schedule_names("all") is None
    everything = _check.worker_args("upstream", SCENARIOS["mlp"], _check._parser().parse_args([]), None)
    assert everything[everything.index("--schedules") + 1] == "all"


def test_a_scenario_of_some_schedules_launches_those_asked_for_only():
    """Issue 37: ``compiled-zb`` runs the zero-bubble schedules torch refuses compiled stages in."""
    from ppbackward._tools.harness.scenarios import SCENARIOS

    args = _check._parser().parse_args([])
    worker = _check.worker_args("ppbackward", SCENARIOS["compiled-zb"], args, None)
    assert worker[worker.index("--schedules") + 1] == "ScheduleInterleavedZeroBubble,ScheduleZBVZeroBubble"
    assert worker[worker.index("--models") + 1] == "compiled-blocks"
    only = ["ScheduleGPipe", "ScheduleZBVZeroBubble"]
    worker = _check.worker_args("upstream", SCENARIOS["compiled-zb"], args, only)
    assert worker[worker.index("--schedules") + 1] == "ScheduleZBVZeroBubble"
    mlp = _check.worker_args("upstream", SCENARIOS["mlp"], args, only)
    assert mlp[mlp.index("--schedules") + 1] == "ScheduleGPipe,ScheduleZBVZeroBubble"


def test_merge_bw_reaches_ppbackwards_workers_only():
    """Issue 22: ``--merge-bw`` runs ppbackward's side as the harness's ``ppbackward-merged`` backward
    (``install(merge_bw=True)``; tests/multiproc/test_merged.py shows that backward exact); torch's side
    is torch's schedule as planned."""
    from ppbackward._tools.harness.scenarios import SCENARIOS

    args = _check._parser().parse_args(["--merge-bw"])
    ours = _check.worker_args("ppbackward", SCENARIOS["mlp"], args, None)
    theirs = _check.worker_args("upstream", SCENARIOS["mlp"], args, None)
    assert ours[ours.index("--backward") + 1] == "ppbackward-merged"
    assert theirs[theirs.index("--backward") + 1] == "upstream"
    plain = _check.worker_args("ppbackward", SCENARIOS["mlp"], _check._parser().parse_args([]), None)
    assert plain[plain.index("--backward") + 1] == "ppbackward"


def test_help_lists_exit_codes_and_the_models_of_each_scenario(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit codes: 0 ppbackward passed every cell" in text
    assert " 1 ppbackward failed a cell, the memory check, or its launch" in text
    assert " 2 a bad request or a machine that cannot run it (nothing was launched)" in text
    assert "ac (models sac, ckpt)" in text and "lora (models lora, lora-last)" in text  # where sac lives


def test_help_names_each_default_once(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert "(default: a temp dir, deleted when ppbackward passes)" in text and "(default: 300.0)" in text
    assert "(default: transformer,lora,ddp,ac; or the one --model names)" in text


def test_bare_command_is_a_usage_error_on_stderr_and_help_is_not(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: ppbackward {check,bench}" in err
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert "check" in out and "bench" in out and err == ""


def test_version_names_ppbackward_and_torch(capsys):
    import ppbackward

    assert main(["--version"]) == 0
    out, err = capsys.readouterr()
    assert out == f"ppbackward {ppbackward.__version__} (torch {torch.__version__})\n" and err == ""


def test_console_script_runs():
    proc = subprocess.run([sys.executable, "-m", "ppbackward", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: ppbackward {check,bench}" in proc.stdout


# ----------------------------------------------------------------------------------------------------
# the table's arithmetic (Note [worst cell]) and the progress words


def _step(step: int, fired: int, expected: int, garbage: int = 0, **numerics) -> StepRecord:
    return StepRecord(
        step=step, seconds=0.01, garbage=GarbageRecord(tensors=garbage), lifetime=LifetimeRecord(), caches={},
        numerics=NumericsRecord(**numerics), hooks=HooksRecord(fired=fired, expected=expected),
    )


def _case(status: str, steps: Sequence[StepRecord] = (), failures: Sequence[Failure] = (), **kw) -> CaseRecord:
    return CaseRecord("S/m", status=status, steps=list(steps), failures=list(failures), **kw)


def _measures(cell: _check_cells.Cell) -> _check_cells.Measures:
    assert cell.measures is not None, cell
    return cell.measures


def _hooks(step: int, fired: int, expected: int = 16) -> Failure:
    message = f"post-accumulate-grad hooks fired {fired} times, expected {expected} (...)"
    return Failure("hooks", "hooks-skipped", message, step)


def test_every_column_is_the_worst_rank_and_step_and_the_footnote_quotes_that_cell():
    per_rank = {
        0: _case("fail", [_step(0, 8, 16), _step(1, 8, 16)], [_hooks(0, 8), _hooks(1, 8)]),
        1: _case("fail", [_step(0, 16, 16), _step(1, 0, 16, garbage=0)], [_hooks(1, 0)]),
    }
    values = _check_cells.cell_values(per_rank)
    measures = _measures(values)
    assert (measures.hooks_fired, measures.hooks_expected) == (0, 16)  # rank 1, step 1: not a total
    assert measures.worst["hooks"] == (1, 1)
    assert _check_cells.format_cell("hooks", values, _check_cells.cell_ok(values)["hooks"]) == "0/16 FAIL"
    assert _check_cells.reason(values) == "rank 1, step 1: hooks: " + _hooks(1, 0).message
    assert _check_cells.short_reason(values) == "FAIL: hooks skipped in W"  # the kind, never a bare message


def _raised(kind: str, message: str) -> Failure:
    return Failure("exception", kind, message, raised=message.split(":", 1)[0])


def test_footnotes_group_failures_by_kind_with_reason_report_rows_and_one_example():
    raised = {0: _case("error", failures=[_raised(
        "shared-parameter", "RuntimeError: Trying to backward through the graph a second time (or directly ...)")])}
    hooks = {1: _case("fail", [_step(0, 0, 8)], [Failure("hooks", "hooks-skipped", "fired 0 times, expected 8", 0)])}
    odd = {0: _case("error", failures=[_raised("other", "ValueError: something nobody has seen")])}
    rows = [(name, _check_cells.cell_values(r)) for name, r in (("a S1", raised), ("a S2", hooks), ("b S1", odd))]
    assert _check_cells.short_reason(rows[0][1]) == "FAIL: shared parameter: W backprops twice"
    assert _check_cells.short_reason(rows[2][1]) == "FAIL: ValueError: something nobody has seen"
    lines = _check_cells.by_kind(rows)
    assert lines[0].startswith("- shared parameter: W backprops twice: a parameter feeds two ops")
    assert "pytorch/pytorch#180952" in lines[0] and lines[1] == "    in: a S1"
    assert lines[2].startswith("    e.g. rank 0, exception: RuntimeError: Trying to backward")
    hooks_at = lines.index(next(line for line in lines if line.startswith("- hooks skipped in W")))
    assert lines[hooks_at + 1] == "    in: a S2"
    assert lines[hooks_at + 2] == "    e.g. rank 1, step 0: hooks: fired 0 times, expected 8"
    assert lines[-2:] == ["- ValueError: something nobody has seen", "    in: b S1"]  # unknown kinds last, as recorded


def test_markdown_footnotes_put_in_and_e_g_on_lines_of_their_own():
    """A newcomer's ``check --markdown`` report: under each kind, the ``in:`` and ``e.g.`` lines merged into one
    paragraph once rendered (an indented line without a list marker continues the paragraph above it in
    Markdown). They are now items of a list nested in the kind's item; the terminal keeps its layout."""
    import argparse

    raised = {0: _case("error", failures=[_raised(
        "shared-parameter", "RuntimeError: Trying to backward through the graph a second time (or directly ...)")])}
    hooks = {1: _case("fail", [_step(0, 0, 8)], [Failure("hooks", "hooks-skipped", "fired 0 times, expected 8", 0)])}
    rows = [(name, _check_cells.cell_values(r)) for name, r in (("a S1", raised), ("a S2", hooks))] + [("a S3", None)]
    tally = _check._Tally(upstream_failing=rows)
    report = _check._markdown(argparse.Namespace(steps=1, merge_bw=False), [], None, tally, "VERDICT: x", False, [])
    section = report.split("### torch's own backward failed, by kind\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section[0].startswith("- shared parameter: W backprops twice: ")
    assert section[1:3] == ["  - in: a S1", "  - e.g. rank 0, exception: RuntimeError: Trying to backward through "
                            "the graph a second time (or directly ...)"]
    assert section[4:6] == ["  - in: a S2", "  - e.g. rank 1, step 0: hooks: fired 0 times, expected 8"]
    assert section[6:] == ["- no verdict", "  - in: a S3"]
    assert all(line.startswith(("- ", "  - ")) for line in section), section  # no line continues a paragraph
    assert _check_cells.by_kind(rows)[1:3] == ["    in: a S1", "    e.g. rank 0, exception: RuntimeError: Trying to "
                                               "backward through the graph a second time (or directly ...)"]


def test_footnotes_of_rows_without_a_verdict_name_it_and_quote_nothing():
    """A row no rank reported, or a case one backward lacks, used to crash the footnotes (an empty example)."""
    lines = _check_cells.by_kind([("a S1", _check_cells.cell_values({0: None, 1: None})), ("a S2", None)])
    assert lines == ["- no verdict", "    in: a S1, a S2"]
    cycle = Failure("garbage", "reference-cycle", "2 (8 B pinned)", 0)
    cell = _check_cells.cell_values({0: _case("fail", [_step(0, 8, 8, 2)], [cycle])})
    notes = _check_cells.footnotes([("a S3", cell)])
    quoted = notes[0].quoted
    assert quoted is not None and (quoted.rank, quoted.failure.check) == (0, "garbage")  # the legend reads this


def test_ddp_shape_inference_is_named_from_the_kind_the_rank_recorded():
    message = "RuntimeError: [Stage 0] failed to run forward: ... (caused by RuntimeError: false ..."
    values = _check_cells.cell_values({0: _case("error", failures=[_raised("ddp-shape-inference", message)],
                                                error="Traceback ...", wrap="ddp")})
    assert _check_cells.short_reason(values) == "FAIL: DDP + shape inference"
    (line, rows, example) = _check_cells.by_kind([("ddp S1", values)])
    assert line.startswith("- DDP + shape inference: torch's PipelineStage shape inference (no input_args)")
    assert rows == "    in: ddp S1" and example == "    e.g. rank 0, exception: " + message


def _regions_step(step: int, per_b: list[int], expected: int = 2, counted: bool = True) -> StepRecord:
    record = RegionsRecord(
        b_calls=len(per_b), b_split=sum(n > 0 for n in per_b), regions=sum(per_b), fewest=min(per_b, default=0),
        most=max(per_b, default=0), expected=expected, counted=counted,
    )
    return StepRecord(**{**vars(_step(step, 8, 8)), "regions": record})


def test_the_split_column_shows_the_regions_each_b_split_where_they_were_counted():
    """Issue 37: a model with compiled regions gets a ``split`` column (Note [regions counted]): the fewest
    (-most) regions per B call over ranks and steps, ok only without a regions failure."""
    whole = Failure("regions", "regions-whole", "1 of 2 B calls split 1 compiled regions, 2 expected", 1)
    rows = {
        "ZB/ok": {0: _case("pass", [_regions_step(0, [2, 2]), _regions_step(1, [2, 2])]),
                  1: _case("pass", [_regions_step(0, [2]), _regions_step(1, [2])])},
        "ZB/whole": {0: _case("fail", [_regions_step(0, [2, 2]), _regions_step(1, [1, 2])], [whole])},
        "GPipe/none": {0: _case("pass", [_regions_step(0, [])])},
        "ZB/torch": {0: _case("pass", [_regions_step(0, [0, 0], expected=0, counted=False)])},
    }
    cells = {name: _check_cells.cell_values(per_rank) for name, per_rank in rows.items()}
    regions = _measures(cells["ZB/ok"]).regions
    assert regions == RegionsRecord(b_calls=6, b_split=6, regions=12, fewest=2, most=2, expected=2, counted=True)
    assert _check_cells.cell_values(rows["ZB/ok"]).to_json()["regions"]["regions"] == 12
    text = _check_cells.table({"ppbackward": cells}, [(name, name) for name in cells], ("ppbackward",))
    header, _, *lines = text.splitlines()
    assert header.split()[-3:] == ["step", "split", "finding"]
    split = {line.split()[0]: line.split("ms", 1)[1].split() for line in lines}
    assert split["ZB/ok"] == ["2/B", "ok", "-"]
    assert split["ZB/whole"] == ["1-2/B", "FAIL", "compiled", "region", "not", "split"]
    assert split["GPipe/none"] == ["no", "B", "-"] and split["ZB/torch"] == ["-", "-"]
    plain = {"ppbackward": {"S/m": _check_cells.cell_values({0: _case("pass", [_step(0, 8, 8)])})}}
    assert "split" not in _check_cells.table(plain, [("S/m", "S")], ("ppbackward",)).splitlines()[0]


def test_the_verdict_says_how_many_regions_b_split_where_a_model_has_them():
    memory = {b: {"held_over_floor": 1.0, "after_w_bytes": 0} for b in _check.BACKWARDS}
    tally = _check._Tally(ours_ran=2, regions_split=96, regions_b_calls=48)
    verdict = _check._verdict(tally, memory, True, True)
    assert verdict.startswith("ppbackward PASS on 2/2 cases and memory (compiled regions split into B and W: 96 "
                              "in 48 B calls); torch's own backward failed 0/2")
    assert "compiled regions" not in _check._verdict(_check._Tally(ours_ran=2), memory, True, True)


def test_memory_passes_only_at_most_what_w_reads_and_nothing_after_w():
    assert _check._memory_ok({"held_over_floor": 1.0, "after_w_bytes": 0})
    assert not _check._memory_ok({"held_over_floor": 1.01, "after_w_bytes": 0})
    assert not _check._memory_ok({"held_over_floor": 0.5, "after_w_bytes": 4})
    memory = {"stage": "s", **{b: {"held_bytes": 8, "floor_bytes": 4, "held_over_floor": 2.0, "after_w_bytes": 0}
                               for b in _check.BACKWARDS}}
    assert _check._memory_lines(memory)[1:] == ["    upstream: 8 B held, W reads 4 B: 2.00x",
                                                "  ppbackward: 8 B held, W reads 4 B: 2.00x FAIL"]


def test_a_rank_with_no_trainable_parameter_is_not_the_hooks_cell():
    """Issue 23: a LoRA row showed ``hooks 0/0 ok`` because the worst-rank rule picked the frozen rank."""
    per_rank = {0: _case("pass", [_step(0, 0, 0)]), 1: _case("pass", [_step(0, 8, 8)])}
    values = _check_cells.cell_values(per_rank)
    measures = _measures(values)
    assert (measures.hooks_fired, measures.hooks_expected) == (8, 8) and measures.worst["hooks"] == (1, 0)
    assert _check_cells.format_cell("hooks", values, _check_cells.cell_ok(values)["hooks"]) == "8/8 ok"
    frozen = _check_cells.cell_values({0: per_rank[0], 1: per_rank[0]})  # every rank frozen: 0/0 it is
    assert (_measures(frozen).hooks_fired, _measures(frozen).hooks_expected) == (0, 0)
    missed = {**per_rank, 2: _case("fail", [_step(0, 4, 8)], [_hooks(0, 4, 8)])}
    assert _measures(_check_cells.cell_values(missed)).worst["hooks"] == (2, 0)  # the furthest from expected wins


def _numerics(message: str, kind: str = "grads-wrong") -> Failure:
    return Failure("numerics", kind, message, 0)


def test_grads_none_say_so_instead_of_a_zero_difference_marked_fail():
    """Issue 23: ``max|dg| 0.0e+00 FAIL`` where the pipeline left a trainable grad None."""
    none = _numerics("3.lora_a.grad is None in the pipeline but set in the reference", "grads-missing")
    values = _check_cells.cell_values({0: _case("pass", [_step(0, 0, 0)]),
                                       1: _case("fail", [_step(0, 8, 8, grads_none=1)], [none])})
    ok = _check_cells.cell_ok(values)["max|dg|"]
    assert not ok and _check_cells.format_cell("max|dg|", values, ok) == "grad None FAIL"
    loss = _case("fail", [_step(0, 8, 8, losses_wrong=1)], [_numerics("loss of microbatch 0 = 1.0")])
    values = _check_cells.cell_values({0: loss})
    assert _check_cells.format_cell("max|dg|", values, False) == "loss FAIL"
    measured = _step(0, 8, 8, max_abs_grad_err=0.5)
    values = _check_cells.cell_values({0: _case("fail", [measured], [_numerics("w")])})
    assert _check_cells.format_cell("max|dg|", values, False) == "5.0e-01 FAIL"  # a measured difference shows
    replicas = _case("fail", [_step(0, 8, 8, replicas_diverged=True)], [Failure("replicas", "ddp-replicas", "r", 0)])
    assert _check_cells.format_cell("max|dg|", _check_cells.cell_values({0: replicas}), False) == "replicas FAIL"
    # torchtitan's shape (check --scenario titan): the norm's grad None beside rounding-sized differences that
    # pass said "1.2e-07 FAIL" (newcomer, 2026-12-04); a grad outside the tolerance still shows its number
    norm = _numerics("norm.weight.grad is None in the pipeline but set in the reference", "fsdp-loss-reshard")
    titan = _case("fail", [_step(0, 8, 8, grads_none=1, max_abs_grad_err=1.2e-07)], [norm])
    assert _check_cells.format_cell("max|dg|", _check_cells.cell_values({0: titan}), False) == "grad None FAIL"
    both = _case("fail", [_step(0, 8, 8, grads_none=1, grads_outside=1, max_abs_grad_err=0.38)], [norm, _numerics("w")])
    assert _check_cells.format_cell("max|dg|", _check_cells.cell_values({0: both}), False) == "3.8e-01 FAIL"
    shape = _case("fail", [_step(0, 8, 8, grads_misshaped=1)], [_numerics("w.grad shape [2] != reference [3]")])
    assert _check_cells.format_cell("max|dg|", _check_cells.cell_values({0: shape}), False) == "grad shape FAIL"


def test_the_progress_line_says_what_the_row_will():
    """Issue 23: the progress line said ``lora-last pass`` (rank 0's record) while the row said FAIL."""
    frozen_rank = _case("pass")
    last_rank = _case("fail", failures=[_numerics("3.w.grad is None in the pipeline but set", "grads-missing")])
    assert _check_cells.progress_status_of({0: frozen_rank, 1: last_rank}) == "FAIL numerics"
    assert _check_cells.progress_status_of({0: frozen_rank, 1: frozen_rank}) == "pass"
    assert _check_cells.progress_status_of({0: _case("skip"), 1: _case("skip")}) == "skip"
    raised = _case("error", failures=[_raised("other", "KeyError: 'x'")])
    assert _check_cells.progress_status_of({0: frozen_rank, 1: raised}) == "FAIL raised KeyError"


def test_progress_says_why_a_case_failed():
    assert _check_cells.progress_status("pass", []) == "pass"
    raised = [_raised("shared-parameter", "RuntimeError: Trying to backward ... (caused by X)")]
    assert _check_cells.progress_status("error", raised) == "FAIL raised RuntimeError"
    checks = [_hooks(0, 0), _numerics("x"), _hooks(1, 1)]
    assert _check_cells.progress_status("fail", checks) == "FAIL hooks,numerics"


# ----------------------------------------------------------------------------------------------------
# real launches


@pytest.mark.slow
@pytest.mark.timeout(900)  # a backstop: the launcher bounds each launch itself
def test_check_end_to_end_prints_table_verdict_and_json_and_cleans_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the default logs folder goes
    out, md = tmp_path / "check.json", tmp_path / "summary.md"
    rc, text, err = _check_main(
        capsys, "--model", "mlp", "--schedules", "ScheduleGPipe,ScheduleZBVZeroBubble", "--steps", "1",
        "--json", str(out), "--markdown", str(md),
    )
    assert rc == 0, text + err
    assert "  [ppbackward] mlp: 2 pass (elapsed" in text and "  [  upstream] mlp: 1 FAIL, 1 pass; failed: " in text
    lines = text.splitlines()
    first_row = next(i for i, line in enumerate(lines) if line.startswith("Schedule"))
    assert lines.index(next(line for line in lines if line.startswith("VERDICT:"))) < first_row  # verdict first
    rows = {tuple(line.split()[:2]): line for line in text.splitlines() if line.startswith("Schedule")}
    ours = rows[("ScheduleZBVZeroBubble", "ppbackward")]
    assert "FAIL" not in ours and "32/32 ok" in ours  # one rank, one step: 2 stages x 4 params x 4 microbatches
    # torch's own W bypasses AccumulateGrad: its hook column fails, and that is not fatal.
    theirs_row = rows[("ScheduleZBVZeroBubble", "upstream")]
    assert "FAIL" in theirs_row and "hooks skipped in W" in theirs_row
    assert "- hooks skipped in W: torch's W bypasses AccumulateGrad" in text and "pytorch/pytorch#144530" in text
    assert "    in: mlp ScheduleZBVZeroBubble" in text and ": hooks: post-accumulate-grad hooks fired 0 times" in text
    assert "B pinned" not in text  # nothing leaked: no legend for it
    assert "ppbackward: 229376 B held, W reads 229376 B: 1.00x ok" in text  # memory, in process (norms and biases in B)
    assert "VERDICT: ppbackward PASS on 2/2 cases and memory; torch's own backward failed 1/2, held 1.34x" in text
    assert "logs deleted; --logs DIR keeps them" in text
    assert not [p for p in os.listdir(tmp_path) if p.startswith("ppbackward-check-")]  # nothing left behind
    data = json.loads(out.read_text())
    assert data["passed"] is True and data["logs"] is None
    scenario = data["scenarios"]["mlp"]
    assert scenario["models"] == ["mlp"] and scenario["nproc"] == 2
    ours = scenario["results"]["ppbackward"]["ScheduleZBVZeroBubble/mlp"]
    assert ours["garbage"] == 0 and ours["bytes_held_after_step"] == 0
    assert ours["hooks_fired"] == ours["hooks_expected"] == 32
    theirs = scenario["results"]["upstream"]["ScheduleZBVZeroBubble/mlp"]
    assert [f["kind"] for f in theirs["findings"]] == ["hooks-skipped"]
    memory = data["memory"]
    assert memory["upstream"]["held_over_floor"] > 1.3 and memory["ppbackward"]["held_over_floor"] == 1.0
    report = md.read_text()  # the markdown report: the same verdict, the failures by kind, the cells
    assert report.startswith("## ppbackward check: PASS\n") and f"`{data['verdict']}`" in report
    assert "### torch's own backward failed, by kind" in report and "pytorch/pytorch#144530" in report
    assert "| ScheduleZBVZeroBubble | ppbackward | 0 ok |" in report
    assert "### Memory between B and W" in report and "ppbackward: 229376 B held" in report


@pytest.mark.slow
@pytest.mark.timeout(900)  # a backstop: the launcher bounds each launch itself
def test_check_hung_rank_fails_in_bounded_time_with_each_rank_s_stack(tmp_path, capsys):
    rc, text, err = _check_main(
        capsys, "--model", "mlp", "--schedules", "ScheduleGPipe", "--steps", "1", "--timeout", "3",
        "--worker-arg=--hang-rank=1", "--logs", str(tmp_path),
    )
    assert rc == 1, text + err
    assert "the launch itself failed" in text and "no rank made progress for 3s" in text
    assert "rank 1 log tail" in text and " in recv" in text and " in barrier" in text  # each rank's stack
    assert "VERDICT: ppbackward FAIL" in text and f"logs: {tmp_path}" in text
    assert (tmp_path / "mlp" / "ppbackward" / "rank1.log").exists()  # kept: the run failed


@pytest.mark.slow
@pytest.mark.timeout(900)  # a backstop: the launcher bounds each launch itself
def test_check_compiled_zb_shows_torch_refusing_and_ppbackward_splitting_every_region(tmp_path, capsys):
    """Issue 37: ``--scenario compiled-zb``: torch.compile(block) children under the zero-bubble schedules."""
    from ppbackward import _compiled

    if not _compiled.support().ok:
        pytest.skip(f"no split here: {_compiled.support().why}")
    out = tmp_path / "check.json"
    rc, text, err = _check_main(capsys, "--scenario", "compiled-zb", "--steps", "1", "--json", str(out))
    assert rc == 0, text + err
    rows = {tuple(line.split()[:2]): line for line in text.splitlines() if line.startswith("Schedule")}
    assert sorted({name for name, _ in rows}) == ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"]
    for name in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"):
        assert rows[(name, "upstream")].endswith("FAIL: refuses torch.compile'd stages")
        ours = rows[(name, "ppbackward")]
        assert "FAIL" not in ours and " 2/B ok " in ours and "0.0e+00 ok" in ours
    assert "- refuses torch.compile'd stages: torch's zero-bubble schedules refuse" in text
    verdict = next(line for line in text.splitlines() if line.startswith("VERDICT:"))
    assert verdict.startswith("VERDICT: ppbackward PASS on 2/2 cases and memory (compiled regions split into B and W: ")
    assert "torch's own backward failed 2/2" in verdict
    results = json.loads(out.read_text())["scenarios"]["compiled-zb"]["results"]
    for case, cell in results["ppbackward"].items():
        regions = cell["regions"]
        assert regions["b_calls"] > 0 and regions["regions"] == 2 * regions["b_calls"], (case, regions)
    assert {f["kind"] for c in results["upstream"].values() for f in c["findings"]} == {"compile-refused"}


@pytest.mark.slow
@pytest.mark.timeout(600)  # a backstop: every wait below is bounded
def test_sigterm_stops_check_and_every_process_of_its_launch(tmp_path):
    """Hostile review: SIGTERM (``timeout``, a cancelled CI job) ended ``ppbackward check`` at once and left
    torchrun and its ranks running, reparented to init (Note [a terminated launcher stops its launch])."""
    import signal
    import time

    from ppbackward._tools.torchrun import alive

    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppbackward", "check", "--model", "mlp", "--schedules", "ScheduleGPipe",
         "--steps", "1000", "--worker-arg=--hang-rank=1", "--timeout", "300", "--logs", str(logs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    pids = logs / "mlp" / "upstream"
    ranks: list[int] = []
    launcher: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while len(list(pids.glob("rank*.pid"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # every rank has started (the event is its pid file)
        assert proc.poll() is None and len(list(pids.glob("rank*.pid"))) == 2, "the ranks never started"
        ranks += [int(p.read_text()) for p in pids.glob("rank*.pid")]
        with open(f"/proc/{ranks[0]}/stat") as stat:  # the ranks' parent: torchrun
            launcher.append(int(stat.read().rsplit(")", 1)[1].split()[1]))
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in ranks + launcher) and time.monotonic() < deadline:
            time.sleep(0.1)  # SIGKILLed; only the reaping by init can still be pending
        left = [pid for pid in ranks + launcher if alive(pid)]
    finally:
        for pid in [proc.pid, *ranks, *launcher]:  # whatever a failure here left running
            if alive(pid):
                with contextlib.suppress(OSError):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert f"ppbackward check: stopped; the logs so far: {logs}" in err
    assert left == [], "torchrun or ranks left running after SIGTERM"


def test_an_output_path_is_probed_only_where_opening_it_acts_on_nothing_else(tmp_path):
    """``--json``/``--markdown`` are opened for appending before the run (a path the system refuses fails then,
    not after it) and removed where they did not exist; a FIFO or a device is not opened (a FIFO's open would
    wait for a reader)."""
    import threading

    from ppbackward._tools.cli.paths import output_file_problem

    assert output_file_problem(str(tmp_path / "new.json")) is None and not (tmp_path / "new.json").exists()
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    assert output_file_problem(str(kept)) is None and kept.read_text() == "{}"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    answers: list[str | None] = []
    probe = threading.Thread(target=lambda: answers.append(output_file_problem(str(fifo))), daemon=True)
    probe.start()
    probe.join(timeout=60)
    assert answers == [None], "the probe waited on the FIFO"
    assert output_file_problem(os.devnull) is None
    dangling = tmp_path / "link.json"  # to a file that does not exist yet: probed there, the link kept
    dangling.symlink_to(tmp_path / "target.json")
    assert output_file_problem(str(dangling)) is None
    assert dangling.is_symlink() and not (tmp_path / "target.json").exists()


def test_an_output_file_is_written_whole_or_left_as_it_was(tmp_path):
    """``--json``/``--markdown`` (check and bench) go through ``write_output``: a write that fails part-way
    leaves an existing file as it was and no temporary beside it, and a new file not at all (a reviewer's
    partial file); the mode of a file that existed is kept, a new file gets the umask's, a symbolic link stays
    a link to the file written, a file with another hard link is written in place (the link kept)."""
    from ppbackward._tools.cli.paths import write_output

    kept = tmp_path / "kept.json"
    kept.write_text('{"old": 1}')
    kept.chmod(0o640)
    with pytest.raises(UnicodeEncodeError):  # after the file was opened: the old code left it empty
        write_output(str(kept), "x" * 100_000 + "\udc80")
    assert kept.read_text() == '{"old": 1}' and sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]
    with pytest.raises(UnicodeEncodeError):
        write_output(str(tmp_path / "new.json"), "\udc80")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]
    write_output(str(kept), '{"new": 2}')
    assert kept.read_text() == '{"new": 2}' and stat.S_IMODE(kept.stat().st_mode) == 0o640
    umask = os.umask(0o027)
    try:
        write_output(str(tmp_path / "new.json"), "{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640
    link = tmp_path / "link.json"
    link.symlink_to(kept)
    write_output(str(link), "via the link")
    assert link.is_symlink() and kept.read_text() == "via the link"
    twin = tmp_path / "twin.json"
    os.link(kept, twin)
    write_output(str(kept), "both names")
    assert twin.read_text() == "both names" and os.path.samefile(kept, twin)


def test_an_output_to_standard_output_or_a_fifo_is_written_through_it(tmp_path):
    """``--json /dev/stdout > run.log`` (a reviewer's): the shell's file was renamed over, losing the tables
    printed before the JSON and after it; standard output, under any name, now gets the text through
    ``sys.stdout``, in order. A FIFO is written in place (a reader thread drains it)."""
    import threading

    script = tmp_path / "write.py"
    script.write_text(
        "import sys\nfrom ppbackward._tools.cli.paths import output_file_problem, write_output\n"
        "print('before', flush=True)\nassert output_file_problem(sys.argv[1]) is None\n"
        "write_output(sys.argv[1], '{\"json\": 1}\\n')\nprint('after')\n"
    )
    log = tmp_path / "run.log"
    for name in ("/dev/stdout", str(log)):
        with open(log, "w") as out:
            subprocess.run([sys.executable, str(script), name], stdout=out, check=True, timeout=120)
        assert log.read_text() == 'before\n{"json": 1}\nafter\n', name
    piped = subprocess.run([sys.executable, str(script), "/dev/stdout"], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stdout == 'before\n{"json": 1}\nafter\n', piped.stderr
    from ppbackward._tools.cli.paths import write_output

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    write_output(str(fifo), "through the fifo")
    reader.join(timeout=60)
    assert got == ["through the fifo"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_an_output_file_is_written_in_place_where_its_folder_refuses_the_rename(tmp_path, monkeypatch):
    """A folder that refuses a new entry (no write permission) or the rename (another user's file in a sticky
    folder such as /tmp: EPERM) gets the file written in place, as before, and no temporary left (a reviewer's;
    both refusals stood in for by the calls raising, since the suite runs as root)."""
    import tempfile as tempfile_module

    from ppbackward._tools.cli import paths

    kept = tmp_path / "kept.json"
    kept.write_text("old")

    def refused(*_args, **_kwargs):
        raise PermissionError(1, "Operation not permitted")

    with monkeypatch.context() as patched:
        patched.setattr(tempfile_module, "mkstemp", refused)
        paths.write_output(str(kept), "no new entry")
    assert kept.read_text() == "no new entry"
    with monkeypatch.context() as patched:
        patched.setattr(paths.os, "replace", refused)
        paths.write_output(str(kept), "no rename")
    assert kept.read_text() == "no rename" and sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]


def test_an_output_file_with_extended_attributes_is_written_in_place(tmp_path):
    """A file carrying extended attributes (an ACL is ``system.posix_acl_access``, a label ``security.*``) is
    written in place: a file renamed over it would not carry them (left over from the last review)."""
    from ppbackward._tools.cli.paths import write_output

    kept = tmp_path / "kept.json"
    kept.write_text("old")
    try:
        os.setxattr(kept, "user.ppbackward", b"kept")
    except (OSError, AttributeError) as e:
        pytest.skip(f"no user extended attributes here: {e}")
    inode = kept.stat().st_ino
    write_output(str(kept), "new")
    assert kept.read_text() == "new" and kept.stat().st_ino == inode
    assert os.getxattr(kept, "user.ppbackward") == b"kept"
    # only an attribute a new file lacks, or holds otherwise, counts (an SELinux label every file gets does not:
    # a reviewer's)
    from ppbackward._tools.cli.paths import _xattrs_differ

    other = tmp_path / "other"
    other.write_text("")
    assert _xattrs_differ(str(kept), str(other)) and _xattrs_differ(str(other), str(kept))  # lost, or added
    os.setxattr(other, "user.ppbackward", b"else")
    assert _xattrs_differ(str(kept), str(other))
    os.setxattr(other, "user.ppbackward", b"kept")
    assert not _xattrs_differ(str(kept), str(other)) and not _xattrs_differ(str(other), str(kept))


def test_an_output_naming_a_descriptor_is_written_to_it(tmp_path):
    """``--json /dev/fd/N`` (a shell's ``>(jq .)`` or ``3>>log``): written to that descriptor, not to the name
    ``realpath`` makes of it (a pipe's does not exist; a file's would be renamed over); a descriptor that is
    closed or open only for reading is refused up front (a reviewer's)."""
    from ppbackward._tools.cli.paths import output_file_problem, write_output

    read_end, write_end = os.pipe()
    log = tmp_path / "log"
    log.write_text("earlier\n")
    appending = os.open(log, os.O_WRONLY | os.O_APPEND)
    reading = os.open(log, os.O_RDONLY)
    try:
        assert output_file_problem(f"/dev/fd/{write_end}") is None
        write_output(f"/dev/fd/{write_end}", "to the pipe")
        assert os.read(read_end, 100) == b"to the pipe"
        assert output_file_problem(f"/proc/self/fd/{appending}") is None
        write_output(f"/proc/self/fd/{appending}", "appended\n")
        assert log.read_text() == "earlier\nappended\n" and sorted(p.name for p in tmp_path.iterdir()) == ["log"]
        assert output_file_problem(f"/dev/fd/{reading}") == "names a descriptor not open for writing"
    finally:
        for fd in (read_end, write_end, appending, reading):
            os.close(fd)
    assert output_file_problem(f"/dev/fd/{reading}") == f"names descriptor {reading}, which is not open"
