"""Private: the torchrun worker. Runs many (schedule × model) cases per launch, one JSON verdict per rank.

Run by :mod:`ppbackward._tools.harness.launch`, or by hand::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m ppbackward._tools.harness.worker --out /tmp/pp --backward ppbackward

Per rank and per step of every case it records (a ``StepRecord`` in ``<out>/rank<r>.json``, see
:mod:`ppbackward._tools.harness.probes` for the notes it cites):

1. **garbage** — tensors and autograd nodes found by ``check_tensor_leaks`` around ``schedule.step``;
2. **lifetime** — with the gc disabled, the saved activations still alive after
   ``clear_runtime_states()`` and after releasing what the stage keeps by design, its receive buffers
   (Note [kept by design]), then after a gc run;
3. **caches** — the stage's per-microbatch caches after the step (Note [kept caches]);
4. **numerics** — each microbatch's loss and every local parameter's grad against a single-process
   reference of the same stack on the same microbatches (sum-reduced loss, ``scale_grads=False``),
   within ``|x - ref| <= ATOL + RTOL * |ref|`` elementwise (float32);
5. **hooks** — ``register_post_accumulate_grad_hook`` calls: once per trainable parameter per microbatch
   (``ModelSpec.accumulations`` times for a parameter the model accumulates into more often: titan's ``lm_head``).

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
from ppbackward._merge import count_compute
from ppbackward._tools.harness import diagnose, gloo_p2p, parallel, probes
from ppbackward._tools.harness import models as zoo
from ppbackward._tools.harness import schedules as sched
from ppbackward._tools.harness.records import (
    CacheCount,
    CaseRecord,
    EventWriter,
    Failure,
    GarbageRecord,
    HooksRecord,
    LifetimeRecord,
    NumericsRecord,
    RankVerdict,
    StepRecord,
    Timeouts,
    Tolerance,
    write_verdict,
)

__all__ = ["ATOL", "RTOL", "main"]

RTOL = 1e-5
ATOL = 1e-6
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
# one step, measured


def _numerics_kind(wrap: str, grad_none: bool) -> str:
    """The kind of a numerics failure (Note [failure kinds] in ``records``): FSDP2's swap loses grads of
    any kind; a grad ``None`` in the pipeline is a missing grad (torchtitan's shape with ``fsdp-titan``);
    anything else is a wrong grad."""
    if wrap == "fsdp":
        return "fsdp-swap"
    if grad_none:
        return "fsdp-loss-reshard" if wrap == "fsdp-titan" else "grads-missing"
    return "grads-wrong"


def _compare(
    grads: list[tuple[str, torch.Tensor | None]],
    ref: zoo.ReferenceResult,
    losses: list[float] | None,
    wrap: str = "none",
    step: int | None = None,
) -> tuple[NumericsRecord, list[Failure]]:
    """Every grad and loss against the reference, within ``ATOL + RTOL * |ref|`` elementwise; the step's
    numerics record and its ``numerics`` failures (``wrap`` decides their kind: :func:`_numerics_kind`)."""
    failures: list[Failure] = []
    counts = {"compared": 0, "none": 0, "unexpected": 0, "losses_wrong": 0}
    max_abs, worst = 0.0, ""

    def fail(message: str, grad_none: bool = False) -> None:
        failures.append(Failure("numerics", _numerics_kind(wrap, grad_none), message, step))

    for name, got in grads:
        want = ref.grads[name]
        if want is None and got is None:
            continue
        counts["compared"] += 1
        if want is None or got is None:
            counts["none" if got is None else "unexpected"] += 1
            fail(f"{name}.grad is {'None' if got is None else 'set'} in the pipeline but "
                 f"{'None' if want is None else 'set'} in the reference", grad_none=got is None)
            continue
        if got.shape != want.shape:
            fail(f"{name}.grad shape {list(got.shape)} != reference {list(want.shape)}")
            continue
        diff = (got.detach().cpu() - want).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        if err > max_abs:
            max_abs, worst = err, name
        bad = int((diff > ATOL + RTOL * want.abs()).sum())
        if bad:
            fail(f"{name}.grad: {bad} of {diff.numel()} elements outside tolerance (max |grad - ref| = {err:.3e})")
    loss_err = 0.0
    miscounted = losses is not None and len(losses) != len(ref.losses)
    if losses is not None and miscounted:
        fail(f"{len(losses)} losses, reference has {len(ref.losses)}")
    for mb, (got_l, want_t) in enumerate(zip(losses or [], ref.losses)):
        want_l = float(want_t)
        err = abs(got_l - want_l)
        loss_err = max(loss_err, err)
        if err > ATOL + RTOL * abs(want_l):
            counts["losses_wrong"] += 1
            fail(f"loss of microbatch {mb} = {got_l!r}, reference {want_l!r}")
    record = NumericsRecord(
        params_compared=counts["compared"], max_abs_grad_err=max_abs, worst_param=worst,
        losses_compared=0 if losses is None else len(losses), max_abs_loss_err=loss_err,
        grads_none=counts["none"], grads_unexpected=counts["unexpected"], losses_wrong=counts["losses_wrong"],
        losses_miscounted=miscounted,
    )
    return record, failures


@dataclasses.dataclass
class StepContext:
    """What :func:`run_step` needs besides the schedule: this rank's stages and parameters, the probes'
    counters and the data-parallel setting of the case."""

    pp_stages: list[Any]
    modules: dict[int, torch.nn.Module]  # this rank's stage modules by index, unwrapped
    named: list[tuple[str, torch.nn.Parameter]]  # ``stage{i}.{name}`` -> parameter, after wrapping
    hooks: probes.HookCounter
    spec: zoo.ModelSpec
    n_microbatches: int
    wrap: str = "none"
    dp_group: Any = None
    reference: list = dataclasses.field(default_factory=list)  # the reference's stage modules


def _start_step(ctx: StepContext, batch: zoo.Batch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Reset this rank's grads and hook counts; return ``schedule.step``'s positional and keyword arguments
    for ``batch`` on this rank: its ``args`` where the rank holds the first stage, its ``kwargs``, and its
    ``target`` where the rank holds the last stage."""
    for _, p in ctx.named:
        p.grad = None
    ctx.hooks.reset()
    args = batch.args if any(s.is_first for s in ctx.pp_stages) else ()
    kwargs: dict[str, Any] = dict(batch.kwargs)
    if any(s.is_last for s in ctx.pp_stages):
        kwargs["target"] = batch.target
    return args, kwargs


@dataclasses.dataclass
class _Measured:
    """What :func:`_measure_step` saw of one step, before the grads are compared."""

    seconds: float
    garbage: GarbageRecord
    lifetime: LifetimeRecord
    caches: dict[str, dict[str, CacheCount]]
    losses: list[float] | None
    failures: list[Failure]


def _cache_failures(
    ctx: StepContext, schedule: Any, step: int
) -> tuple[dict[str, dict[str, CacheCount]], list[Failure]]:
    """The schedule's and every stage's caches after the step (Note [kept caches]), and their failures."""
    found, bad = probes.schedule_caches(schedule)
    caches, messages = {"schedule": found}, list(bad)
    for stage in ctx.pp_stages:
        found, bad = probes.stage_caches(stage, ctx.n_microbatches)
        caches[f"stage {stage.stage_index}"] = found
        messages += bad
    return caches, [Failure("caches", "stage-caches", m, step) for m in messages]


def _measure_step(schedule: Any, ctx: StepContext, batch_box: list[zoo.Batch], step: int) -> _Measured:
    """Run ``schedule.step`` with the gc disabled under the garbage and lifetime probes; release what the
    stage keeps by design (Note [kept by design]); return what was measured, with the caches' failures."""
    step_args, step_kwargs = _start_step(ctx, batch_box.pop())
    activations = probes.ActivationProbe()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # lifetime is judged by reference counting alone (gc runs only where stated)
    try:
        with probes.garbage_probe() as garbage:
            losses: list[torch.Tensor] | None = [] if any(s.is_last for s in ctx.pp_stages) else None
            with activations.record():
                t0 = time.perf_counter()
                out = schedule.step(*step_args, losses=losses, **step_kwargs)
                seconds = time.perf_counter() - t0
            del out, step_args, step_kwargs
            caches, failures = _cache_failures(ctx, schedule, step)
            loss_values = None if losses is None else [float(x.detach()) for x in losses]
            del losses
            for stage in ctx.pp_stages:
                stage.clear_runtime_states()
            activations.after_clear()
            activations.release_recv_buffers(ctx.pp_stages)
        activations.after_gc()  # check_tensor_leaks has collected; this collects once more
    finally:
        if gc_was_enabled:
            gc.enable()
    return _Measured(seconds, garbage.to_record(), activations.to_record(), caches, loss_values, failures)


def _lifetime_failures(garbage: GarbageRecord, lifetime: LifetimeRecord, step: int) -> list[Failure]:
    """The garbage and lifetime probes' failures of one step."""
    failures = []
    if not garbage.ok:
        failures.append(Failure("garbage", "reference-cycle",
            f"{garbage.tensors} tensors and {garbage.nodes} autograd nodes in reference cycles after the step "
            f"({garbage.tensor_bytes} B pinned)", step))
    lt = lifetime
    example = f"; e.g. {lt.examples[0]}" if lt.examples else ""
    if lt.freed_only_by_gc:
        failures.append(Failure("lifetime", "reference-cycle",
            f"{lt.freed_only_by_gc} saved activations ({lt.bytes_freed_only_by_gc} B) outlived the step and were "
            f"freed only by a gc run (a reference cycle held them){example}", step))
    if lt.held_after_gc:
        failures.append(Failure("lifetime", "held-activations",
            f"{lt.held_after_gc} saved activations ({lt.bytes_held_after_gc} B) still alive after "
            "clear_runtime_states(), releasing the receive buffers and a gc run (a live reference holds them)"
            f"{example}", step))
    if lt.nodes_held_after_gc or lt.packed_held_after_gc:
        failures.append(Failure("lifetime", "held-activations",
            f"{lt.nodes_held_after_gc} autograd nodes and {lt.packed_held_after_gc} packed saved tensors "
            f"({lt.bytes_packed_held_after_gc} B) of the step still alive after it, the stage's state cleared "
            "and a gc run (a live reference, or a cycle inside C++ the gc cannot see); "
            f"e.g. {', '.join(lt.node_examples)}", step))
    return failures


def _side_effect_kind(spec: zoo.ModelSpec) -> str:
    """The kind of ``spec``'s side-effect failures: a checkpointed region recomputed again, or a custom
    Function's backward run twice (the model zoo's two side-effect checks)."""
    return "recompute-more" if spec.side_effects is zoo._side_effects_recompute else "side-effects-twice"


def _hooks(ctx: StepContext, step: int) -> tuple[HooksRecord, list[Failure]]:
    """The hook probe: calls against once per trainable parameter per microbatch (``accumulations``)."""
    calls = ctx.hooks.calls
    want = {n: ctx.n_microbatches * ctx.spec.accumulations(n) for n in calls}
    wrong = {n: c for n, c in calls.items() if c != want[n]}
    record = HooksRecord(fired=sum(calls.values()), expected=sum(want.values()), params_wrong=len(wrong))
    if not wrong:
        return record, []
    name, got = next(iter(wrong.items()))
    message = (f"post-accumulate-grad hooks fired {record.fired} times, expected {record.expected} "
               f"({len(wrong)} parameters off, e.g. {name}: {got} != {want[name]})")
    return record, [Failure("hooks", "hooks-skipped", message, step)]


def run_step(
    schedule: Any, ctx: StepContext, batch_box: list[zoo.Batch], ref: zoo.ReferenceResult, step: int = 0
) -> tuple[StepRecord, list[Failure]]:
    """Run one ``schedule.step`` under every probe; return the step's record and failures (module docstring).

    ``batch_box`` holds the only reference to the step's batch; it is emptied so that the batch is freed
    before the lifetime check (stage 0 saves its inputs, which the caller must not keep alive).
    """
    seen = _measure_step(schedule, ctx, batch_box, step)
    failures = seen.failures + _lifetime_failures(seen.garbage, seen.lifetime, step)
    grads = parallel.full_grads(ctx.named)  # collective over the dp group with FSDP2
    numerics, bad = _compare(grads, ref, seen.losses, ctx.wrap, step)
    failures += bad
    if ctx.wrap == "ddp":
        diff, messages = parallel.replica_failures(ctx.named, ctx.dp_group)
        numerics = dataclasses.replace(numerics, max_replica_diff=diff, replicas_diverged=bool(messages))
        failures += [Failure("replicas", "ddp-replicas", m, step) for m in messages]
    side = ctx.spec.side_effects(ctx.modules, ctx.reference, ctx.n_microbatches, ref.shards)
    kind = _side_effect_kind(ctx.spec)
    failures += [Failure("side effects", kind, m.removeprefix("side effects: "), step) for m in side]
    hooks, bad = _hooks(ctx, step)
    failures += bad
    record = StepRecord(step, seen.seconds, seen.garbage, seen.lifetime, seen.caches, numerics, hooks)
    return record, failures


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


def _run_unmeasured(schedule: Any, ctx: StepContext, batch: zoo.Batch) -> None:
    """One ``schedule.step`` started as the measured steps start (:func:`_start_step`), under the activation
    tracker as they run (a compiled region compiles for the tracker's torch-function mode too), then the
    stage state and side-effect counters reset."""
    args, kwargs = _start_step(ctx, batch)
    with probes.ActivationProbe().record():
        schedule.step(*args, **kwargs)
    del args, kwargs
    for stage in ctx.pp_stages:
        stage.clear_runtime_states()
    ctx.spec.side_effects(ctx.modules, ctx.reference, ctx.n_microbatches, 1)  # a reset: the failures are dropped


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
) -> tuple[Any, StepContext]:
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
    hooks = probes.HookCounter([] if c.wrap.startswith("fsdp") else named)
    ctx = StepContext(pp_stages, local, named, hooks, spec, case.n_microbatches, c.wrap, groups.dp, reference)
    return schedule, ctx


