"""Private: the check's probes, what ``ppbackward check`` measures around one schedule step on one rank.

Each is a :class:`~ppbackward._tools.harness.runner.Probe` (Note [probe phases] there) whose record fills
one field of the step's ``StepRecord``; :func:`check_probes` lists them in the order they must run:

* :class:`GarbageProbe` — tensors and autograd nodes left in reference cycles by the step
  (:func:`ppbackward.leaks.check_tensor_leaks`, through :func:`garbage_probe`: anything found fails the step);
* :class:`LifetimeProbe` — every activation autograd saves during the step, stage inputs included
  (:class:`ActivationProbe`: :func:`ppbackward.leaks.track_activations` with ``include_leaves=True``;
  parameters are not activations and are not recorded), and which are still alive once the stage's
  runtime state is cleared: with the gc disabled, after releasing what the stage keeps by design, and
  after a gc run;
* :class:`CachesProbe` — the stage's and the schedule's per-microbatch caches after the step
  (:func:`stage_caches`, :func:`schedule_caches`);
* :class:`NumericsProbe` — each microbatch's loss and every local parameter's grad against the
  single-process reference (:func:`compare`, Note [one numerics rule]), and with DDP the replicas;
* :class:`SideEffectsProbe` — the model's own side-effect counts (a checkpointed region recomputed once,
  a custom Function's backward run once);
* :class:`HooksProbe` — ``register_post_accumulate_grad_hook`` calls per parameter (:class:`HookCounter`);
* :class:`RegionsProbe` — for a model with torch.compile'd regions (``ModelSpec.regions_per_b``), the
  regions each B call split into B and W, counted from the param groups it returns (Note [regions
  counted]).

Note [regions counted]: ppbackward's B returns, in each param group, the compiled regions it split
(``group.regions``: W runs their weight halves; Note [compiled regions split in two] in
``ppbackward._compiled``). The regions probe puts a counting wrapper around the ``stage_backward_input``
torch's stage calls (``torch.distributed.pipelining.stage``'s, whichever backward is installed) for the
step, adds up ``len(group.regions)`` per call and lets the groups go. Every B call of ppbackward must split
each of the stage's regions (``ModelSpec.regions_per_b``, exactly); a call that split fewer ran some region
whole in B, exact but with nothing of it left for W (kind ``regions-whole``). torch's own B returns plain
dicts, which say nothing of regions: counted as not counted. On a torch without the split
(``ppbackward._compiled.support().ok``) nothing is judged.

Note [one numerics rule]: every comparison with a reference, the check's and the bench's, is
:func:`compare`: each grad and each microbatch loss within ``|x - ref| <= atol + rtol * |ref|`` elementwise
(``Tolerance.outside``) of a single-process reference of the same stages on the same microbatches
(``ppbackward._tools.harness.models.reference_step``: grads accumulated over microbatches, nothing
scaled). The tolerance is part of the case (``CaseRun.tolerance``): the check's zoo models use
:data:`CHECK_TOLERANCE`; the bench's deeper encoder stacks carry their own
(``ppbackward._tools.harness.schedule_bench``).

Note [kept by design]: after ``clear_runtime_states()`` torch's ``PipelineStage`` still holds, by design
and for reuse by the next step, ``recv_buffer``: ``stage.args_recv_info[mb][i].buffer``, the input
receive buffer of every microbatch of every non-first stage. The stage's first op usually saves its
input for backward, so an activation saved there lives in a receive buffer. In V schedules the buffer
of the stage that follows a stage on the same rank is the local hand-off set by
``set_local_fwd_input``: a detached alias of the previous stage's output, which therefore stays alive
as well. The lifetime probe proves these are the *only* holders: it replaces every receive buffer by a
fresh empty one (what the next step receives into instead) and requires every saved activation to be
freed then, by reference counting, with the gc still disabled (torch 2.15's stage keeps no receive
buffer: it allocates one per receive and hands it over with ``take_buffer``, so nothing is released
there: :func:`recv_buffers_kept_by_stage`). What the release freed is reported as
``kept_by_design.recv_buffer``; anything still alive is a finding, ``freed_only_by_gc`` when a gc run
frees it (a reference cycle held it) or ``held_after_gc`` when it survives one (a live reference holds
it).

Note [kept caches]: torch 2.13's stage also keeps, holding no tensor (2.15's likewise; its
``_forward_chunk_states`` replaces ``fwd_cache`` and is empty after a step, as ``fwd_cache`` is):

* ``bwd_cache`` on stage 0 — input grads of stage 0 are never sent, so never popped (tuples of ``None``
  or empty tuples when stage 0's inputs need no grad);
* ``dw_runner`` — a no-op placeholder per microbatch that ran B separately (popped only with a custom
  ``dw_builder``);
* ``output_chunks`` on the last stage — one output per microbatch: the step's return value, until the
  next step (or ``clear_runtime_states()``). torch 2.5's ``forward_one_chunk`` appends on *every* stage
  (the guard ``if self.is_last`` came later), so there each stage keeps its outputs until the next step;
  :func:`outputs_kept_on_every_stage` reads which rule the installed ``stage.py`` follows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import shutil
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ppbackward._tools.harness import models as zoo
from ppbackward._tools.harness import parallel
from ppbackward._tools.harness.records import (
    CacheCount,
    Failure,
    GarbageRecord,
    HooksRecord,
    KeptByDesign,
    LifetimeRecord,
    NumericsRecord,
    RegionsRecord,
    Tolerance,
)
from ppbackward._tools.harness.runner import CaseRun, Probe, StepRun
from ppbackward.leaks import check_tensor_leaks, track_activations

__all__ = [
    "CHECK_TOLERANCE",
    "KEPT_BY_DESIGN",
    "ActivationProbe",
    "CachesProbe",
    "GarbageProbe",
    "HookCounter",
    "HooksProbe",
    "LifetimeProbe",
    "NumericsProbe",
    "RegionsProbe",
    "SideEffectsProbe",
    "check_probes",
    "compare",
    "garbage_probe",
    "outputs_kept_on_every_stage",
    "recv_buffers_kept_by_stage",
    "schedule_caches",
    "stage_caches",
]


#: The check's numerics rule (Note [one numerics rule]): float32 grads and losses of the zoo's models.
CHECK_TOLERANCE = Tolerance(rtol=1e-5, atol=1e-6)

#: What torch's stage keeps after a step, by name (Note [kept by design], Note [kept caches]).
KEPT_BY_DESIGN = {
    "recv_buffer": "PipelineStage.args_recv_info[mb][i].buffer: input receive buffer of every microbatch of a "
    "non-first stage (V schedules: the local hand-off from set_local_fwd_input); reused by the next step",
    "bwd_cache": "stage 0 only: input grads never sent, never popped; hold no tensor",
    "dw_runner": "one no-op placeholder per microbatch run with B/W split; hold no tensor",
    "output_chunks": "last stage only (every stage on torch 2.5): one output per microbatch, the step's return "
    "value, until the next step",
}


# ----------------------------------------------------------------------------------------------------
# garbage


@contextlib.contextmanager
def garbage_probe(max_chains: int = 2) -> Iterator[list[GarbageRecord]]:
    """``check_tensor_leaks`` around the block; on exit the yielded list gets the step's
    :class:`~ppbackward._tools.harness.records.GarbageRecord`.

    Strict semantics, but the leak is returned, not raised: the worker turns a non-zero count into a
    failure and keeps running the remaining cases. The chains are kept as text; the graph files the
    checker wrote for them (into a fresh temporary folder) are deleted, as nothing reads them.
    """
    found: list[GarbageRecord] = []
    with check_tensor_leaks(strict=False, max_chains=max_chains) as report:
        yield found
    found.append(
        GarbageRecord(
            int(report.num_tensors),
            int(report.num_nodes),
            int(report.tensor_bytes),
            int(report.num_garbage),
            dict(report.garbage_types),  # other garbage (torch's own cycles) is only counted
            [str(c) for c in report.chains][:max_chains],
        )
    )
    if report.output_dir is not None:
        shutil.rmtree(report.output_dir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# activation lifetime


class ActivationProbe:
    """Activation lifetime of one step, with ``track_activations`` (parameters excluded).

    Use: :meth:`record` around the step; after ``clear_runtime_states()``, :meth:`after_clear` (gc
    disabled); :meth:`release_recv_buffers` to drop what the stage keeps by design and measure what
    that freed; and, after a gc run, :meth:`after_gc`. See Note [kept by design].
    """

    def __init__(self) -> None:
        # include_leaves: stage inputs (received activations, stage 0's microbatch) are recorded too
        self._tracker = track_activations(include_leaves=True)
        self.alive_after_clear: Any = None
        self.alive_after_release: Any = None
        self.final: Any = None

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        with self._tracker:
            yield

    def after_clear(self) -> None:
        self.alive_after_clear = self._tracker.report(collect=False)

    def release_recv_buffers(self, stages: Iterable[Any]) -> int:
        """Replace every receive buffer by a fresh empty one of the same layout; return how many.

        The old buffers are dropped here, so whatever they alone kept alive is freed by reference
        counting; the next step receives into the fresh buffers exactly as it would into the old ones.
        """
        released = 0
        for stage in stages:
            for infos in stage.args_recv_info.values():
                for info in infos:
                    buf = getattr(info, "buffer", None)
                    # a root-level input: torch 2.13's _RecvInfo(is_root_arg=True), 2.5's _RootArgPlaceholder
                    # (no buffer); 2.5's _RecvInfo has no is_root_arg and is always a receive buffer
                    if getattr(info, "is_root_arg", False) or not isinstance(buf, torch.Tensor):
                        continue
                    info.buffer = torch.empty_strided(buf.size(), buf.stride(), dtype=buf.dtype, device=buf.device)
                    released += 1
                    del buf
        self.alive_after_release = self._tracker.report(collect=False)
        return released

    def after_gc(self) -> None:
        self.final = self._tracker.report(collect=True)

    def to_record(self) -> LifetimeRecord:
        """The step's lifetime record (``rank<r>.json``), once :meth:`after_gc` ran."""
        final = self.final
        clear, release = self.alive_after_clear, self.alive_after_release
        return LifetimeRecord(
            saved=len(final.saved),
            bytes_saved=sum(a.nbytes for a in final.saved),
            alive_after_clear=len(clear.alive),
            kept_by_design=KeptByDesign(len(clear.alive) - len(release.alive), clear.bytes_alive - release.bytes_alive),
            alive_without_gc=len(release.alive),
            freed_only_by_gc=len(final.freed_only_by_gc),
            bytes_freed_only_by_gc=final.bytes_freed_only_by_gc,
            held_after_gc=len(final.held_after_gc),
            bytes_held_after_gc=final.bytes_held_after_gc,
            # Note [leaks the gc cannot see] (ppbackward.leaks): nodes and packed tensors of the step
            nodes=final.nodes,
            nodes_held_after_gc=len(final.nodes_held_after_gc),
            node_examples=list(final.nodes_held_after_gc[:5]),
            packed_held_after_gc=len(final.packed_held_after_gc),
            bytes_packed_held_after_gc=final.bytes_packed_held_after_gc,
            examples=[a.describe() for a in (final.held_after_gc + final.freed_only_by_gc)[:5]],
        )


