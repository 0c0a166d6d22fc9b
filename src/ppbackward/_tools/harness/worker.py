"""Private: the torchrun worker. Runs many (schedule × model) cases per launch, one JSON verdict per rank.

Run by :mod:`ppbackward._tools.harness.launch`, or by hand::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m ppbackward._tools.harness.worker --out /tmp/pp --backward ppbackward

Every step runs through the one pipeline-step runner (:func:`ppbackward._tools.harness.runner.run_step`,
Note [probe phases] there) under a list of probes. ``--mode check`` (the default, ``ppbackward check``)
runs every (schedule × model × wrapper) case under the check's probes
(:func:`ppbackward._tools.harness.probes.check_probes`, whose docstring cites the notes): per rank and per
measured step a ``StepRecord`` in ``<out>/rank<r>.json`` with

1. **garbage** — tensors and autograd nodes found by ``check_tensor_leaks`` around ``schedule.step``;
2. **lifetime** — with the gc disabled, the saved activations still alive after
   ``clear_runtime_states()`` and after releasing what the stage keeps by design, its receive buffers
   (Note [kept by design]), then after a gc run;
3. **caches** — the stage's per-microbatch caches after the step (Note [kept caches]);
4. **numerics** — each microbatch's loss and every local parameter's grad against a single-process
   reference of the same stack on the same microbatches (sum-reduced loss, ``scale_grads=False``),
   within the case's tolerance (Note [one numerics rule]: ``probes.CHECK_TOLERANCE`` here);
5. **hooks** — ``register_post_accumulate_grad_hook`` calls: once per trainable parameter per microbatch
   (``ModelSpec.accumulations`` times for a parameter the model accumulates into more often: titan's ``lm_head``).

``--mode bench`` (``ppbackward bench --schedule``) runs the schedule variants of Note [schedule
benchmark] (:mod:`ppbackward._tools.harness.schedule_bench`) under the bench's probes instead, one case per
variant.

``--backward`` selects the stage backward: ``upstream`` (torch's own), ``ppbackward``
(``ppbackward.install()``), ``ppbackward-merged`` (``ppbackward.install(merge_bw=True)``: Note [merged B
and W] in :mod:`ppbackward._merge`; each case records its rank's compute actions by kind, as lowered and
as torch planned them, in ``actions``: :func:`action_counts`), or ``leaky:<module or path.py>`` (a
test-only module whose ``install()`` swaps in a deliberately leaky backward).

Every case runs on its own gloo subgroup with ``--case-timeout``; an exception in a case is recorded and
the ranks resynchronise on the world group (``--pg-timeout``) before the next case. The verdict file
(:class:`~ppbackward._tools.harness.records.RankVerdict`) is written once the process group is up and
rewritten after every case, so a rank killed mid-run still leaves the cases it finished; every failure in it
carries its kind, set here (Note [failure kinds] in :mod:`ppbackward._tools.harness.records`). Progress goes
to ``rank<r>.events.jsonl`` as it happens (``started``, ``case_start``, ``step_end``, ``case_end`` with the
case's record, ``done`` or ``fatal``: Note [event stream] there), which the launcher's progress line and hang
clock read (Note [hang clock] in :mod:`ppbackward._tools.harness.launch`). ``SIGUSR1`` makes
``faulthandler`` dump every thread's stack to the
rank's log (the launcher sends it before killing a hung launch).

Note [timeouts scale with start-up]: the gloo timeouts decide whether a rank waiting for a peer gives up,
so on a busy machine a fixed number of seconds would turn a slow peer into a false failure. The launcher
passes ``--launched-at`` (its clock when it started torchrun); once the world process group is up, the
ranks agree (all-reduce max) on how long this launch took to start, and ``--case-timeout`` and
``--pg-timeout`` are multiplied by ``max(1, startup / REFERENCE_STARTUP_S)``: the machine's slowness at
this moment, measured. The factor and the timeouts in force are in the verdict (``timeouts``). (Timeouts
only decide when a waiting rank gives up; whether a launch hangs is judged by events: Note [hang clock].)

On gloo with torch 2.5-2.7, whose schedules drop P2P works and hang, the worker puts in
:mod:`ppbackward._tools.harness.gloo_p2p` for both backwards and lists it in the verdict's ``workarounds``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import faulthandler
import functools
import gc
import importlib
import importlib.util
import inspect
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ppbackward._compat import torch_release
from ppbackward._install import NAMES
from ppbackward._tools.harness import diagnose, gloo_p2p, parallel, probes, runner, schedule_bench
from ppbackward._tools.harness import models as zoo
from ppbackward._tools.harness import schedules as sched
from ppbackward._tools.harness.actions import count_compute
from ppbackward._tools.harness.records import (
    CaseRecord,
    EventWriter,
    Failure,
    RankVerdict,
    Timeouts,
    write_verdict,
)
from ppbackward._tools.torchrun import write_pid_file

__all__ = ["main"]

#: Seconds from torchrun's start to a 2-rank world process group on 2 idle cores (torch 2.13, CPU; measured
#: 2.6-3.1 s):
#: Note [timeouts scale with start-up].
REFERENCE_STARTUP_S = 3.0


# ----------------------------------------------------------------------------------------------------
# backward selection


def _load_module(spec: str) -> Any:
    if spec.endswith(".py") or os.sep in spec:
        path = Path(spec).resolve()
        mod_spec = importlib.util.spec_from_file_location(f"_ppb_leaky_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise ImportError(f"cannot load {path}")
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = mod
        mod_spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(spec)


def select_backward(mode: str) -> dict[str, str]:
    """Install the stage backward ``mode`` names; return what ``pipelining.stage`` now calls."""
    stage_mod = importlib.import_module("torch.distributed.pipelining.stage")
    if mode == "upstream":
        with contextlib.suppress(ImportError):
            import ppbackward

            ppbackward.uninstall()
    elif mode in ("ppbackward", "ppbackward-merged"):
        import ppbackward

        ppbackward.install(merge_bw=mode == "ppbackward-merged")
        adapter = ppbackward.active_adapter()
        if adapter is None:
            raise RuntimeError("ppbackward.install() returned but reports no active adapter")
        for name in NAMES:
            if getattr(stage_mod, name) is not adapter.functions[name]:
                raise RuntimeError(f"ppbackward.install() did not replace pipelining.stage.{name}")
    elif mode.startswith("leaky:"):
        _load_module(mode[len("leaky:") :]).install()
    else:
        raise ValueError(
            f"unknown --backward {mode!r}: expected upstream, ppbackward, ppbackward-merged or leaky:<module>"
        )
    found = {name: getattr(stage_mod, name) for name in NAMES}
    return {name: f"{fn.__module__}.{fn.__qualname__}" for name, fn in found.items()}


# ----------------------------------------------------------------------------------------------------
# one case


_MESSAGE_CHARS = 200


def _first_line(e: BaseException) -> str:
    """``Type: first line of the message``, cut at ``_MESSAGE_CHARS`` with ``...`` (the traceback has it all)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if len(first) > _MESSAGE_CHARS:
        first = first[: _MESSAGE_CHARS - 3].rstrip() + "..."
    return f"{type(e).__name__}: {first}"


