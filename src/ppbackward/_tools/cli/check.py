"""``ppbackward check``: the installed torch's schedules in real training setups, upstream vs ppbackward.

Private module behind the console script. For each scenario (``ppbackward._tools.harness.scenarios``: a
model set at a world size, optionally pipeline × data parallel) it launches the multiproc harness worker
(``ppbackward._tools.harness.worker``) under torchrun twice — with torch's own stage backward and with
``ppbackward.install()`` — and prints one table per scenario, one row per case (schedule, model,
wrapper) and backward; the columns are described in ``ppbackward._tools.cli.cells``. Every failing row of
torch's gets a footnote naming the kind of failure, why it happens and its public report
(``ppbackward._tools.harness.diagnose``). Then, in this process, the bytes of saved activations held between
B and W against the bytes W reads (``ppbackward._tools.bench.memory``), and a verdict.

Exit code 0 only when ppbackward passes every cell; upstream's failures are reported, not fatal.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ppbackward._compat import torch_release
from ppbackward._tools.cli import cells
from ppbackward._tools.cli.paths import output_file_problem, written
from ppbackward._tools.harness.records import CaseRecord

__all__ = ["main"]

BACKWARDS = ("upstream", "ppbackward")
_MEMORY_CONFIG = "4x64x16"  # the stage the bytes held between B and W are measured on (bench notation)

#: Bounds of the numeric options, checked before anything is launched (the upper ones keep a typo such as
#: ``--steps 100000`` from running for days; ``--nproc`` is bounded by the machine, see ``_check_nproc``).
MAX_STEPS = 1000
MAX_MICROBATCHES = 1024
MIN_TIMEOUT_S = 1.0  # the hang clock polls twice a second: less cannot tell progress from a hang
MAX_TIMEOUT_S = 24 * 3600.0
RANKS_PER_CPU = 4  # CPU ranks per core at most: each rank is a process running its own stages

_EXIT_CODES = """exit codes:
  0  ppbackward passed every cell and the memory check (torch's own failures are reported, not fatal)
  1  ppbackward failed a cell, the memory check, or its launch
  2  a bad request or a machine that cannot run it (nothing was launched)
  130, 143  interrupted (Ctrl-C) or terminated (SIGTERM) during a launch: its processes stopped first"""


class CheckError(Exception):
    """A problem with the request or the machine, reported as one clear message (exit code 2)."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` only where the help text does not already say what the default is."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("exit codes:"):  # the epilog is a table: keep its lines
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "(default" in text:
            return text
        return super()._get_help_string(action) or text


def _parser() -> argparse.ArgumentParser:
    from ppbackward._tools.harness.models import MODELS
    from ppbackward._tools.harness.parallel import WRAPS
    from ppbackward._tools.harness.scenarios import DEFAULT, SCENARIOS

    p = argparse.ArgumentParser(
        prog="ppbackward check",
        formatter_class=_HelpFormatter,
        epilog=_EXIT_CODES,
        description="Run the pipeline schedules of the installed torch under torchrun in real training setups, "
        "with torch's own stage backward and with ppbackward, and compare leaks, activation lifetime, grads, "
        "hooks and the memory held between B and W.",
    )
    p.add_argument(
        "--scenario", default=None, metavar="NAMES",
        help=f"comma-separated scenarios ({_scenario_list(SCENARIOS)}), 'all', or 'default' "
        f"(default: {','.join(DEFAULT)}; or the one --model names)",
    )
    p.add_argument("--model", choices=list(MODELS), default=None, help="run one built-in model instead of scenarios")
    p.add_argument("--nproc", type=int, default=None, help="with --model: ranks to start (default: 2 x --dp)")
    p.add_argument("--dp", type=int, default=1, help="with --model: data-parallel degree (world = dp x pp ranks)")
    p.add_argument(
        "--wrap", choices=WRAPS, default=None,
        help="with --model: data-parallel wrapper of every stage module (default: ddp when --dp > 1, else none)",
    )
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="process-group backend")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: rank r uses cuda:r")
    p.add_argument("--schedules", default="all", help="comma-separated schedule class names, or 'all'")
    p.add_argument("--steps", type=int, default=2, help="measured schedule steps per case")
    p.add_argument("--microbatches", type=int, default=0, help="microbatches per step (0: each schedule's rule)")
    p.add_argument(
        "--timeout", type=float, default=300.0,
        help="seconds a launch may go without any rank finishing a case, once every rank has started; then "
        "every rank's stack is written to its log and the launch is killed",
    )
    p.add_argument(
        "--merge-bw", action="store_true",
        help="ppbackward's side builds its schedules under install(merge_bw=True): each B of a zero-bubble "
        "schedule directly followed by its own W runs as one full backward (docs/api.md)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "--markdown", metavar="PATH",
        help="also write the verdict, torch's failures by kind and every cell as GitHub-flavoured markdown to "
        "PATH (e.g. a CI job summary: --markdown \"$GITHUB_STEP_SUMMARY\")",
    )
    p.add_argument(
        "--logs", metavar="DIR",
        help="keep the ranks' logs and verdicts in DIR (default: a temp dir, deleted when ppbackward passes)",
    )
    p.add_argument(
        "--worker-arg", action="append", default=[], metavar="ARG",
        help="for debugging: one more argument for every rank's worker, repeatable (e.g. --worker-arg=--metadata="
        "dynamic; python -m ppbackward._tools.harness.worker --help lists them) (default: none)",
    )
    return p


