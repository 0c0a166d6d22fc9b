"""``ppbackward check``: every schedule of the installed torch, upstream vs ppbackward, one table.

Private module behind the console script. It launches the multiproc harness worker
(``ppbackward._harness.worker``) under torchrun twice — with torch's own stage backward and with
``ppbackward.install()`` — on a built-in model, then prints one row per schedule and backward:

Every column is the worst rank and worst step of the case (Note [worst cell]):

* ``garbage``: tensors + autograd nodes found in reference cycles after a step
  (``ppbackward.leaks.check_tensor_leaks``);
* ``gc-only``: bytes of saved activations freed only by a gc run (held by a cycle);
* ``held``: bytes of saved activations still alive after the step, the stage's runtime state
  cleared and a gc run (held by a live reference);
* ``max|dg|``: max |grad - reference| over every parameter, against a single-process reference;
* ``hooks``: post-accumulate-grad hook calls / expected (once per parameter per microbatch) of the
  rank and step furthest from expected;
* ``step``: seconds per step, the slowest rank's mean over its steps (timing is not judged).

Exit code 0 only when ppbackward passes every cell; upstream's failures are reported, not fatal.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["main"]

BACKWARDS = ("upstream", "ppbackward")
_MODELS = ("transformer", "mlp", "tuple", "ckpt")
_COLUMNS = ("garbage", "gc-only", "held", "max|dg|", "hooks", "step")


class CheckError(Exception):
    """A problem with the request or the machine, reported as one clear message (exit code 2)."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` only where the help text does not already say what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "(default" in text:
            return text
        return super()._get_help_string(action) or text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppbackward check",
        formatter_class=_HelpFormatter,
        description="Run every pipeline schedule of the installed torch under torchrun, with torch's own "
        "stage backward and with ppbackward, and compare leaks, activation lifetime, grads and hooks.",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) to start")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="process-group backend")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: rank r uses cuda:r")
    p.add_argument("--model", choices=_MODELS, default="transformer", help="built-in model")
    p.add_argument("--schedules", default="all", help="comma-separated schedule class names, or 'all'")
    p.add_argument("--steps", type=int, default=2, help="measured schedule steps per case")
    p.add_argument("--microbatches", type=int, default=0, help="microbatches per step (0: each schedule's rule)")
    p.add_argument(
        "--timeout", type=float, default=300.0,
        help="seconds a launch may go without any rank finishing a case, once every rank has started; then "
        "every rank's stack is written to its log and the launch is killed",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "--logs", metavar="DIR",
        help="keep the ranks' logs and verdicts in DIR (default: a temp dir, deleted when ppbackward passes)",
    )  # fmt: skip
    # For the test suite and debugging: extra arguments for the harness worker (e.g. --hang-rank=1).
    p.add_argument("--worker-arg", action="append", default=[], help=argparse.SUPPRESS)
    return p


def _suggest(name: str, known: set[str]) -> list[str]:
    """Known schedule names close to ``name``, case and the ``Schedule`` prefix ignored."""
    def stem(text: str) -> str:
        text = text.lower()
        return text[len("schedule") :] if text.startswith("schedule") else text

    stems = {stem(k): k for k in sorted(known)}
    query = stem(name)
    if query in stems:
        return [stems[query]]
    prefixed = [k for s, k in stems.items() if query and s.startswith(query)]
    if prefixed:
        return prefixed[:2]
    return [stems[s] for s in difflib.get_close_matches(query, list(stems), n=2, cutoff=0.75)]


def _unknown_schedules(names: list[str], known: set[str]) -> str:
    """``"unknown schedule(s) a (did you mean ScheduleA?), b; known: ..."``."""
    parts = []
    for name in names:
        close = _suggest(name, known)
        parts.append(f"{name} (did you mean {' or '.join(close)}?)" if close else name)
    return f"unknown schedule(s) {', '.join(parts)}; known: {', '.join(sorted(known))}"