def _describe(e: BaseException) -> str:
    """``Type: first line`` of ``e`` and of its root cause (torch wraps errors in multi-line messages)."""
    root, seen = e, {id(e)}
    while True:
        nxt = root.__cause__ or root.__context__
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        root = nxt
    if root is e:
        return _first_line(e)
    return f"{_first_line(e)} (caused by {_first_line(root)})"


def _to_device(batch: zoo.Batch, device: torch.device) -> zoo.Batch:
    """The batch's tensors on ``device`` (the reference keeps the CPU copy)."""
    if device.type == "cpu":
        return batch
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return dataclasses.replace(
        batch,
        args=tuple(move(a) for a in batch.args),
        kwargs={k: move(v) for k, v in batch.kwargs.items()},
        target=move(batch.target),
    )


@functools.cache
def _first_stage_check_drops_kwargs() -> bool:
    """Note [torch 2.5 kwargs check]: torch 2.5's ``_validate_fwd_input`` checks stage 0's positional
    inputs against its ``input_args`` minus one per keyword argument (``expected_args[: len(expected_args)
    - len(kwargs)]``), so a stage called with keyword arguments (the ``transformer`` model's ``mask``)
    fails with "Number of values (1) does not match expected number (0)" unless ``input_args`` carries
    one placeholder per keyword argument. Stage 0 never reads ``input_args`` otherwise (its inputs are
    the microbatch); later releases dropped the check.
    """
    from torch.distributed.pipelining.stage import _PipelineStageBase

    fn = getattr(_PipelineStageBase, "_validate_fwd_input", None)
    try:
        source = inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        return False
    return "len(expected_args)-len(kwargs)" in source.replace(" ", "")