def _scenario_list(scenarios: dict[str, Any]) -> str:
    """``transformer, lora (models lora, lora-last), ...``: the models of a scenario where they are not
    just its name, so that ``sac`` is found in ``ac``."""
    return ", ".join(
        name if s.models == (name,) else f"{name} (models {', '.join(s.models)})" for name, s in scenarios.items()
    )


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


_MAX_UNKNOWN_LISTED = 5  # the message for 1,000 unknown names stays one readable line


def _unknown_schedules(names: list[str], known: set[str]) -> str:
    """``"unknown schedule(s) a (did you mean ScheduleA?), b; known: ..."``; at most
    ``_MAX_UNKNOWN_LISTED`` names are listed, then how many more."""
    parts = []
    for name in names[:_MAX_UNKNOWN_LISTED]:
        close = _suggest(name[:100], known)
        shown = name if len(name) <= 100 else f"{name[:100]}..."
        parts.append(f"{shown} (did you mean {' or '.join(close)}?)" if close else shown)
    if len(names) > _MAX_UNKNOWN_LISTED:
        parts.append(f"and {len(names) - _MAX_UNKNOWN_LISTED} more")
    return f"unknown schedule(s) {', '.join(parts)}; known: {', '.join(sorted(known))}"


def _scenarios(args: argparse.Namespace) -> list[Any]:
    """The scenarios to run: the named ones, or one made of ``--model`` (with ``--nproc``, ``--dp``, ``--wrap``)."""
    from ppbackward._tools.harness.parallel import WRAPS_WITHOUT_DP
    from ppbackward._tools.harness.scenarios import Scenario, select

    if args.model is None:
        for flag, value in (("--nproc", args.nproc), ("--wrap", args.wrap)):
            if value is not None:
                raise CheckError(f"{flag} applies to --model; a scenario fixes its own ranks and wrappers")
        if args.dp != 1:
            raise CheckError("--dp applies to --model; the ddp and fsdp scenarios run dp 2")
        if args.scenario is not None and not args.scenario.strip():
            raise CheckError("--scenario '': no scenario named (leave it out for the default four)")
        try:
            return select(args.scenario or "default")
        except ValueError as e:
            raise CheckError(str(e)) from None
    if args.scenario is not None:
        raise CheckError("give --scenario or --model, not both")
    if args.dp < 1:
        raise CheckError(f"--dp {args.dp}: need at least 1")
    nproc = args.nproc if args.nproc is not None else 2 * args.dp
    if nproc < 1:
        raise CheckError(f"--nproc {nproc}: need at least 1 rank")
    if nproc % args.dp:
        raise CheckError(f"--nproc {nproc} is not a multiple of --dp {args.dp}")
    wrap = args.wrap or ("ddp" if args.dp > 1 else "none")
    if wrap not in WRAPS_WITHOUT_DP and args.dp == 1:
        raise CheckError(f"--wrap {wrap} needs --dp 2 or more")
    title = f"{args.model} ({'pipeline only' if wrap == 'none' else f'pipeline x {wrap}'})"
    return [Scenario(args.model, title, nproc, (args.model,), dp=args.dp, wraps=(wrap,))]


