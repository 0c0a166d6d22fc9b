"""Private: what the worker measures around one schedule step, on one rank.

Four probes, each returning plain numbers that go into the rank's JSON verdict:

* :func:`garbage_probe` — tensors and autograd nodes left in reference cycles by the step
  (:func:`ppbackward.leaks.check_tensor_leaks`: anything found fails the step);
* :class:`ActivationProbe` — every activation autograd saves during the step, stage inputs included
  (:func:`ppbackward.leaks.track_activations` with ``include_leaves=True``; parameters are not
  activations and are not recorded),
  and which are still alive once the stage's runtime state is cleared: with the gc disabled, after
  releasing what the stage keeps by design, and after a gc run;
* :func:`stage_caches` — the stage's per-microbatch caches after the step;
* :class:`HookCounter` — ``register_post_accumulate_grad_hook`` calls per parameter.

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
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ppbackward._tools.harness.records import CacheCount, GarbageRecord, KeptByDesign, LifetimeRecord
from ppbackward.leaks import check_tensor_leaks, track_activations

__all__ = [
    "KEPT_BY_DESIGN",
    "ActivationProbe",
    "GarbageResult",
    "HookCounter",
    "garbage_probe",
    "outputs_kept_on_every_stage",
    "recv_buffers_kept_by_stage",
    "schedule_caches",
    "stage_caches",
]


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


@dataclasses.dataclass
class GarbageResult:
    tensors: int = 0
    nodes: int = 0
    tensor_bytes: int = 0
    garbage_objects: int = 0
    garbage_types: dict[str, int] = dataclasses.field(default_factory=dict)
    chains: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.tensors == 0 and self.nodes == 0

    def to_record(self) -> GarbageRecord:
        """The step's garbage record (``rank<r>.json``)."""
        return GarbageRecord(
            self.tensors, self.nodes, self.tensor_bytes, self.garbage_objects, dict(self.garbage_types),
            list(self.chains),
        )


@contextlib.contextmanager
def garbage_probe(max_chains: int = 2) -> Iterator[GarbageResult]:
    """``check_tensor_leaks`` around the block; the result is filled on exit.

    Strict semantics, but the leak is returned, not raised: the worker turns a non-zero count into a
    failure and keeps running the remaining cases. The chains are kept as text; the graph files the
    checker wrote for them (into a fresh temporary folder) are deleted, as nothing reads them.
    """
    result = GarbageResult()
    with check_tensor_leaks(strict=False, max_chains=max_chains) as report:
        yield result
    result.tensors = int(report.num_tensors)
    result.nodes = int(report.num_nodes)
    result.tensor_bytes = int(report.tensor_bytes)
    result.garbage_objects = int(report.num_garbage)
    result.garbage_types = dict(report.garbage_types)  # other garbage (torch's own cycles) is only counted
    result.chains = [str(c) for c in report.chains][:max_chains]
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