def _run_unmeasured(case: runner.CaseRun, batch: zoo.Batch) -> None:
    """One ``schedule.step`` started as the measured steps start (``runner.start_step``), under the
    activation tracker as they run (a compiled region compiles for the tracker's torch-function mode too),
    then the stage state and side-effect counters reset."""
    args, kwargs = runner.start_step(case, batch)
    with probes.ActivationProbe().record():
        case.schedule.step(*args, **kwargs)
    del args, kwargs
    for stage in case.pp_stages:
        stage.clear_runtime_states()
    case.spec.side_effects(case.modules, case.reference, case.n_microbatches, 1)  # a reset: failures dropped


def case_id(schedule: str, model: str, wrap: str = "none") -> str:
    """``Schedule/model``, with ``+wrap`` for a data-parallel wrapper (``ScheduleGPipe/mlp+ddp``)."""
    return f"{schedule}/{model}" + ("" if wrap == "none" else f"+{wrap}")


def action_counts(schedule: Any) -> dict[str, dict[str, int]]:
    """This rank's compute actions by kind (``{"F": n, "B": n (full backwards), "I": n (B), "W": n}``,
    top-level actions): ``"lowered"``, the list the runtime runs (``pipeline_order_with_comms``), and
    ``"planned"``, the compute-only list as torch planned it (``pipeline_order``, which the merge of
    Note [merged B and W] leaves alone), so that ``lowered["B"] - planned["B"]`` is the pairs merged.
    ``{}`` for a schedule without a lowered list."""
    lowered = getattr(schedule, "pipeline_order_with_comms", None)
    planned = getattr(schedule, "pipeline_order", None)
    if not lowered or not planned:
        return {}
    return {"lowered": count_compute(lowered[schedule.rank]), "planned": count_compute(planned[schedule.rank])}


def _exception_kind(e: BaseException, trace: str) -> str:
    """The kind of an exception a case stopped on, decided where it is caught (Note [failure kinds] in
    ``records``): the first of ``diagnose.KINDS`` (most telling first) one of whose ``raised_with`` texts is
    in the message of ``e`` or of an exception it was raised from, or, for an ``in_traceback`` kind
    (Note [DDP and shape inference] in ``diagnose``), in the whole traceback ``trace``; ``other`` for none."""
    messages: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        messages.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    for kind in diagnose.KINDS:
        where = [*messages, trace] if kind.in_traceback else messages
        if any(text in w for text in kind.raised_with for w in where):
            return kind.key
    return diagnose.OTHER.key


def _exception_failure(e: BaseException) -> tuple[Failure, str]:
    """The failure of a case stopped by ``e`` (its kind set here: :func:`_exception_kind`) and its traceback."""
    trace = traceback.format_exc()
    return Failure("exception", _exception_kind(e, trace), _describe(e), raised=type(e).__name__), trace


@dataclasses.dataclass
class _Case:
    """One case's setting on this rank (what :func:`run_case` takes, less the schedule and the model)."""

    rank: int
    steps: int
    seed: int
    case_timeout: float
    metadata: str
    device: torch.device
    backend: str
    layout: parallel.Layout
    wrap: str
    mesh: Any
    events: EventWriter | None = None


def _static_metadata(case: sched.ScheduleCase, spec: zoo.ModelSpec, reference: list, stage_ids: list[int],
                     seed: int) -> dict[int, dict[str, Any]]:
    """``input_args``/``output_args`` of this rank's stages, from the reference run on the first batch."""
    first_batch = zoo.make_batch(spec, case.n_microbatches, seed=parallel.batch_seed(seed, 0, 0))
    examples = zoo.stage_examples(reference, first_batch, case.n_microbatches)
    meta = {i: {"input_args": examples[i][0], "output_args": examples[i][1]} for i in stage_ids}
    if 0 in meta and first_batch.kwargs and _first_stage_check_drops_kwargs():
        pad = tuple(torch.empty(0) for _ in first_batch.kwargs)  # Note [torch 2.5 kwargs check]
        meta[0]["input_args"] = (*meta[0]["input_args"], *pad)
    return meta