def _validate(args: argparse.Namespace) -> tuple[list[Any], list[str] | None]:
    """Check the request before launching anything; return the scenarios and the schedule filter."""
    if importlib.util.find_spec("torch.distributed.run") is None or not torch.distributed.is_available():
        raise CheckError(f"torch {torch.__version__} has no torch.distributed / torchrun on this machine")
    if importlib.util.find_spec("numpy") is None and torch_release()[:2] >= (2, 6):
        # the workers let torch infer stage shapes (its default), whose object send/recv calls Tensor.numpy()
        raise CheckError(
            "ppbackward check needs numpy (torch's stage shape inference sends objects through "
            "recv_object_list, which calls Tensor.numpy()): pip install numpy (in a clone, the check extra: "
            "pip install -e '.[check]')"
        )
    if args.merge_bw:
        from ppbackward import UnsupportedTorchError
        from ppbackward._merge import lowering

        try:
            lowering()
        except UnsupportedTorchError as e:
            raise CheckError(str(e)) from None
    scenarios = _scenarios(args)
    _check_numbers(args)
    _check_machine(args, max(s.nproc for s in scenarios))
    _check_outputs(args)
    only = _schedule_names(args.schedules)
    from ppbackward._tools.harness import schedules

    runnable, reasons = [], set()
    for scenario in scenarios:
        within = scenario.schedules_within(only)
        cases = schedules.matrix(scenario.nproc // scenario.dp, within, args.microbatches)
        if any(not case.skip for case in cases):
            runnable.append(scenario)
        reasons |= {f"{c.skip} ({scenario.layout})" if args.model else c.skip for c in cases if c.skip}
        if within == []:  # a scenario of some schedules only, none of them asked for
            reasons.add(f"scenario {scenario.name} runs {', '.join(scenario.schedules)} only")
    if not runnable:  # nothing would run: say why instead of a vacuous pass
        names = ", ".join(s.name for s in scenarios)
        raise CheckError(f"nothing to check in {names}: {'; '.join(sorted(reasons))}")
    return runnable, only


def _check_numbers(args: argparse.Namespace) -> None:
    """``--steps``, ``--microbatches`` and ``--timeout`` within their bounds (``MAX_STEPS`` ...)."""
    if args.steps < 1:
        raise CheckError(f"--steps {args.steps}: need at least 1 step")
    if args.steps > MAX_STEPS:
        raise CheckError(f"--steps {args.steps}: at most {MAX_STEPS} measured steps per case")
    if args.microbatches < 0:
        raise CheckError(f"--microbatches {args.microbatches}: must be 0 (automatic) or positive")
    if args.microbatches > MAX_MICROBATCHES:
        raise CheckError(f"--microbatches {args.microbatches}: at most {MAX_MICROBATCHES} per step")
    if not math.isfinite(args.timeout):  # nan passes every comparison and would switch the watchdog off
        raise CheckError(f"--timeout {args.timeout}: must be a finite number of seconds")
    if args.timeout <= 0:
        raise CheckError(f"--timeout {args.timeout:g}: must be positive (seconds)")
    if not MIN_TIMEOUT_S <= args.timeout <= MAX_TIMEOUT_S:
        raise CheckError(
            f"--timeout {args.timeout:g}: must be between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g} seconds"
        )


def _check_machine(args: argparse.Namespace, most: int) -> None:
    """The devices, backend and rank count the request needs are on this machine."""
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise CheckError("--device cuda: torch.cuda.is_available() is False on this machine")
        if torch.cuda.device_count() < most:
            raise CheckError(f"--device cuda: {most} ranks need {most} GPUs, {torch.cuda.device_count()} visible")
    else:
        cores = os.cpu_count() or 1
        if most > RANKS_PER_CPU * max(cores, 2):
            raise CheckError(
                f"--nproc {most}: more than {RANKS_PER_CPU} ranks per CPU core ({cores} on this machine); "
                f"at most {RANKS_PER_CPU * max(cores, 2)}"
            )
    if args.backend == "nccl" and args.device != "cuda":
        raise CheckError("--backend nccl needs --device cuda")


def _check_outputs(args: argparse.Namespace) -> None:
    """``--json``/``--markdown`` can be written (two files) and ``--logs DIR`` made, before anything runs
    (nothing stays created for the first two; ``--logs`` is created, as the run would)."""
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        problem = path and output_file_problem(path)
        if problem:
            raise CheckError(f"{flag} {path}: {problem}")
    if args.json and args.markdown and os.path.realpath(args.json) == os.path.realpath(args.markdown):
        raise CheckError(f"--markdown {args.markdown}: the same file as --json (one would overwrite the other)")
    if args.logs:
        logs = Path(args.logs)
        if logs.exists() and not logs.is_dir():
            raise CheckError(f"--logs {args.logs}: exists and is not a directory")
        try:
            logs.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckError(f"--logs {args.logs}: cannot create it ({e.strerror or e})") from None
        if not os.access(logs, os.W_OK | os.X_OK):
            raise CheckError(f"--logs {args.logs}: not writable")


def _schedule_names(text: str) -> list[str] | None:
    """The ``--schedules`` filter: stripped, known class names, or ``None`` for ``all``."""
    if text == "all":
        return None
    from ppbackward._tools.harness import schedules

    known = set(schedules.RULES) | set(schedules.discover())
    only = [s.strip() for s in text.split(",") if s.strip()]
    if not only:
        raise CheckError(f"--schedules {text!r}: no schedule named; give class names or 'all'")
    unknown = [s for s in only if s not in known]
    if unknown:
        raise CheckError(_unknown_schedules(unknown, known))
    return only


def worker_args(backward: str, scenario: Any, args: argparse.Namespace, only: list[str] | None) -> list[str]:
    """The harness worker's arguments for one launch; the schedules as validated (names stripped)."""
    if backward == "ppbackward" and getattr(args, "merge_bw", False):
        backward = "ppbackward-merged"  # install(merge_bw=True) in the workers; results stay under "ppbackward"
    within = scenario.schedules_within(only)
    return [
        "--backward", backward, *scenario.worker_args(), "--schedules", "all" if within is None else ",".join(within),
        "--steps", str(args.steps), "--microbatches", str(args.microbatches),
        "--device", args.device, "--backend", args.backend,
        # a case that fails on one rank leaves the others waiting for it: keep that wait short
        "--case-timeout", "10",
        *args.worker_arg,
    ]


class _Progress:
    """Compact progress of one launch (``check``'s terminal output): on a terminal one live line, rewritten
    as each case finishes; when the launch ends, one line for it: its cases by status, the failing ones
    named with why (``cells.progress_status_of``), and the time. Not on a terminal (CI, a pipe), only that
    last line."""

    def __init__(self, backward: str, scenario: str, t0: float) -> None:
        self.label = f"  [{backward:>10}] {scenario}"
        self.t0 = t0
        self.statuses: dict[str, str] = {}
        self.live = sys.stdout.isatty()

    def elapsed(self) -> str:
        return f"elapsed {time.perf_counter() - self.t0:5.1f} s"

    def case(self, case_id: str, per_rank: dict[int, CaseRecord]) -> None:
        self.statuses[case_id] = cells.progress_status_of(per_rank)
        if self.live:
            line = f"{self.label}: {len(self.statuses)} case(s) done, last {case_id} {self.statuses[case_id]}"
            print(f"\r{line[:150]:<150}", end="", flush=True)

    def waiting(self, what: str) -> None:
        if self.live:
            print(f"\r{f'{self.label}: {what}'[:150]:<150}", end="", flush=True)

    def done(self) -> None:
        counts: dict[str, int] = {}
        for status in self.statuses.values():
            key = status if status in ("pass", "skip") else "FAIL"  # else: "FAIL ..." (progress_status)
            counts[key] = counts.get(key, 0) + 1
        failed = [f"{case} ({status})" for case, status in self.statuses.items() if status not in ("pass", "skip")]
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no case ran"
        tail = f"; failed: {', '.join(failed)}" if failed else ""
        print(("\r" if self.live else "") + f"{self.label}: {summary}{tail} ({self.elapsed()})", flush=True)


def _run_backward(
    backward: str, scenario: Any, args: argparse.Namespace, only: list[str] | None, out_dir: Path, t0: float
) -> Any:
    from ppbackward._tools.harness.launch import launch

    progress = _Progress(backward, scenario.name, t0)
    progress.waiting(f"starting torchrun: {scenario.nproc} ranks")
    try:
        return launch(
            scenario.nproc, worker_args(backward, scenario, args, only), out_dir / backward, args.timeout,
            on_case=progress.case, on_wait=progress.waiting,
        )
    finally:
        progress.done()


def _collect(result: Any) -> dict[str, cells.Cell]:
    return {case_id: cells.cell_values(result.case(case_id)) for case_id in result.case_ids()}


def _row_label(case_id: str, scenario: Any) -> str:
    """The schedule alone where the scenario has one model and one wrapper, else the whole case id."""
    return case_id.split("/")[0] if len(scenario.models) == 1 and len(scenario.wraps) == 1 else case_id


def _memory() -> dict[str, Any]:
    """Bytes of saved activations held between B and W and bytes W reads, both backwards, in process."""
    from ppbackward._tools.bench.memory import measure_split
    from ppbackward._tools.harness.models import build, parse_configs

    (config,) = parse_configs(_MEMORY_CONFIG)
    stage = build(config)
    out: dict[str, Any] = {
        "stage": f"{config.layers} TransformerEncoderLayers, d_model {config.d_model}, seq {config.seq}, "
        f"batch {config.batch}",
    }
    for backward in BACKWARDS:
        m = measure_split(backward, stage)
        out[backward] = {k: m[k] for k in ("held_bytes", "floor_bytes", "held_over_floor", "after_w_bytes")}
    return out


def _memory_ok(m: dict[str, Any]) -> bool:
    """One backward's memory passes: it holds no more between B and W than W reads, and nothing after W."""
    return m["held_over_floor"] <= 1.0 and m["after_w_bytes"] == 0


def _memory_lines(memory: dict[str, Any]) -> list[str]:
    lines = [f"memory between B and W (one stage: {memory['stage']}; in this process)"]
    for backward in BACKWARDS:
        m = memory[backward]
        verdict = "" if backward == "upstream" else (" ok" if _memory_ok(m) else " FAIL")
        lines.append(
            f"  {backward:>10}: {m['held_bytes']} B held, W reads {m['floor_bytes']} B: "
            f"{m['held_over_floor']:.2f}x{verdict}"
        )
    return lines


@dataclasses.dataclass
class _ScenarioRun:
    """One scenario's two launches and their cells (``{backward: {case id: cell values}}``)."""

    scenario: Any
    launches: dict[str, Any]
    results: dict[str, dict[str, cells.Cell]]


@dataclasses.dataclass(frozen=True)
class _LaunchFailure:
    """A launch that failed itself (not one of its cases): its ``scenario`` and ``backward`` (str), and the
    first line of its first problem, ``message`` (str)."""

    scenario: str
    backward: str
    message: str

    def __str__(self) -> str:
        return f"{self.scenario}: {self.message}"


@dataclasses.dataclass
class _Tally:
    """What the tables found, for the verdict: torch's failing rows ``(row name, cell)``, ppbackward's
    failing cases, the launches that failed, the cases ppbackward ran and skipped, and the compiled regions
    its B calls split (where a model has them)."""

    upstream_failing: list[tuple[str, cells.Cell | None]] = dataclasses.field(default_factory=list)
    ours_bad: list[str] = dataclasses.field(default_factory=list)
    launch_failed: list[_LaunchFailure] = dataclasses.field(default_factory=list)
    ours_ran: int = 0
    skipped: int = 0
    regions_split: int = 0  # compiled regions ppbackward's B calls split (Note [regions counted])
    regions_b_calls: int = 0  # the B calls they were counted over

    def launch_failures(self, backward: str) -> list[_LaunchFailure]:
        """The failed launches of ``backward`` (list[_LaunchFailure]), scenarios in order."""
        return [f for f in self.launch_failed if f.backward == backward]


def _launch_all(args: argparse.Namespace, scenarios: list[Any], only: list[str] | None, logs: Path,
                t0: float) -> list[_ScenarioRun]:
    runs = []
    for scenario in scenarios:
        print(f"\nscenario {scenario.name} ({scenario.layout}): {scenario.title}", flush=True)
        launches = {b: _run_backward(b, scenario, args, only, logs / scenario.name, t0) for b in BACKWARDS}
        runs.append(_ScenarioRun(scenario, launches, {b: _collect(r) for b, r in launches.items()}))
    return runs


def _cases(run: _ScenarioRun, only: list[str] | None) -> list[str]:
    cases = list(dict.fromkeys([*run.results["upstream"], *run.results["ppbackward"]]))
    return [c for c in cases if only is None or c.split("/")[0] in only]


def _tally_scenario(run: _ScenarioRun, only: list[str] | None, tally: _Tally) -> None:
    """Add one scenario's launch failures, ppbackward's cases and torch's failing rows to ``tally``."""
    scenario, launches, results = run.scenario, run.launches, run.results
    cases = _cases(run, only)
    for backward, result in launches.items():
        problems = result.launch_problems()
        if problems:
            tally.launch_failed.append(_LaunchFailure(scenario.name, backward, problems[0].splitlines()[0]))
    ours = results["ppbackward"]
    ran = [c for c in cases if _status(ours, c) != "skip"]
    bad = [c for c in cases if _status(ours, c) not in ("pass", "skip")]
    tally.ours_ran += len(ran)
    tally.skipped += len(cases) - len(ran)
    tally.ours_bad += [f"{scenario.name}/{c}" for c in bad]
    for case in ran:
        cell = ours.get(case)
        regions = None if cell is None or cell.measures is None else cell.measures.regions
        if regions is not None and regions.counted:
            tally.regions_split += regions.regions
            tally.regions_b_calls += regions.b_calls
    for case in cases:
        if _status(results["upstream"], case) not in ("pass", "skip"):
            row = f"{scenario.name} {_row_label(case, scenario)}"
            tally.upstream_failing.append((row, results["upstream"].get(case)))


def _status(cells_: dict[str, cells.Cell], case: str) -> str | None:
    """The status of ``case`` in one backward's cells, ``None`` where it has none (str | None)."""
    cell = cells_.get(case)
    return None if cell is None else cell.status


def _print_scenario(run: _ScenarioRun, only: list[str] | None) -> None:
    """One scenario's table, its launch problems and ppbackward's failures."""
    scenario, launches, results = run.scenario, run.launches, run.results
    cases = _cases(run, only)
    print(f"\n{scenario.name} ({scenario.layout}): {scenario.title}")
    print(cells.table(results, [(c, _row_label(c, scenario)) for c in cases], BACKWARDS))
    for backward, result in launches.items():
        if result.launch_problems():
            print(f"{backward}: the launch itself failed:\n{result.format_launch()}\n")
    ours = results["ppbackward"]
    bad = [c for c in cases if _status(ours, c) not in ("pass", "skip")]
    if bad and not launches["ppbackward"].launch_problems():
        print("ppbackward failures:\n" + launches["ppbackward"].format_failures() + "\n")


def _merge_lines(runs: list[_ScenarioRun], only: list[str] | None) -> list[str]:
    """What ``--merge-bw`` did on ppbackward's side: per scenario, each case of a schedule that splits
    its backward as *pairs merged / B actions planned*, summed over the ranks (from each rank's action
    lists: the full backwards its lowered list runs beyond those torch planned, against the B actions
    of torch's compute-only list; Note [merged B and W]), or a line saying that no schedule run splits
    its backward."""
    from ppbackward._tools.harness import schedules

    lines = []
    for run in runs:
        cases = []
        for case, cell in run.results["ppbackward"].items():
            name = case.split("/")[0]
            rule = schedules.RULES.get(name)
            acts = {} if cell.measures is None else cell.measures.actions
            if (only is None or name in only) and rule is not None and rule.split_backward and acts:
                lowered, planned = acts["lowered"], acts["planned"]
                cases.append(f"{_row_label(case, run.scenario)} {lowered['B'] - planned['B']}/{planned['I']}")
        if cases:
            lines.append(f"  {run.scenario.name}: " + ", ".join(cases))
    if not lines:
        return ["merge_bw: no schedule run splits its backward into B and W: nothing was merged"]
    return ["merge_bw: B/W pairs run as one full backward, of the B actions torch planned (all ranks, one step):",
            *lines]


def _print_upstream_footnotes(tally: _Tally, logs: Path, keep: bool) -> None:
    if not tally.upstream_failing:
        return
    print("\ntorch's own backward failed, by kind (why, and the public report; the rows; one failure as recorded):")
    footnotes = cells.footnotes(tally.upstream_failing)
    print("\n".join(cells.format_footnotes(footnotes)))
    quoted = [note.quoted.failure for note in footnotes if note.quoted is not None]
    notes = []
    if any(f.check == "garbage" for f in quoted):  # its message gives the cycles' bytes as "(N B pinned)"
        notes.append('"B pinned": bytes of the tensors found in the cycles')
    if any(f.check == "exception" for f in quoted):  # quoted as "rank r, exception: ..."
        where = f"{logs}/<scenario>" if keep else "--logs DIR keeps them in <DIR>/<scenario>"
        notes.append(f"full tracebacks: {where}/upstream/rank<r>.json, cases[].error")
    if notes:
        print(f"  ({'; '.join(notes)})")


def _verdict(tally: _Tally, memory: dict[str, Any], passed: bool, memory_ok: bool) -> str:
    """``ppbackward PASS on ...; torch's own backward failed ...``: the two halves of the verdict line."""
    ours_launch = tally.launch_failures("ppbackward")
    if ours_launch:
        outcome = f"FAIL: its launch failed ({ours_launch[0]})"
    elif passed:
        outcome = f"PASS on {tally.ours_ran}/{tally.ours_ran} cases and memory"
    else:
        what = [f"{len(tally.ours_bad)}/{tally.ours_ran} cases"] if tally.ours_bad else []
        what += [] if memory_ok else ["memory"]
        outcome = f"FAIL on {' and '.join(what)}"
    if tally.regions_b_calls:  # Note [regions counted] in ppbackward._tools.harness.probes
        outcome += f" (compiled regions split into B and W: {tally.regions_split} in {tally.regions_b_calls} B calls)"
    upstream_launch = tally.launch_failures("upstream")
    upstream = (
        f"torch's own launch failed ({upstream_launch[0]})"
        if upstream_launch
        else f"torch's own backward failed {len(tally.upstream_failing)}/{tally.ours_ran}"
    )
    upstream += f", held {memory['upstream']['held_over_floor']:.2f}x what W reads"
    if tally.skipped:
        upstream += f"; {tally.skipped} skipped (reasons in the tables)"
    return f"ppbackward {outcome}; {upstream}"


def _json_text(args: argparse.Namespace, runs: list[_ScenarioRun], memory: dict[str, Any], passed: bool, verdict: str,
               logs: Path | None) -> str:
    """``--json``'s text (docs/cli.md lists its keys): the run's settings, every cell, memory and verdict."""
    payload = {
        "torch": torch.__version__,
        "backend": args.backend,
        "device": args.device,
        "steps": args.steps,
        "scenarios": {
            r.scenario.name: {
                "title": r.scenario.title,
                "nproc": r.scenario.nproc,
                "dp": r.scenario.dp,
                "models": list(r.scenario.models),
                "wraps": list(r.scenario.wraps),
                "results": {b: {c: cell.to_json() for c, cell in by_case.items()} for b, by_case in r.results.items()},
                "launch_problems": {b: launch.launch_problems() for b, launch in r.launches.items()},
            }
            for r in runs
        },
        "memory": memory,
        "passed": passed,
        "merge_bw": bool(args.merge_bw),
        "verdict": verdict,
        "logs": None if logs is None else str(logs),
    }
    return json.dumps(payload, indent=1)


def run(args: argparse.Namespace) -> int:
    """The ``check`` command; returns the process exit code."""
    scenarios, only = _validate(args)
    t0 = time.perf_counter()
    print(
        f"ppbackward check: torch {torch.__version__}; scenarios {', '.join(s.name for s in scenarios)}; "
        f"{args.steps} step(s) per case" + ("; ppbackward with merge_bw=True" if args.merge_bw else ""),
        flush=True,
    )
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="ppbackward-check-"))
    try:
        runs = _launch_all(args, scenarios, only, logs, t0)
    except KeyboardInterrupt:  # the launch stopped, every process of it killed (Note [killing a hung launch])
        print(f"\nppbackward check: interrupted; the logs so far: {logs}", file=sys.stderr)
        raise SystemExit(130) from None
    except SystemExit as e:  # SIGTERM, SIGHUP (Note [a terminated launcher stops its launch])
        print(f"\nppbackward check: stopped; the logs so far: {logs}", file=sys.stderr)
        raise SystemExit(e.code) from None
    print(f"\nmeasuring the memory held between B and W, both backwards, in this process "
          f"(elapsed {time.perf_counter() - t0:.1f} s)", flush=True)
    memory = _memory()
    tally = _Tally()
    for scenario_run in runs:
        _tally_scenario(scenario_run, only, tally)
    elapsed = time.perf_counter() - t0
    memory_ok = _memory_ok(memory["ppbackward"])
    passed = not tally.ours_bad and not tally.launch_failures("ppbackward") and memory_ok
    keep = bool(args.logs) or not passed
    where = f"logs: {logs}" if keep else "logs deleted; --logs DIR keeps them"
    verdict = f"VERDICT: {_verdict(tally, memory, passed, memory_ok)} ({elapsed:.0f} s; {where})"
    print(f"\n{verdict}")  # the verdict and torch's failures by kind first; the cells follow
    _print_upstream_footnotes(tally, logs, keep)
    for scenario_run in runs:
        _print_scenario(scenario_run, only)
    print()
    if args.merge_bw:
        print("\n".join(_merge_lines(runs, only)) + "\n")
    for line in _memory_lines(memory):
        print(line)
    if not keep:
        shutil.rmtree(logs, ignore_errors=True)  # a passing run leaves nothing behind; --logs keeps them
    print(verdict)
    outputs = []
    if args.json:
        outputs.append(("--json", args.json, _json_text(args, runs, memory, passed, verdict, logs if keep else None)))
    if args.markdown:
        outputs.append(("--markdown", args.markdown,
                        _markdown(args, runs, only, tally, verdict, passed, _memory_lines(memory))))
    for option, path, text in outputs:  # writable when checked before the launches (_check_outputs)
        if not written("check", option, path, text):
            return 1
    return 0 if passed else 1