def _validate(args: argparse.Namespace) -> list[str] | None:
    """Check the request before launching anything; return the schedule filter."""
    if importlib.util.find_spec("torch.distributed.run") is None or not torch.distributed.is_available():
        raise CheckError(f"torch {torch.__version__} has no torch.distributed / torchrun on this machine")
    if args.nproc < 1:
        raise CheckError(f"--nproc {args.nproc}: need at least 1 rank")
    if args.steps < 1:
        raise CheckError(f"--steps {args.steps}: need at least 1 step")
    if args.microbatches < 0:
        raise CheckError(f"--microbatches {args.microbatches}: must be 0 (automatic) or positive")
    if args.timeout <= 0:
        raise CheckError(f"--timeout {args.timeout:g}: must be positive (seconds)")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise CheckError("--device cuda: torch.cuda.is_available() is False on this machine")
        if torch.cuda.device_count() < args.nproc:
            raise CheckError(f"--device cuda --nproc {args.nproc}: only {torch.cuda.device_count()} GPU(s) visible")
    if args.backend == "nccl" and args.device != "cuda":
        raise CheckError("--backend nccl needs --device cuda")
    from ppbackward._harness import schedules

    known = set(schedules.RULES) | set(schedules.discover())
    only = None
    if args.schedules != "all":
        only = [s.strip() for s in args.schedules.split(",") if s.strip()]
        if not only:
            raise CheckError(f"--schedules {args.schedules!r}: no schedule named; give class names or 'all'")
        unknown = [s for s in only if s not in known]
        if unknown:
            raise CheckError(_unknown_schedules(unknown, known))
    cases = schedules.matrix(args.nproc, only, args.microbatches)
    if all(case.skip for case in cases):  # nothing would run: say why instead of a vacuous pass
        reasons = "; ".join(f"{case.skip}" for case in cases)
        raise CheckError(f"nothing to check with --nproc {args.nproc}: {reasons}")
    return only


def _run_backward(backward: str, args: argparse.Namespace, out_dir: Path, t0: float) -> Any:
    from ppbackward._harness.launch import launch

    worker_args = [
        "--backward", backward, "--models", args.model, "--schedules", args.schedules,
        "--steps", str(args.steps), "--microbatches", str(args.microbatches),
        "--device", args.device, "--backend", args.backend,
        # a case that fails on one rank leaves the others waiting for it: keep that wait short
        "--case-timeout", "10",
        *args.worker_arg,
    ]  # fmt: skip

    def progress(record: dict[str, Any]) -> None:
        seconds = record.get("seconds")
        took = f"{seconds:.1f} s" if isinstance(seconds, (int, float)) else "-"
        print(
            f"  [{backward:>10}] {record.get('schedule', record.get('id', '?')):<31} {_progress_status(record):<22} "
            f"({took}; elapsed {time.perf_counter() - t0:5.1f} s)",
            flush=True,
        )

    print(f"{backward}: launching {args.nproc} ranks ({args.backend}, {args.device}) ...", flush=True)
    return launch(args.nproc, worker_args, out_dir / backward, args.timeout, on_case=progress)


# Which failure messages (``"step N: <kind>: ..."``, see ppbackward._harness.worker) each column reports.
_KINDS = {"garbage": "garbage:", "gc-only": "lifetime:", "held": "lifetime:", "max|dg|": "numerics:", "hooks": "hooks:"}


def _failure_kind(failure: str) -> str:
    """``"hooks"`` for ``"step 0: hooks: ..."``; ``"raised"`` for an exception record."""
    if failure.startswith("exception: "):
        return "raised"
    text = failure.split(": ", 1)[1] if failure.startswith("step ") and ": " in failure else failure
    return text.split(":", 1)[0]


def _progress_status(record: dict[str, Any]) -> str:
    """``pass``, ``skip``, or ``FAIL`` with why: ``FAIL raised RuntimeError`` (the case stopped on an
    exception) or ``FAIL hooks,numerics`` (the checks that failed, on rank 0)."""
    status = record.get("status", "?")
    if status in ("pass", "skip"):
        return status
    failures = record.get("failures") or []
    if status == "error" and failures:
        return "FAIL raised " + failures[0].removeprefix("exception: ").split(":", 1)[0]
    kinds = dict.fromkeys(_failure_kind(f) for f in failures)
    return "FAIL " + ",".join(kinds) if kinds else "FAIL"


def _step_metrics(step: dict[str, Any]) -> dict[str, Any]:
    return {
        "garbage": step["garbage"]["tensors"] + step["garbage"]["nodes"],
        "gc-only": step["lifetime"]["bytes_freed_only_by_gc"],
        "held": step["lifetime"]["bytes_held_after_gc"],
        "max|dg|": step["numerics"]["max_abs_grad_err"],
        "hooks": abs(step["hooks"]["fired"] - step["hooks"]["expected"]),
    }