def _build(
    case: sched.ScheduleCase, spec: zoo.ModelSpec, c: _Case, record: CaseRecord, groups: Any
) -> runner.CaseRun:
    """This rank's stages of ``spec`` for ``case``, wrapped, their schedule, and the step context (with
    its hook counter registered); records the schedule's actions in ``record``."""
    from torch.distributed.pipelining import PipelineStage

    modules = zoo.build_stages(spec, case.num_stages, c.seed)
    reference = copy.deepcopy(modules)
    local = {i: spec.prepare(modules[i].to(c.device)) for i in record.stages}
    del modules
    wrapped = {i: parallel.wrap(local[i], c.wrap, groups) for i in record.stages}
    named = [pair for i in record.stages for pair in zoo.param_names(i, local[i])]  # FSDP2: sharded params
    meta: dict[int, dict[str, Any]] = {i: {} for i in record.stages}
    if c.metadata == "static":
        meta = _static_metadata(case, spec, reference, record.stages, c.seed)
    pp_stages = [
        PipelineStage(wrapped[i], i, case.num_stages, c.device, group=groups.pp, **meta[i]) for i in record.stages
    ]
    del meta, wrapped
    schedule = case.build(pp_stages, spec.loss_of(local.get(case.num_stages - 1)))
    record.actions = action_counts(schedule)
    # FSDP2's autograd runs on unsharded copies of its parameters: hooks on the sharded ones never fire
    return runner.CaseRun(
        schedule, pp_stages, local, named, spec, case.n_microbatches, probes.CHECK_TOLERANCE, c.wrap, groups.dp,
        reference,
    )


def _run_steps(ctx: runner.CaseRun, check: list[runner.Probe], c: _Case, record: CaseRecord) -> None:
    """The unmeasured warm-up steps, then ``c.steps`` measured ones under the ``check`` probes into
    ``record`` (Note [gc freeze])."""
    spec, n_mb, (dp_rank, _) = ctx.spec, ctx.n_microbatches, c.layout.coords(c.rank)
    for _ in range(spec.warmup_steps):  # unmeasured (see ModelSpec.warmup_steps)
        warm = zoo.make_batch(spec, n_mb, seed=parallel.batch_seed(c.seed, 99, dp_rank))
        _run_unmeasured(ctx, _to_device(warm, c.device))
        del warm
    spec.side_effects(ctx.modules, ctx.reference, n_mb, 1)  # counts start now (not the metadata forward)
    reference_loss = spec.loss_of(ctx.reference[-1])
    # Note [gc freeze]: everything alive now moves to the permanent generation, so the collections
    # the probes run per step scan only what the step created (~100x faster with torch imported).
    # Semantics are unchanged: a cycle among new objects is found as before, and a new object
    # referenced from a frozen one is reachable, as it is.
    gc.collect()
    gc.freeze()
    for step in range(c.steps):
        shards = [zoo.make_batch(spec, n_mb, seed=parallel.batch_seed(c.seed, step, d)) for d in range(c.layout.dp)]
        ref = zoo.mean_reference(ctx.reference, shards, n_mb, reference_loss, own=dp_rank)
        batch_box = [_to_device(shards[dp_rank], c.device)]
        del shards
        step_record, failures = runner.run_step(ctx, check, batch_box, step, ref)
        record.steps.append(step_record)
        record.failures += failures
        if c.events is not None:
            c.events.emit("step_end", case=record.id, step=step)
    record.status = "fail" if record.failures else "pass"


def _new_record(case: sched.ScheduleCase, spec: zoo.ModelSpec, c: _Case) -> CaseRecord:
    """The case's record before it runs: what it is, and ``skip``/``fail`` for a case that cannot run."""
    dp_rank, pp_rank = c.layout.coords(c.rank)
    record = CaseRecord(
        id=case_id(case.name, spec.name, c.wrap), schedule=case.name, model=spec.name, wrap=c.wrap,
        world_size=c.layout.dp * c.layout.pp, dp=c.layout.dp, dp_rank=dp_rank,
    )
    unavailable = None  # Note [what torch 2.5 cannot run] in ppbackward._tools.harness.models
    if case.rule is not None:
        unavailable = zoo.unavailable(spec, case.rule.split_backward) or parallel.wrap_unavailable(c.wrap, c.device)
    if case.skip or unavailable:
        record.status, record.reason = "skip", case.skip or unavailable
    elif case.error:
        record.status, record.failures = "fail", [Failure("case", diagnose.OTHER.key, case.error)]
    else:
        record.stages, record.num_stages = case.stage_indices(pp_rank), case.num_stages
        record.n_microbatches, record.metadata = case.n_microbatches, c.metadata
    return record