def _markdown(
    args: argparse.Namespace, runs: list[_ScenarioRun], only: list[str] | None, tally: _Tally, verdict: str,
    passed: bool, memory: list[str],
) -> str:
    """``--markdown``: the verdict first, then torch's failures by kind, then each scenario's cells, as
    GitHub-flavoured markdown (the same verdict line the terminal and ``--json`` carry)."""
    parts = [
        f"## ppbackward check: {'PASS' if passed else 'FAIL'}",
        "",
        f"`{verdict}`",
        "",
        f"torch {torch.__version__}; scenarios {', '.join(r.scenario.name for r in runs)}; {args.steps} step(s) "
        "per case" + ("; ppbackward with merge_bw=True" if args.merge_bw else ""),
    ]
    if tally.upstream_failing:
        kinds = cells.by_kind(tally.upstream_failing, markdown=True)
        parts += ["", "### torch's own backward failed, by kind", "", *kinds]
    parts += ["", "### Memory between B and W", "", "```text", *memory, "```", "", "### Cells"]
    for run in runs:
        results = run.results
        cases = list(dict.fromkeys([*results["upstream"], *results["ppbackward"]]))
        cases = [c for c in cases if only is None or c.split("/")[0] in only]
        parts += ["", f"#### {run.scenario.name} ({run.scenario.layout}): {run.scenario.title}", ""]
        parts.append(cells.table(results, [(c, _row_label(c, run.scenario)) for c in cases], BACKWARDS, markdown=True))
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ppbackward check``; returns the exit code (2 for a bad request)."""
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except CheckError as e:
        print(f"ppbackward check: error: {e}", file=sys.stderr)
        return 2