# ----------------------------------------------------------------------------------------------------
# stage caches


def count_tensors(obj: Any, depth: int = 6) -> int:
    """Tensors reachable from ``obj`` through containers and function closures (bounded depth)."""
    if depth < 0:
        return 0
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(v, depth - 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(count_tensors(v, depth - 1) for v in obj)
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or ()
        total = 0
        for cell in cells:
            try:
                total += count_tensors(cell.cell_contents, depth - 1)
            except ValueError:  # empty cell
                pass
        return total
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(count_tensors(getattr(obj, f.name), depth - 1) for f in dataclasses.fields(obj))
    return 0


@functools.cache
def outputs_kept_on_every_stage() -> bool:
    """Whether the installed ``forward_one_chunk`` appends to ``output_chunks`` on every stage (torch 2.5).

    Read from its source: an append not guarded by ``if self.is_last`` (Note [kept caches]). Without source
    (a bytecode-only install) the later rule, last stage only, is assumed. Read once per process: the
    cache probes call it per stage per step.
    """
    from torch.distributed.pipelining.stage import _PipelineStageBase

    try:
        source = inspect.getsource(_PipelineStageBase.forward_one_chunk)
    except (OSError, TypeError):
        return False
    guarded = re.search(r"if self\.is_last\b[^\n]*:\s*\n\s*self\.output_chunks\.append", source)
    return "output_chunks.append" in source and guarded is None


@functools.cache
def recv_buffers_kept_by_stage() -> bool:
    """Whether the installed ``PipelineStage`` keeps its receive buffers after a step (Note [kept by
    design]): up to torch 2.14 it does; 2.15's ``_RecvInfo`` hands its buffer over (``take_buffer``)."""
    from torch.distributed.pipelining import stage as stage_module

    info = getattr(stage_module, "_RecvInfo", None)
    return not hasattr(info, "take_buffer")


# fwd_cache (torch 2.5-2.14) and _forward_chunk_states (2.15+): the forward state of each microbatch.
_FORWARD_CACHES = ("fwd_cache", "_forward_chunk_states")
_CACHES = (*_FORWARD_CACHES, "bwd_cache", "backward_state", "dw_runner", "output_chunks")


def stage_caches(stage: Any, n_microbatches: int) -> tuple[dict[str, CacheCount], list[str]]:
    """Entries and tensors in the stage's per-microbatch caches after a step, and the failures.

    Expected (Note [kept caches]): ``fwd_cache`` (``_forward_chunk_states``) and ``backward_state``
    empty; ``bwd_cache`` empty but on stage 0, where its entries hold no tensor; ``dw_runner`` only
    tensor-free placeholders; ``output_chunks`` ``n_microbatches`` entries on the last stage, none
    elsewhere.
    """
    found: dict[str, CacheCount] = {}
    failures: list[str] = []
    where = f"stage {stage.stage_index}"
    for name in _CACHES:
        cache = getattr(stage, name, None)
        if cache is None:
            continue
        found[name] = CacheCount(len(cache), count_tensors(cache))
    for name in (*_FORWARD_CACHES, "backward_state"):
        if name in found and found[name].entries:
            failures.append(f"{where}: {name} holds {found[name].entries} entries after the step")
    bwd = found.get("bwd_cache")
    if bwd is not None and bwd.entries:
        if not stage.is_first:
            failures.append(f"{where}: bwd_cache holds {bwd.entries} entries after the step")
        elif bwd.tensors:
            failures.append(f"{where}: stage-0 bwd_cache holds {bwd.tensors} tensors")
    dw = found.get("dw_runner")
    if dw is not None and dw.entries:
        if dw.tensors:
            failures.append(f"{where}: dw_runner placeholders hold {dw.tensors} tensors")
        if any(getattr(fn, "__closure__", None) for fn in stage.dw_runner.values()):
            failures.append(f"{where}: dw_runner holds closures (not the no-op placeholders)")
    out = found.get("output_chunks")
    if out is not None:
        expected = n_microbatches if stage.is_last or outputs_kept_on_every_stage() else 0
        if out.entries != expected:
            failures.append(f"{where}: output_chunks holds {out.entries} entries, expected {expected}")
    return found, failures


_SCHEDULE_CACHES = ("_internal_losses", "fwd_recv_ops", "bwd_recv_ops")


def schedule_caches(schedule: Any) -> tuple[dict[str, CacheCount], list[str]]:
    """The schedule's own per-step state after a step: losses and pending receive ops, all empty."""
    found: dict[str, CacheCount] = {}
    failures: list[str] = []
    for name in _SCHEDULE_CACHES:
        cache = getattr(schedule, name, None)
        if cache is None:
            continue
        found[name] = CacheCount(len(cache), count_tensors(cache))
        if len(cache):
            failures.append(f"schedule: {name} holds {len(cache)} entries after the step")
    return found, failures


# ----------------------------------------------------------------------------------------------------
# hooks


class HookCounter:
    """Counts ``register_post_accumulate_grad_hook`` calls per trainable parameter.

    The hook is a bound method of this counter, which references no parameter, so parameter -> hook ->
    counter forms no cycle. :meth:`remove` takes every hook off.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        self.calls: dict[str, int] = {}
        self._handles: list[Any] = []
        self._names: dict[int, str] = {}
        for name, p in named_params:
            if not p.requires_grad:
                continue
            self.calls[name] = 0
            self._names[id(p)] = name
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p: torch.Tensor) -> None:
        self.calls[self._names[id(p)]] += 1

    def reset(self) -> None:
        for name in self.calls:
            self.calls[name] = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ----------------------------------------------------------------------------------------------------
# numerics


def _numerics_kind(wrap: str, grad_none: bool) -> str:
    """The kind of a numerics failure (Note [failure kinds] in ``records``): FSDP2's swap loses grads of
    any kind; a grad ``None`` in the pipeline is a missing grad (torchtitan's shape with ``fsdp-titan``);
    anything else is a wrong grad."""
    if wrap == "fsdp":
        return "fsdp-swap"
    if grad_none:
        return "fsdp-loss-reshard" if wrap == "fsdp-titan" else "grads-missing"
    return "grads-wrong"


def _loss_failures(
    losses: list[float] | None, ref: zoo.ReferenceResult, tolerance: Tolerance
) -> tuple[float, int, bool, list[str]]:
    """The losses against the reference's: max |loss - ref|, how many are outside ``tolerance``, whether
    they are miscounted, and the failure messages."""
    messages = []
    miscounted = losses is not None and len(losses) != len(ref.losses)
    if losses is not None and miscounted:
        messages.append(f"{len(losses)} losses, reference has {len(ref.losses)}")
    loss_err, wrong = 0.0, 0
    for mb, (got, want_t) in enumerate(zip(losses or [], ref.losses)):
        want = float(want_t)
        loss_err = max(loss_err, abs(got - want))
        if tolerance.outside(got, want):
            wrong += 1
            messages.append(f"loss of microbatch {mb} = {got!r}, reference {want!r}")
    return loss_err, wrong, miscounted, messages


def compare(
    grads: Sequence[tuple[str, torch.Tensor | None]],
    ref: zoo.ReferenceResult,
    losses: list[float] | None,
    wrap: str = "none",
    step: int | None = None,
    tolerance: Tolerance = CHECK_TOLERANCE,
) -> tuple[NumericsRecord, list[Failure]]:
    """Every grad (``(name, grad)``, names as ``ref.grads``'s) and loss against the reference, within
    ``tolerance`` elementwise (Note [one numerics rule]); the step's numerics record and its ``numerics``
    failures (``wrap`` decides their kind: :func:`_numerics_kind`).

    Raises:
        KeyError: a grad's name the reference does not have.
    """
    failures: list[Failure] = []
    counts = {"compared": 0, "none": 0, "unexpected": 0, "outside": 0, "misshaped": 0}
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
            counts["misshaped"] += 1
            fail(f"{name}.grad shape {list(got.shape)} != reference {list(want.shape)}")
            continue
        got = got.detach().cpu()
        diff = (got - want).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        if err > max_abs:
            max_abs, worst = err, name
        bad = int(tolerance.outside(got, want).sum())
        if bad:
            counts["outside"] += 1
            fail(f"{name}.grad: {bad} of {diff.numel()} elements outside tolerance (max |grad - ref| = {err:.3e})")
    loss_err, losses_wrong, miscounted, messages = _loss_failures(losses, ref, tolerance)
    for message in messages:
        fail(message)
    record = NumericsRecord(
        params_compared=counts["compared"], max_abs_grad_err=max_abs, worst_param=worst,
        losses_compared=0 if losses is None else len(losses), max_abs_loss_err=loss_err,
        grads_none=counts["none"], grads_unexpected=counts["unexpected"], grads_outside=counts["outside"],
        grads_misshaped=counts["misshaped"], losses_wrong=losses_wrong, losses_miscounted=miscounted,
    )
    return record, failures


# ----------------------------------------------------------------------------------------------------
# the check's probes (Note [probe phases] in ppbackward._tools.harness.runner)


class GarbageProbe(Probe):
    """Reference cycles left by the step: :func:`garbage_probe` from before the step to its finish."""

    field = "garbage"
    gc_off = True

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._found: list[GarbageRecord] = []

    def before(self, step: StepRun) -> None:
        self._found = self._stack.enter_context(garbage_probe())

    def finish(self, step: StepRun) -> tuple[GarbageRecord, list[Failure]]:
        self._stack.close()  # check_tensor_leaks collects and counts here
        garbage = self._found[0]
        if garbage.ok:
            return garbage, []
        return garbage, [Failure("garbage", "reference-cycle",
            f"{garbage.tensors} tensors and {garbage.nodes} autograd nodes in reference cycles after the step "
            f"({garbage.tensor_bytes} B pinned)", step.step)]

    def close(self) -> None:
        self._stack.close()


def _lifetime_failures(lt: LifetimeRecord, step: int) -> list[Failure]:
    """The lifetime probe's failures of one step."""
    failures = []
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


class LifetimeProbe(Probe):
    """The saved activations' lifetime (:class:`ActivationProbe`, Note [kept by design]): recorded during
    the step, looked at after ``clear_runtime_states()``, after releasing the receive buffers of ``stages``,
    and after a gc run (at its finish, once the garbage probe has ended)."""

    field = "lifetime"
    gc_off = True

    def __init__(self, stages: Sequence[Any]) -> None:
        self.stages = stages
        self._stack = contextlib.ExitStack()
        self._activations = ActivationProbe()

    def before(self, step: StepRun) -> None:
        self._activations = ActivationProbe()
        self._stack.enter_context(self._activations.record())

    def after_step(self, step: StepRun) -> None:
        self._stack.close()

    def after_clear(self, step: StepRun) -> None:
        self._activations.after_clear()
        self._activations.release_recv_buffers(self.stages)

    def finish(self, step: StepRun) -> tuple[LifetimeRecord, list[Failure]]:
        self._activations.after_gc()
        lifetime = self._activations.to_record()
        return lifetime, _lifetime_failures(lifetime, step.step)

    def close(self) -> None:
        self._stack.close()


class CachesProbe(Probe):
    """The schedule's and every stage's caches once the step returned (Note [kept caches])."""

    field = "caches"

    def __init__(self, schedule: Any, stages: Sequence[Any], n_microbatches: int) -> None:
        self.schedule, self.stages, self.n_microbatches = schedule, stages, n_microbatches
        self._found: tuple[dict[str, dict[str, CacheCount]], list[Failure]] = ({}, [])

    def after_step(self, step: StepRun) -> None:
        found, bad = schedule_caches(self.schedule)
        caches, messages = {"schedule": found}, list(bad)
        for stage in self.stages:
            found, bad = stage_caches(stage, self.n_microbatches)
            caches[f"stage {stage.stage_index}"] = found
            messages += bad
        self._found = caches, [Failure("caches", "stage-caches", m, step.step) for m in messages]

    def finish(self, step: StepRun) -> tuple[dict[str, dict[str, CacheCount]], list[Failure]]:
        return self._found


class NumericsProbe(Probe):
    """Grads and losses against the step's reference (:func:`compare`, the case's tolerance); with DDP,
    the replicas' grads against each other."""

    field = "numerics"

    def __init__(self, case: CaseRun) -> None:
        self.case = case

    def finish(self, step: StepRun) -> tuple[NumericsRecord, list[Failure]]:
        case = self.case
        if step.reference is None:
            raise ValueError(f"step {step.step}: the numerics probe needs the step's reference result")
        grads = parallel.full_grads(case.named)  # collective over the dp group with FSDP2
        numerics, failures = compare(grads, step.reference, step.losses, case.wrap, step.step, case.tolerance)
        if case.wrap == "ddp":
            diff, messages = parallel.replica_failures(case.named, case.dp_group)
            numerics = dataclasses.replace(numerics, max_replica_diff=diff, replicas_diverged=bool(messages))
            failures += [Failure("replicas", "ddp-replicas", m, step.step) for m in messages]
        return numerics, failures


class SideEffectsProbe(Probe):
    """The model's side-effect counts after the step (``ModelSpec.side_effects``; it resets them): a
    checkpointed region recomputed again, or a custom Function's backward run twice. Failures only."""

    def __init__(self, case: CaseRun) -> None:
        self.case = case
        recompute = case.spec.side_effects is zoo._side_effects_recompute
        self.kind = "recompute-more" if recompute else "side-effects-twice"

    def finish(self, step: StepRun) -> tuple[None, list[Failure]]:
        case = self.case
        shards = 1 if step.reference is None else step.reference.shards
        found = case.spec.side_effects(case.modules, case.reference, case.n_microbatches, shards)
        return None, [Failure("side effects", self.kind, m.removeprefix("side effects: "), step.step) for m in found]


class HooksProbe(Probe):
    """Post-accumulate-grad hook calls: once per trainable parameter per microbatch
    (``ModelSpec.accumulations`` times for one the model accumulates into more often). FSDP2's autograd
    runs on unsharded copies of its parameters, so with an ``fsdp`` wrap no hook is registered."""

    field = "hooks"

    def __init__(self, case: CaseRun) -> None:
        self.case = case
        self.counter = HookCounter([] if case.wrap.startswith("fsdp") else case.named)

    def before(self, step: StepRun) -> None:
        self.counter.reset()

    def finish(self, step: StepRun) -> tuple[HooksRecord, list[Failure]]:
        calls = self.counter.calls
        want = {n: self.case.n_microbatches * self.case.spec.accumulations(n) for n in calls}
        wrong = {n: c for n, c in calls.items() if c != want[n]}
        record = HooksRecord(fired=sum(calls.values()), expected=sum(want.values()), params_wrong=len(wrong))
        if not wrong:
            return record, []
        name, got = next(iter(wrong.items()))
        message = (f"post-accumulate-grad hooks fired {record.fired} times, expected {record.expected} "
                   f"({len(wrong)} parameters off, e.g. {name}: {got} != {want[name]})")
        return record, [Failure("hooks", "hooks-skipped", message, step.step)]

    def close(self) -> None:
        self.counter.remove()


_STAGE_MODULE = "torch.distributed.pipelining.stage"


class RegionsProbe(Probe):
    """The compiled regions each B call of the step split (Note [regions counted]), against ``expected``
    per call (0: counted, not judged)."""

    field = "regions"

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self._per_call: list[int | None] = []  # regions split per B call; None where the groups do not say
        self._module: Any = None
        self._real: Any = None

    def before(self, step: StepRun) -> None:
        import importlib

        self._per_call = []
        self._module = importlib.import_module(_STAGE_MODULE)
        self._real = real = self._module.stage_backward_input
        counts = self._per_call

        @functools.wraps(real)
        def counting(*args: Any, **kwargs: Any) -> Any:
            grads, groups = real(*args, **kwargs)
            regions: list[Any] = [getattr(g, "regions", None) for g in groups]
            said = all(r is not None for r in regions)
            counts.append(sum(len(r) for r in regions) if said else None)
            del regions
            return grads, groups

        self._module.stage_backward_input = counting

    def after_step(self, step: StepRun) -> None:
        self.close()

    def finish(self, step: StepRun) -> tuple[RegionsRecord, list[Failure]]:
        known = [n for n in self._per_call if n is not None]
        counted = len(known) == len(self._per_call)
        record = RegionsRecord(
            b_calls=len(self._per_call), b_split=sum(n > 0 for n in known), regions=sum(known),
            fewest=min(known, default=0), most=max(known, default=0), expected=self.expected, counted=counted,
        )
        off = [n for n in known if n != self.expected]
        if not (self.expected and counted and off):
            return record, []
        message = (f"{len(off)} of {record.b_calls} B calls split {min(off)}"
                   f"{'' if min(off) == max(off) else f'-{max(off)}'} compiled regions, {self.expected} expected "
                   "(the others ran whole in B, not split into B and W)")
        return record, [Failure("regions", "regions-whole", message, step.step)]

    def close(self) -> None:
        if self._module is not None:
            self._module.stage_backward_input = self._real
            self._module = self._real = None


def regions_expected(case: CaseRun) -> int:
    """The regions every B call of ``case`` must split: ``ModelSpec.regions_per_b`` where ppbackward's B runs
    (installed) on a torch with the split, else 0 (counted, not judged)."""
    import ppbackward
    from ppbackward import _compiled

    return case.spec.regions_per_b if ppbackward.is_installed() and _compiled.support().ok else 0


def check_probes(case: CaseRun) -> list[Probe]:
    """The check's probes of ``case``, in the order they must run (Note [probe phases]): the garbage
    probe's leak check ends before the lifetime probe's gc run; the hook counter is registered here; the
    regions probe (a model with compiled regions only) wraps B innermost."""
    found: list[Probe] = [
        CachesProbe(case.schedule, case.pp_stages, case.n_microbatches),
        GarbageProbe(),
        LifetimeProbe(case.pp_stages),
        NumericsProbe(case),
        SideEffectsProbe(case),
        HooksProbe(case),
    ]
    if case.spec.regions_per_b:
        found.append(RegionsProbe(regions_expected(case)))
    return found