def run_case(case: sched.ScheduleCase, spec: zoo.ModelSpec, c: _Case) -> CaseRecord:
    """Build this rank's stages of ``spec`` for ``case``, run ``c.steps`` measured steps, return the record.

    ``c.layout`` places this rank in the dp x pp ``c.mesh`` (Note [dp x pp layout] in
    ``ppbackward._tools.harness.parallel``); ``c.wrap`` names the data-parallel wrapper of every stage
    module. An exception is recorded (status ``error``, its failure's kind set here), never raised.
    """
    record = _new_record(case, spec, c)
    if record.status != "pass":  # skipped, or failed before it runs
        return record
    groups = parallel.make_groups(c.layout, c.backend, c.case_timeout, c.mesh)
    check: list[runner.Probe] = []
    try:
        ctx = _build(case, spec, c, record, groups)
        check = probes.check_probes(ctx)  # the hook counter is registered here
        _run_steps(ctx, check, c, record)
    except Exception as e:
        failure, record.error = _exception_failure(e)
        record.status, record.failures = "error", [failure]
    finally:
        gc.unfreeze()
        for probe in check:
            probe.close()
    if record.status != "error":
        groups.destroy()  # groups with pending ops after an error are left alone
    return record


# ----------------------------------------------------------------------------------------------------
# main


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ppbackward._tools.harness.worker", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for rank<r>.json verdicts and rank<r>.log logs")
    p.add_argument(
        "--backward", default="upstream", help="upstream | ppbackward | ppbackward-merged | leaky:<module or path.py>"
    )
    p.add_argument("--schedules", default="all", help="comma-separated schedule class names, or 'all'")
    p.add_argument(
        "--models", default="core",
        help=f"comma-separated models ({','.join(zoo.MODELS)}), or 'core' ({','.join(zoo.CORE_MODELS)}), "
        f"'training' ({','.join(zoo.TRAINING_MODELS)}) or 'all'",
    )
    p.add_argument(
        "--metadata",
        choices=("static", "dynamic"),
        default=None,
        help="dynamic: torch infers shapes on the first step (its default; needs numpy); "
        "static: every PipelineStage gets example inputs/outputs (default: dynamic, static on torch < 2.6, "
        "whose PipelineStage requires input_args, and for DDP: Note [DDP and shape inference] in "
        "ppbackward._tools.harness.diagnose)",
    )
    p.add_argument(
        "--dp", type=int, default=1, help="data-parallel degree: the world is dp pipelines of world/dp ranks"
    )
    p.add_argument(
        "--wraps", default="none",
        help=f"comma-separated data-parallel wrappers of every stage module ({', '.join(parallel.WRAPS)}); "
        "each is a case of its own",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: rank r uses cuda:LOCAL_RANK")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="process-group backend")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=0, help="microbatches per step (0: each schedule's rule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pg-timeout", type=float, default=300.0,
        help="world process-group timeout (s): the barriers between cases wait this long for a rank whose case is slow",
    )
    p.add_argument("--case-timeout", type=float, default=30.0, help="per-case subgroup timeout (s)")
    p.add_argument(
        "--launched-at", type=float, default=None,
        help="time.time() when the launcher started torchrun: scales the timeouts "
        "(Note [timeouts scale with start-up])",
    )
    p.add_argument("--hang-rank", type=int, default=None, help="test only: this rank blocks in a recv forever")
    p.add_argument(
        "--mode", choices=("check", "bench"), default="check",
        help="check: the cases under the check's probes; bench: the schedule benchmark's variants under the "
        "bench's probes (Note [schedule benchmark] in ppbackward._tools.harness.schedule_bench)",
    )
    bench = p.add_argument_group("--mode bench (--microbatches 0: 8)")
    bench.add_argument("--repeats", type=int, default=8, help="timed steps per schedule variant")
    bench.add_argument("--layers-per-stage", type=int, default=4, help="encoder layers per stage")
    bench.add_argument("--d-model", type=int, default=128, help="width of the encoder layers")
    bench.add_argument("--seq", type=int, default=16, help="sequence length")
    bench.add_argument("--microbatch-size", type=int, default=2, help="samples per microbatch")
    bench.add_argument(
        "--compile", default="", metavar="BACKEND",
        help="torch.compile every layer with BACKEND (Note [compiled schedule benchmark] in "
        "ppbackward._tools.harness.schedule_bench); default: eager",
    )
    return p.parse_args(argv)


def _scale_timeouts(args: argparse.Namespace, device: torch.device) -> Timeouts:
    """Scale ``args.case_timeout`` and ``args.pg_timeout`` in place by the measured start-up of this
    launch (Note [timeouts scale with start-up]); return what is in force."""
    startup = 0.0 if args.launched_at is None else max(0.0, time.time() - args.launched_at)
    slowest = torch.tensor([startup], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    startup = float(slowest.item())
    factor = max(1.0, startup / REFERENCE_STARTUP_S)
    args.case_timeout *= factor
    args.pg_timeout *= factor
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if factor > 1.0 and set_timeout is not None:
        # the world group's (its barriers between cases); gloo's point-to-point ops keep the timeout their
        # group was made with, so every case makes its subgroup after this, with the scaled case timeout
        set_timeout(timedelta(seconds=args.pg_timeout))
    return Timeouts(round(startup, 3), round(factor, 3), round(args.case_timeout, 1), round(args.pg_timeout, 1))


def _redirect_output(path: Path) -> Any:
    log = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    return log


def _validate(args: argparse.Namespace, world_size: int) -> list[str]:
    """The wrappers asked for; ``SystemExit`` with what is wrong for a bad argument."""
    wraps = [w.strip() for w in args.wraps.split(",") if w.strip()]
    unknown_wraps = sorted(set(wraps) - set(parallel.WRAPS))
    if unknown_wraps or not wraps:
        raise SystemExit(f"--wraps {args.wraps!r}: known wrappers are {', '.join(parallel.WRAPS)}")
    if not 0 < args.case_timeout < args.pg_timeout:
        raise SystemExit(
            "--case-timeout must be positive and below --pg-timeout (the ranks resynchronise on the world group)"
        )
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.dp < 1 or world_size % args.dp:
        raise SystemExit(f"--dp {args.dp}: the world size {world_size} must be a multiple of it")
    return wraps


def _selected(args: argparse.Namespace) -> tuple[list[str] | None, list[zoo.ModelSpec]]:
    """The schedules (``None``: all) and models asked for; ``ValueError`` for an unknown schedule, and a
    ``RuntimeError`` for ``--metadata dynamic`` without numpy."""
    if args.metadata == "dynamic":
        try:
            import numpy  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "--metadata dynamic needs numpy: torch's metadata inference sends objects with "
                "recv_object_list, which calls Tensor.numpy(); install numpy or use --metadata static"
            ) from None
    only = None if args.schedules == "all" else [n.strip() for n in args.schedules.split(",") if n.strip()]
    known = set(sched.RULES) | set(sched.discover())
    unknown = sorted(set(only or ()) - known)
    if unknown:
        raise ValueError(f"unknown schedule(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return only, [zoo.get_model(m) for m in zoo.model_names(args.models)]


def _start(
    args: argparse.Namespace, verdict: RankVerdict, layout: parallel.Layout, say: Any
) -> tuple[torch.device, Any]:
    """Install the backward, start the process group, scale the timeouts; return the device and the mesh."""
    verdict.installed = select_backward(args.backward)
    say(f"backward={args.backward}: {verdict.installed['stage_backward']}")
    if args.backend == "gloo" and gloo_p2p.apply():  # Note [dropped P2P works]
        verdict.workarounds.append(gloo_p2p.DESCRIPTION)
        say(f"workaround: {gloo_p2p.DESCRIPTION}")
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", verdict.rank)))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.pg_timeout))
    verdict.timeouts = _scale_timeouts(args, device)
    say(f"timeouts: {verdict.timeouts}")
    mesh = parallel.make_mesh(layout, device.type)
    if mesh is not None and tuple(mesh.get_coordinate() or ()) != layout.coords(verdict.rank):
        where = layout.coords(verdict.rank)
        raise RuntimeError(f"rank {verdict.rank}: mesh coordinate {mesh.get_coordinate()} != {where}")
    return device, mesh


def _hang_for_test(rank: int, world_size: int, say: Any) -> None:
    """``--hang-rank``: that rank blocks in a receive nobody sends, the others in a barrier."""
    say(f"--hang-rank {rank}: blocking in dist.recv from rank {(rank + 1) % world_size} (test option)")
    dist.recv(torch.zeros(1), src=(rank + 1) % world_size)


def _run_cases(args: argparse.Namespace, verdict: RankVerdict, c: _Case, wraps: list[str], say: Any,
               write: Any) -> None:
    """Every (schedule x model x wrapper) case, one after another, each announced and reported as events."""
    only, specs = _selected(args)
    explicit_metadata = args.metadata_asked
    for case, spec, wrap in (
        (s, m, w) for s in sched.matrix(c.layout.pp, only, args.microbatches) for m in specs for w in wraps
    ):
        cid = case_id(case.name, spec.name, wrap)
        say(f"case {cid}")
        assert c.events is not None
        c.events.emit("case_start", case=cid)
        t0 = time.perf_counter()
        # static for DDP: Note [DDP and shape inference] in ppbackward._tools.harness.diagnose
        metadata = explicit_metadata or ("static" if wrap == "ddp" else spec.metadata) or args.metadata
        record = run_case(case, spec, dataclasses.replace(c, metadata=metadata, wrap=wrap))
        record.seconds = round(time.perf_counter() - t0, 3)
        verdict.cases.append(record)
        write()
        c.events.emit("case_end", case=cid, record=record)
        say(f"{record.id}: {record.status} ({record.seconds:.2f}s)")
        for failure in record.failures[:10]:
            say(f"    {failure.text}")  # the traceback of an error is in the JSON verdict
        dist.barrier()  # resynchronise before the next case (world group, --pg-timeout)


def _run_bench(args: argparse.Namespace, verdict: RankVerdict, events: EventWriter, write: Any) -> None:
    """``--mode bench``: the schedule benchmark's variants, one case each (Note [schedule benchmark])."""
    config = schedule_bench.BenchConfig(
        layers_per_stage=args.layers_per_stage, d_model=args.d_model, seq=args.seq,
        microbatches=args.microbatches or schedule_bench.BenchConfig.microbatches,
        microbatch_size=args.microbatch_size, compile=args.compile,
    )
    verdict.mode, verdict.tolerance = "bench", schedule_bench.BENCH_TOLERANCE
    verdict.cases = schedule_bench.run(config, args.repeats, verdict.rank, verdict.world_size, events)
    write()


def _new_verdict(args: argparse.Namespace, rank: int, world_size: int) -> RankVerdict:
    return RankVerdict(
        rank=rank, world_size=world_size, backward=args.backward, torch=torch.__version__,
        tolerance=probes.CHECK_TOLERANCE, kept_by_design=dict(probes.KEPT_BY_DESIGN), dp=args.dp,
        metadata=args.metadata,
    )


def main(argv: list[str] | None = None) -> int:
    """Run every case asked for on this rank; write ``rank<r>.json`` and ``rank<r>.events.jsonl`` into ``--out``
    (Note [event stream] in ``ppbackward._tools.harness.records``). Returns 0; raises what stopped the rank."""
    args = _parse(argv)
    args.metadata_asked = args.metadata
    if args.metadata is None:
        args.metadata = "static" if torch_release()[:2] < (2, 6) else "dynamic"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wraps = _validate(args, world_size)
    layout = parallel.Layout(args.dp, world_size // args.dp)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = _redirect_output(out / f"rank{rank}.log")
    write_pid_file(out, rank)
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # Note [killing a hung launch]
    torch.set_num_threads(1)
    verdict = _new_verdict(args, rank, world_size)
    events = EventWriter(out, rank, log=out / f"rank{rank}.log")
    t_start = time.perf_counter()
    write = functools.partial(write_verdict, out / f"rank{rank}.json", verdict)

    def say(msg: str) -> None:
        print(f"[rank {rank} +{time.perf_counter() - t_start:6.2f}s] {msg}", flush=True)

    try:
        device, mesh = _start(args, verdict, layout, say)
        write()
        events.emit("started")
        if args.hang_rank is not None:
            _hang_for_test(rank, world_size, say) if rank == args.hang_rank else dist.barrier()
        if args.mode == "bench":
            _run_bench(args, verdict, events, write)
        else:
            c = _Case(rank, args.steps, args.seed, args.case_timeout, args.metadata, device, args.backend, layout,
                      "none", mesh, events)
            _run_cases(args, verdict, c, wraps, say, write)
        verdict.complete = True
    except BaseException:
        verdict.fatal = traceback.format_exc()
        say("fatal:\n" + verdict.fatal)
        write()
        events.emit("fatal")
        raise
    verdict.seconds = round(time.perf_counter() - t_start, 3)
    write()
    events.emit("done")
    dist.destroy_process_group()
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
