"""Private: one pipeline step on one rank, run under a list of probes; what ``ppbackward check`` and
``ppbackward bench --schedule`` both run (``ppbackward._tools.harness.worker``).

A :class:`Probe` measures something around a step and returns one field of the step's
:class:`~ppbackward._tools.harness.records.StepRecord` (its :attr:`Probe.field`) with the failures it found.
It is set up for a case when it is made (its constructor takes what it needs of the case: stages,
modules, a hook counter), sees every step it is given through the phases below, and is closed with
:meth:`Probe.close` when the case ends. The check's probes are in :mod:`ppbackward._tools.harness.probes`,
the bench's in :mod:`ppbackward._tools.harness.bench_probes`.

Note [probe phases]: :func:`run_step` runs one ``schedule.step`` as follows, and every probe sees it at
these points:

1. the grads of the case's parameters are reset and the step's arguments built (:func:`start_step`);
   the gc is disabled if any probe has :attr:`Probe.gc_off` (lifetime is judged by reference counting
   alone);
2. :meth:`Probe.before`, in list order (a probe that opens a context opens it here, so the first probe's
   context encloses the others');
3. ``schedule.step``, timed (``StepRun.seconds``: this rank's wall time of that call alone), its losses
   kept as floats (``StepRun.losses``, on a rank with the last stage);
4. :meth:`Probe.after_step`, in reverse list order (the innermost first, as contexts close): the stages
   still hold the step's state;
5. every stage's ``clear_runtime_states()``, then :meth:`Probe.after_clear`, in list order;
6. :meth:`Probe.finish`, in list order, returns each probe's record and failures; then the gc is back as
   it was.

The order of the list is therefore part of a measurement: the check lists the garbage probe before the
lifetime probe, so that its leak check (which collects) ends before the lifetime probe's gc run, and the
bench lists the step time probe first, so that its barrier (every rank waits for the slowest) comes before
the step parts probe starts its clock: a step's parts and slices then start where its time does.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Sequence
from typing import Any

import torch

from ppbackward._tools.harness import models as zoo
from ppbackward._tools.harness.records import Failure, StepRecord, Tolerance

__all__ = ["CaseRun", "Probe", "StepRun", "run_step", "start_step"]


@dataclasses.dataclass
class CaseRun:
    """What a step of one case on this rank runs, and what its probes may read.

    Attributes:
        schedule: the schedule over this rank's stages.
        pp_stages: this rank's ``PipelineStage`` objects.
        modules: this rank's stage modules by stage index, unwrapped.
        named: ``("stage{i}.{name}", parameter)`` of this rank's stages, after wrapping (the grads compared).
        spec: the model.
        n_microbatches: microbatches per step.
        tolerance: the numerics rule of the case (Note [one numerics rule] in ``probes``).
        wrap: the data-parallel wrapper (``none``, ``ddp``, ``fsdp``, ``fsdp-titan``).
        dp_group: the data-parallel process group (``None`` without one).
        reference: the reference's stage modules (every stage, single-process).
    """

    schedule: Any
    pp_stages: list[Any]
    modules: dict[int, torch.nn.Module]
    named: list[tuple[str, torch.nn.Parameter]]
    spec: zoo.ModelSpec
    n_microbatches: int
    tolerance: Tolerance
    wrap: str = "none"
    dp_group: Any = None
    reference: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepRun:
    """One step as its probes see it: its number (0-based), the reference result of its batch (``None``
    where nothing is compared), and, once ``schedule.step`` returned, ``start`` (``time.perf_counter()``
    when it was called), ``seconds`` (this rank's wall time of that call) and ``losses`` (``None`` off the
    last stage)."""

    step: int
    reference: zoo.ReferenceResult | None = None
    start: float = 0.0
    seconds: float = 0.0
    losses: list[float] | None = None


class Probe:
    """One measurement around a step (Note [probe phases]); every method but :meth:`finish` does nothing
    unless a probe overrides it.

    Attributes:
        field: the :class:`~ppbackward._tools.harness.records.StepRecord` field its record fills;
            ``None`` for a probe that only reports failures.
        gc_off: whether the step must run with the gc disabled.
    """

    field: str | None = None
    gc_off: bool = False

    def before(self, step: StepRun) -> None:
        """Phase 2: just before ``schedule.step``."""

    def after_step(self, step: StepRun) -> None:
        """Phase 4: ``schedule.step`` returned; the stages still hold the step's state."""

    def after_clear(self, step: StepRun) -> None:
        """Phase 5: every stage's ``clear_runtime_states()`` ran."""

    def finish(self, step: StepRun) -> tuple[Any, list[Failure]]:
        """Phase 6: the probe's record of the step (``None`` where :attr:`field` is ``None``) and failures."""
        return None, []

    def close(self) -> None:
        """The case is over (or stopped on an exception): undo whatever the probe put in place."""


def start_step(case: CaseRun, batch: zoo.Batch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Reset this rank's grads; return ``schedule.step``'s positional and keyword arguments for ``batch`` on
    this rank: its ``args`` where the rank holds the first stage, its ``kwargs``, and its ``target`` where
    the rank holds the last stage."""
    for _, p in case.named:
        p.grad = None
    args = batch.args if any(s.is_first for s in case.pp_stages) else ()
    kwargs: dict[str, Any] = dict(batch.kwargs)
    if any(s.is_last for s in case.pp_stages):
        kwargs["target"] = batch.target
    return args, kwargs


def _step(case: CaseRun, probes: Sequence[Probe], batch_box: list[zoo.Batch], run: StepRun) -> list[Any]:
    """Phases 1 to 6 of Note [probe phases] but the gc's switch; every probe's ``finish`` result, in order."""
    args, kwargs = start_step(case, batch_box.pop())
    for probe in probes:
        probe.before(run)
    losses: list[torch.Tensor] | None = [] if any(s.is_last for s in case.pp_stages) else None
    run.start = time.perf_counter()
    out = case.schedule.step(*args, losses=losses, **kwargs)
    run.seconds = time.perf_counter() - run.start
    del out, args, kwargs
    run.losses = None if losses is None else [float(x.detach()) for x in losses]
    del losses
    for probe in reversed(probes):
        probe.after_step(run)
    for stage in case.pp_stages:
        stage.clear_runtime_states()
    for probe in probes:
        probe.after_clear(run)
    return [probe.finish(run) for probe in probes]


def run_step(
    case: CaseRun,
    probes: Sequence[Probe],
    batch_box: list[zoo.Batch],
    step: int = 0,
    reference: zoo.ReferenceResult | None = None,
) -> tuple[StepRecord, list[Failure]]:
    """Run one ``case.schedule.step`` under ``probes`` (Note [probe phases]); return the step's record
    (each probe's record in its field) and every probe's failures, in the probes' order.

    ``batch_box`` holds the only reference to the step's batch; it is emptied so that the batch is freed
    before the lifetime probe looks (stage 0 saves its inputs, which the caller must not keep alive).
    Raises what the step or a probe raised (the caller closes the probes).
    """
    run = StepRun(step, reference)
    gc_off = any(p.gc_off for p in probes) and gc.isenabled()
    if gc_off:
        gc.disable()
    try:
        results = _step(case, probes, batch_box, run)
    finally:
        if gc_off:
            gc.enable()
    fields: dict[str, Any] = {}
    failures: list[Failure] = []
    for probe, (record, found) in zip(probes, results):
        if probe.field is not None:
            fields[probe.field] = record
        failures += found
    return StepRecord(step, run.seconds, **fields), failures