def _run_steps(schedule: Any, ctx: StepContext, c: _Case, record: CaseRecord) -> None:
    """The unmeasured warm-up steps, then ``c.steps`` measured ones into ``record`` (Note [gc freeze])."""
    spec, n_mb, (dp_rank, _) = ctx.spec, ctx.n_microbatches, c.layout.coords(c.rank)
    for _ in range(spec.warmup_steps):  # unmeasured (see ModelSpec.warmup_steps)
        warm = zoo.make_batch(spec, n_mb, seed=parallel.batch_seed(c.seed, 99, dp_rank))
        _run_unmeasured(schedule, ctx, _to_device(warm, c.device))
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
        step_record, failures = run_step(schedule, ctx, batch_box, ref, step)
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
    if case.skip:
        record.status, record.reason = "skip", case.skip
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
    if case.skip or case.error:
        return record
    groups = parallel.make_groups(c.layout, c.backend, c.case_timeout, c.mesh)
    ctx = None
    try:
        schedule, ctx = _build(case, spec, c, record, groups)
        _run_steps(schedule, ctx, c, record)
    except Exception as e:
        failure, record.error = _exception_failure(e)
        record.status, record.failures = "error", [failure]
    finally:
        gc.unfreeze()
        if ctx is not None:
            ctx.hooks.remove()
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


def _new_verdict(args: argparse.Namespace, rank: int, world_size: int) -> RankVerdict:
    return RankVerdict(
        rank=rank, world_size=world_size, backward=args.backward, torch=torch.__version__,
        tolerance=Tolerance(RTOL, ATOL), kept_by_design=dict(probes.KEPT_BY_DESIGN), dp=args.dp,
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
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
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