def _cell_values(per_rank: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    """Aggregate one case's per-rank records into the table's metrics.

    Note [worst cell]: every column shows the worst rank and step for that column (the largest value;
    for ``hooks``, the rank and step whose count is furthest from expected, shown as fired/expected of
    that rank and step), and ``worst`` remembers which (rank, step) each column came from, so that the
    footnote of a failing case quotes the failure behind the first failing cell.
    """
    records = {rank: r for rank, r in per_rank.items() if r}
    failures = [f"rank {rank}, {f}" for rank, r in records.items() for f in r.get("failures", [])]
    status = {r.get("status") for r in records.values()}
    steps = [(rank, s) for rank, r in records.items() for s in r.get("steps", [])]
    if not steps:
        if status == {"skip"}:
            return {"status": "skip", "failures": sorted({r.get("reason", "") for r in records.values()})}
        return {"status": "fail", "failures": failures or ["no verdict"]}
    worst: dict[str, tuple[int, int]] = {}
    best: dict[str, Any] = {}
    for rank, step in steps:
        for column, value in _step_metrics(step).items():
            if column not in best or value > best[column]:
                best[column], worst[column] = value, (rank, step["step"])
    hooks_rank, hooks_step = worst["hooks"]
    hooks = next(s["hooks"] for r, s in steps if r == hooks_rank and s["step"] == hooks_step)
    step_seconds = [sum(s["seconds"] for s in r["steps"]) / len(r["steps"]) for r in records.values() if r.get("steps")]
    return {
        "status": "pass" if status == {"pass"} else "fail",
        "garbage": best["garbage"],
        "bytes_freed_only_by_gc": best["gc-only"],
        "bytes_held_after_step": best["held"],
        "max_abs_grad_err": best["max|dg|"],
        "hooks_fired": hooks["fired"],
        "hooks_expected": hooks["expected"],
        "step_seconds": max(step_seconds),
        "worst": {column: list(where) for column, where in worst.items()},
        "failures": failures,
    }


def _cell_ok(values: dict[str, Any]) -> dict[str, bool]:
    kinds = {_failure_kind(f.split(", ", 1)[-1]) for f in values["failures"]}
    return {
        "garbage": values["garbage"] == 0,
        "gc-only": values["bytes_freed_only_by_gc"] == 0,
        "held": values["bytes_held_after_step"] == 0,
        "max|dg|": "numerics" not in kinds,
        "hooks": values["hooks_fired"] == values["hooks_expected"],
        "step": True,
    }


def _format_cell(column: str, values: dict[str, Any], ok: bool) -> str:
    text = {
        "garbage": lambda v: f"{v['garbage']}",
        "gc-only": lambda v: f"{v['bytes_freed_only_by_gc']} B",
        "held": lambda v: f"{v['bytes_held_after_step']} B",
        "max|dg|": lambda v: f"{v['max_abs_grad_err']:.1e}",
        "hooks": lambda v: f"{v['hooks_fired']}/{v['hooks_expected']}",
        "step": lambda v: f"{v['step_seconds'] * 1e3:.0f} ms",
    }[column](values)
    return text if column == "step" else f"{text} {'ok' if ok else 'FAIL'}"


def _reason(values: dict[str, Any] | None) -> str:
    """The failure behind the first failing cell of a case (Note [worst cell]), one line:
    ``rank 1, step 0: hooks: ...``; the first failure when no cell fails (an exception, caches)."""
    if values is None:
        return "no verdict"
    failures = values.get("failures") or ["no measurement"]
    if "garbage" in values:
        oks = _cell_ok(values)
        for column, kind in _KINDS.items():
            if oks[column]:
                continue
            rank, step = values["worst"][column]
            prefix = f"rank {rank}, step {step}: {kind}"
            match = next((f for f in failures if f.startswith(prefix)), None)
            if match is not None:
                return match.splitlines()[0]
    return failures[0].replace("exception: ", "", 1).splitlines()[0]


def _short_reason(values: dict[str, Any] | None) -> str:
    if values is not None and values["status"] == "skip":
        return "skipped: " + (values.get("failures") or [""])[0]
    first = re.sub(r"^rank \d+, (step \d+: )?", "", _reason(values)).split(" (", 1)[0]
    return "FAIL: " + (first if len(first) <= 90 else first[:87] + "...")


def _table(results: dict[str, dict[str, dict[str, Any]]], schedules: list[str]) -> str:
    header = ["schedule", "backward", *_COLUMNS]
    rows: list[list[str]] = []
    for name in schedules:
        for backward in BACKWARDS:
            values = results[backward].get(name)
            if values is None or "garbage" not in values:
                rows.append([name, backward, _short_reason(values)])  # spans the metric columns
                continue
            oks = _cell_ok(values)
            rows.append([name, backward, *(_format_cell(c, values, oks[c]) for c in _COLUMNS)])
    full = [header, *(r for r in rows if len(r) == len(header))]
    widths = [max(len(r[i]) for r in full) for i in range(len(header))]
    widths[0] = max([widths[0], *(len(r[0]) for r in rows)])

    def line(r: list[str]) -> str:
        return "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip()

    lines = [line(header), "  ".join("-" * w for w in widths)]
    lines += [line(r) for r in rows]
    return "\n".join(lines)


def _collect(result: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for case_id in result.case_ids():
        values = _cell_values(result.case(case_id))
        out[case_id.split("/")[0]] = values
    return out


def run(args: argparse.Namespace) -> int:
    """The ``check`` command; returns the process exit code."""
    only = _validate(args)
    t0 = time.perf_counter()
    print(
        f"ppbackward check: torch {torch.__version__}, model {args.model}, {args.nproc} ranks, "
        f"{args.steps} step(s) per schedule",
        flush=True,
    )
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="ppbackward-check-"))
    launches = {b: _run_backward(b, args, logs, t0) for b in BACKWARDS}
    results = {b: _collect(r) for b, r in launches.items()}
    schedules = [s for s in dict.fromkeys([*results["upstream"], *results["ppbackward"]]) if only is None or s in only]
    print()
    print(_table(results, schedules))
    print()
    verdicts = [v for r in launches.values() for v in r.verdicts.values() if v]
    for note in sorted({w for v in verdicts for w in v.get("workarounds", [])}):
        print(f"note: {note}")  # e.g. ppbackward._harness.gloo_p2p on torch 2.5-2.7
    problems = {b: r.launch_problems() for b, r in launches.items()}
    for backward, launch_result in launches.items():
        if problems[backward]:
            print(f"{backward}: the launch itself failed:\n{launch_result.format_launch()}\n")
    ours = results["ppbackward"]
    ran = [s for s in schedules if ours.get(s, {}).get("status") != "skip"]
    bad = [s for s in schedules if ours.get(s, {}).get("status") not in ("pass", "skip")]
    if bad and not problems["ppbackward"]:
        print("ppbackward failures:\n" + launches["ppbackward"].format_failures() + "\n")
    upstream_bad = [s for s in schedules if results["upstream"].get(s, {}).get("status") not in ("pass", "skip")]
    footnotes = [f"upstream {s}: {_reason(results['upstream'][s])}" for s in upstream_bad]
    for line in footnotes:
        print(line)
    if footnotes:
        raised = any("garbage" not in results["upstream"][s] for s in upstream_bad)  # raised: no measurement
        legend = ["each line: the failure behind the case's first failing cell, on the rank and step it names"]
        if any(" B pinned)" in line for line in footnotes):
            legend.append('"B pinned": bytes of the tensors found in the cycles')
        if raised:
            legend.append(f"full tracebacks: {logs}/upstream/rank<r>.json, cases[].error")
        print(f"  ({'; '.join(legend)})")
    elapsed = time.perf_counter() - t0
    passed = not bad and not problems["ppbackward"]
    if problems["ppbackward"]:
        outcome = f"FAIL: its launch failed ({problems['ppbackward'][0].splitlines()[0]})"
    else:
        outcome = f"PASS on {len(ran)}/{len(ran)} schedules" if passed else f"FAIL on {len(bad)}/{len(ran)} schedules"
    upstream = (
        f"torch's own launch failed ({problems['upstream'][0].splitlines()[0]})"
        if problems["upstream"]
        else f"torch's own backward failed {len(upstream_bad)}/{len(ran)}"
    )
    skipped = [(ours[s].get("failures") or [""])[0] for s in schedules if s not in ran]
    if skipped:
        absent = all(" is not in torch " in r for r in skipped)
        why = f"not in torch {torch.__version__}" if absent else "reasons in the table"
        upstream += f"; {len(skipped)} skipped ({why})"
    keep = bool(args.logs) or not passed
    if not keep:
        shutil.rmtree(logs, ignore_errors=True)  # a passing run leaves nothing behind; --logs keeps them
    where = f"logs: {logs}" if keep else "logs deleted; --logs DIR keeps them"
    verdict = f"VERDICT: ppbackward {outcome}; {upstream} ({elapsed:.0f} s; {where})"
    print(verdict)
    if args.json:
        payload = {
            "torch": torch.__version__,
            "model": args.model,
            "nproc": args.nproc,
            "backend": args.backend,
            "device": args.device,
            "steps": args.steps,
            "results": results,
            "launch_problems": problems,
            "passed": passed,
            "verdict": verdict,
            "logs": str(logs) if keep else None,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ppbackward check``; returns the exit code (2 for a bad request)."""
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except CheckError as e:
        print(f"ppbackward check: error: {e}", file=sys.stderr)
        return 2
