"""Private: the typed records that cross a process or file boundary in the harness, and their one JSON codec.

A harness worker (``ppbackward._tools.harness.worker``) writes, per rank, :class:`RankVerdict`
(``rank<r>.json``: one :class:`CaseRecord` per case, each with one :class:`StepRecord` per measured step)
and :class:`Event` lines (``rank<r>.events.jsonl``, Note [event stream]); ``ppbackward._tools.harness.launch``
reads both back, ``ppbackward check`` tabulates the cases. Every record is a dataclass; :func:`to_json` and
:func:`from_json` are the one pair that turns any of them into JSON-ready values and back.

Note [record schema]: a file carries :data:`SCHEMA_VERSION` at its top (a verdict's ``schema``, every
event's ``schema``). :func:`from_json` refuses a record of another version, a missing field or an
unknown one with a :class:`SchemaError` naming the record type and the path of the field
(``RankVerdict.cases[0].steps[1].hooks.fired``), never a ``KeyError`` deep in a reader: a verdict written
by another ppbackward is refused, not misread. Bump the version whenever a field changes meaning, is
added without a default or goes away.

Note [failure kinds]: a :class:`Failure` carries its ``kind`` (a key of
``ppbackward._tools.harness.diagnose.KINDS``, or ``"other"``), set where it is detected: by the probe
that measured it, or, for an exception, where it was caught (from the exception's type, message and
traceback). Readers never parse the ``message``; it is for people.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, Union

__all__ = [
    "CHECKS",
    "EVENTS",
    "SCHEMA_VERSION",
    "CacheCount",
    "CaseRecord",
    "Event",
    "EventReader",
    "EventWriter",
    "Failure",
    "GarbageRecord",
    "HooksRecord",
    "KeptByDesign",
    "LifetimeRecord",
    "MemoryRecord",
    "NumericsRecord",
    "PartsRecord",
    "RankVerdict",
    "RegionsRecord",
    "RssRecord",
    "ScheduleBench",
    "SchemaError",
    "StepMeasures",
    "StepParts",
    "StepRecord",
    "StepTime",
    "Timeouts",
    "Tolerance",
    "VariantRecord",
    "events_path",
    "from_json",
    "read_verdict",
    "to_json",
    "write_verdict",
]

#: Version of every record below (Note [record schema]); 1 was the untyped dict format.
SCHEMA_VERSION = 2

#: What found a failure: a probe of a measured step, the exception a case stopped on, or the case itself
#: (a schedule that cannot be built).
CHECKS = (
    "garbage", "lifetime", "caches", "numerics", "replicas", "side effects", "hooks", "regions", "exception", "case",
)

#: The events of Note [event stream].
EVENTS = ("started", "case_start", "step_end", "case_end", "done", "fatal")

R = TypeVar("R")


class SchemaError(ValueError):
    """A record that does not match its type: another schema version, a missing, unknown or mistyped field."""


# ----------------------------------------------------------------------------------------------------
# the codec


def to_json(record: Any) -> Any:
    """``record`` (a dataclass of this module, or a list, tuple or dict of them) as JSON-ready values:
    dataclasses become dicts of their fields, tuples lists; everything else is kept as it is."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: to_json(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, (list, tuple)):
        return [to_json(v) for v in record]
    if isinstance(record, dict):
        return {k: to_json(v) for k, v in record.items()}
    return record


def from_json(cls: type[R], data: Any, where: str = "") -> R:
    """The record of type ``cls`` that :func:`to_json` turned into ``data``.

    Raises:
        SchemaError: a field missing, unknown or of the wrong type, or a ``schema`` field other than
            :data:`SCHEMA_VERSION`; the message names the record type and the path of the field.
    """
    return typing.cast(R, _decode(cls, data, where or cls.__name__))


def _decode(tp: Any, data: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, data, where)
    if dataclasses.is_dataclass(tp):
        return _decode_record(tp, data, where)
    if origin in (list, tuple):
        _expect(isinstance(data, list), where, "a list", data)
        return (list if origin is list else tuple)(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
    if origin is dict:
        _expect(isinstance(data, dict), where, "an object", data)
        return {k: _decode(args[1], v, f"{where}.{k}") for k, v in data.items()}
    if tp is Any:
        return data
    if tp is float:
        _expect(isinstance(data, (int, float)) and not isinstance(data, bool), where, "a number", data)
        return float(data)
    _expect(isinstance(data, tp) and (tp is bool or not isinstance(data, bool)), where, tp.__name__, data)
    return data


def _decode_record(cls: Any, data: Any, where: str) -> Any:
    _expect(isinstance(data, dict), where, f"a {cls.__name__} object", data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SchemaError(f"{where}: unknown field(s) {', '.join(unknown)} for {cls.__name__}")
    if "schema" in fields and data.get("schema") != SCHEMA_VERSION:
        raise SchemaError(
            f"{where}: schema version {data.get('schema')!r}, this ppbackward reads version {SCHEMA_VERSION} "
            "(Note [record schema]: written by another ppbackward?)"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _decode(hints[name], data[name], f"{where}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SchemaError(f"{where}: missing field {name!r} of {cls.__name__}")
    try:
        return cls(**kwargs)
    except ValueError as e:  # a record's own validation (__post_init__)
        raise SchemaError(f"{where}: {e}") from None


def _expect(ok: bool, where: str, what: str, data: Any) -> None:
    if not ok:
        raise SchemaError(f"{where}: expected {what}, got {type(data).__name__} {data!r:.80}")


# ----------------------------------------------------------------------------------------------------
# failures and measures


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failure of a case on one rank (Note [failure kinds]).

    Attributes:
        check: what found it, one of :data:`CHECKS`.
        kind: the key of its kind in ``ppbackward._tools.harness.diagnose.KINDS``, or ``"other"``.
        message: one line for people (``"post-accumulate-grad hooks fired 0 times, expected 16 ..."``).
        step: the measured step it was found in (0-based); ``None`` for an exception or the case itself.
        raised: for an exception, its type's name (``"RuntimeError"``); ``""`` otherwise.

    Raises:
        ValueError: ``check`` not one of :data:`CHECKS`, or an empty ``kind``.
    """

    check: str
    kind: str
    message: str
    step: int | None = None
    raised: str = ""

    def __post_init__(self) -> None:
        if self.check not in CHECKS:
            raise ValueError(f"Failure.check {self.check!r}: expected one of {', '.join(CHECKS)}")
        if not self.kind:
            raise ValueError(f"Failure.kind is empty (check {self.check!r}): name its kind where it is detected")

    @property
    def text(self) -> str:
        """The line shown for it: ``step 0: hooks: <message>``, ``exception: <message>``, or the case's own."""
        if self.check == "exception":
            return f"exception: {self.message}"
        if self.check == "case":
            return self.message
        return ("" if self.step is None else f"step {self.step}: ") + f"{self.check}: {self.message}"


@dataclasses.dataclass(frozen=True)
class GarbageRecord:
    """What ``check_tensor_leaks`` found in reference cycles after a step: ``tensors`` and autograd
    ``nodes``, the bytes of those tensors, other ``garbage_objects`` by type, and back-reference chains."""

    tensors: int = 0
    nodes: int = 0
    tensor_bytes: int = 0
    garbage_objects: int = 0
    garbage_types: dict[str, int] = dataclasses.field(default_factory=dict)
    chains: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No tensor and no autograd node in a cycle."""
        return self.tensors == 0 and self.nodes == 0


@dataclasses.dataclass(frozen=True)
class KeptByDesign:
    """Saved activations alive only through the stage's receive buffers (Note [kept by design]): count, bytes."""

    recv_buffer: int = 0
    bytes_recv_buffer: int = 0


@dataclasses.dataclass(frozen=True)
class LifetimeRecord:
    """Saved activations of one step (counts, and bytes where named so), from ``track_activations``:
    recorded, alive after ``clear_runtime_states()``, kept by design, alive without a gc run, freed only by
    one, held after one; autograd nodes and packed saved tensors held after it (Note [leaks the gc cannot
    see] in ``ppbackward.leaks``), with up to 5 examples of each."""

    saved: int = 0
    bytes_saved: int = 0
    alive_after_clear: int = 0
    kept_by_design: KeptByDesign = dataclasses.field(default_factory=KeptByDesign)
    alive_without_gc: int = 0
    freed_only_by_gc: int = 0
    bytes_freed_only_by_gc: int = 0
    held_after_gc: int = 0
    bytes_held_after_gc: int = 0
    nodes: int = 0
    nodes_held_after_gc: int = 0
    node_examples: list[str] = dataclasses.field(default_factory=list)
    packed_held_after_gc: int = 0
    bytes_packed_held_after_gc: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class CacheCount:
    """One per-microbatch cache after a step: its entries and the tensors reachable from it."""

    entries: int
    tensors: int


@dataclasses.dataclass(frozen=True)
class NumericsRecord:
    """Grads and losses of one step against the reference.

    Attributes:
        params_compared: parameters with a grad on either side.
        max_abs_grad_err: max |grad - reference| over them (0.0 where none could be compared).
        worst_param: the parameter of that maximum (``""`` for none).
        losses_compared: microbatch losses compared (0 off the last stage).
        max_abs_loss_err: max |loss - reference loss|.
        grads_none: grads ``None`` in the pipeline that the reference has.
        grads_unexpected: grads set in the pipeline where the reference has ``None``.
        grads_outside: grads with an element outside the tolerance.
        grads_misshaped: grads of another shape than the reference's (no difference measured).
        losses_wrong: losses outside the tolerance.
        losses_miscounted: whether the pipeline returned another number of losses than the reference.
        max_replica_diff: with DDP, max |grad difference| between the dp replicas; ``None`` otherwise.
        replicas_diverged: with DDP, whether the replicas' grads differ.
    """

    params_compared: int = 0
    max_abs_grad_err: float = 0.0
    worst_param: str = ""
    losses_compared: int = 0
    max_abs_loss_err: float = 0.0
    grads_none: int = 0
    grads_unexpected: int = 0
    grads_outside: int = 0
    grads_misshaped: int = 0
    losses_wrong: int = 0
    losses_miscounted: bool = False
    max_replica_diff: float | None = None
    replicas_diverged: bool = False


@dataclasses.dataclass(frozen=True)
class HooksRecord:
    """Post-accumulate-grad hook calls of one step: ``fired``, ``expected``, and parameters off (``params_wrong``)."""

    fired: int = 0
    expected: int = 0
    params_wrong: int = 0


@dataclasses.dataclass(frozen=True)
class RegionsRecord:
    """torch.compile'd regions ppbackward's B split into B and W (the regions probe, Note [compiled regions
    split in two] in ``ppbackward._compiled``): over one step of one rank, or (``ppbackward check``'s cell)
    summed over a case's ranks and steps.

    Attributes:
        b_calls: B calls (``stage_backward_input``) made.
        b_split: of those, the calls that split at least one compiled region.
        regions: compiled regions split, over every B call (the regions of their param groups).
        fewest, most: the fewest and the most regions one B call split (0 without a B call).
        expected: the regions every B call must split (the model's ``ModelSpec.regions_per_b``); 0 where it
            is not judged (a torch without the split).
        counted: whether B's param groups say which regions they split (ppbackward's do, torch's dicts not).
    """

    b_calls: int = 0
    b_split: int = 0
    regions: int = 0
    fewest: int = 0
    most: int = 0
    expected: int = 0
    counted: bool = True

    @classmethod
    def summed(cls, found: Sequence[RegionsRecord | None]) -> RegionsRecord | None:
        """Several steps' or ranks' records as one: calls and regions summed, the fewest and the most over
        the records with a B call, counted only where every one was; ``None`` where none was counted."""
        known = [r for r in found if r is not None]
        if not known:
            return None
        with_b = [r for r in known if r.b_calls]
        return cls(
            b_calls=sum(r.b_calls for r in known), b_split=sum(r.b_split for r in known),
            regions=sum(r.regions for r in known), fewest=min((r.fewest for r in with_b), default=0),
            most=max((r.most for r in with_b), default=0), expected=max(r.expected for r in known),
            counted=all(r.counted for r in known),
        )

    @property
    def all_split(self) -> bool:
        """Every B call split every region it was expected to (vacuously where nothing is expected)."""
        return not self.expected or not self.counted or self.fewest == self.most == self.expected or not self.b_calls


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The step time probe's record: this rank's ``own_s`` and the slowest rank's ``slowest_s`` (seconds)."""

    own_s: float
    slowest_s: float


@dataclasses.dataclass(frozen=True)
class StepParts:
    """Where one step's time went on one rank, ms (Note [step parts] in ``ppbackward._tools.harness.bench_probes``):
    forwards ``F``, full backwards ``full``, ``B``, ``W``, waits for a peer ``wait``, the rest ``other``, and
    the whole ``step``. The fields' order is the report's column order."""

    F: float = 0.0
    full: float = 0.0
    B: float = 0.0
    W: float = 0.0
    wait: float = 0.0
    other: float = 0.0
    step: float = 0.0


@dataclasses.dataclass(frozen=True)
class PartsRecord:
    """The step parts probe's record: the ``parts``, and one slice per timed call (``[kind, start ms from
    the step's start, ms, stage index or None, microbatch or None]``, the timeline of ``--trace``)."""

    parts: StepParts
    slices: list[list[Any]]


@dataclasses.dataclass(frozen=True)
class RssRecord:
    """The RSS probe's record: the step's RSS high-water mark and its growth over the step's start, bytes;
    ``None`` where ``/proc`` does not say."""

    peak_bytes: int | None
    growth_bytes: int | None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One measured step of one case on one rank: its number (0-based), wall ``seconds`` of
    ``schedule.step`` on this rank, and the record of each probe that ran (``None`` for one that did not:
    ``ppbackward check`` runs the first five, and ``regions`` for a model with compiled regions,
    ``ppbackward bench --schedule`` the others, Note [probe phases] in ``ppbackward._tools.harness.runner``);
    ``caches`` maps a place (``"schedule"``, ``"stage 1"``) to its caches by attribute name;
    ``saved_peak_bytes`` is the peak bytes of live saved activations."""

    step: int
    seconds: float
    garbage: GarbageRecord | None = None
    lifetime: LifetimeRecord | None = None
    caches: dict[str, dict[str, CacheCount]] | None = None
    numerics: NumericsRecord | None = None
    hooks: HooksRecord | None = None
    time: StepTime | None = None
    parts: PartsRecord | None = None
    rss: RssRecord | None = None
    saved_peak_bytes: int | None = None
    regions: RegionsRecord | None = None


@dataclasses.dataclass(frozen=True)
class MemoryRecord:
    """Memory of one schedule variant's untimed step (Note [schedule benchmark]), bytes: the RSS
    high-water mark, its growth over the step's start (``None`` where ``/proc`` does not say), and the peak
    of live saved activations."""

    rss_peak_bytes: int | None
    rss_growth_bytes: int | None
    saved_peak_bytes: int | None


@dataclasses.dataclass(frozen=True)
class VariantRecord:
    """One schedule variant of the bench on one rank (Note [schedule benchmark]): ``step_ms``, the minimum
    over the repeats of the slowest rank's step; ``parts`` and ``slices``, this rank's in that fastest step;
    ``memory``, this rank's."""

    step_ms: float
    parts: StepParts
    slices: list[list[Any]]
    memory: MemoryRecord


#: ``status`` of a case: ``pass``, ``fail`` (a probe failed), ``error`` (an exception), ``skip``.
STATUSES = ("pass", "fail", "error", "skip")


@dataclasses.dataclass
class CaseRecord:
    """One (schedule x model x wrapper) case on one rank.

    Attributes:
        id: ``Schedule/model[+wrap]``; schedule, model, wrap: its parts.
        status: one of ``pass``, ``fail``, ``error``, ``skip``.
        failures: every failure, steps in order, then the exception, if any.
        steps: one record per measured step.
        reason: why the case was skipped (``status == "skip"``).
        error: the traceback of the exception the case stopped on (for display only).
        stages: this rank's stage indices; num_stages, n_microbatches: the case's.
        metadata: ``static`` or ``dynamic`` (how the stages learnt their shapes).
        actions: this rank's compute actions by kind, ``lowered`` and ``planned`` (the worker's ``action_counts``).
        seconds: wall time of the whole case on this rank.
        bench: a schedule variant of ``--mode bench``: its timings and memory (``None`` in a check).
    """

    id: str
    schedule: str = ""
    model: str = ""
    wrap: str = "none"
    status: str = "pass"
    failures: list[Failure] = dataclasses.field(default_factory=list)
    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    reason: str | None = None
    error: str | None = None
    world_size: int = 0
    dp: int = 1
    dp_rank: int = 0
    stages: list[int] = dataclasses.field(default_factory=list)
    num_stages: int = 0
    n_microbatches: int = 0
    metadata: str = ""
    actions: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    bench: VariantRecord | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"CaseRecord {self.id!r}: status {self.status!r}, expected one of {', '.join(STATUSES)}")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """The numerics rule: ``|x - ref| <= atol + rtol * |ref|`` elementwise, in ``dtype``; the one rule every
    comparison with a reference uses (:meth:`outside`). A case carries its own (Note [one numerics rule] in
    ``ppbackward._tools.harness.probes``)."""

    rtol: float
    atol: float
    dtype: str = "float32"
    rule: str = "|x - ref| <= atol + rtol * |ref|"

    def outside(self, got: Any, want: Any) -> Any:
        """The elementwise mask of ``got`` outside the rule around ``want`` (tensors or floats alike)."""
        return abs(got - want) > self.atol + self.rtol * abs(want)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Timeouts in force (Note [timeouts scale with start-up] in the worker), seconds."""

    startup_s: float
    factor: float
    case_timeout_s: float
    pg_timeout_s: float


@dataclasses.dataclass
class RankVerdict:
    """One rank's ``rank<r>.json``: what ran, how, and one record per case.

    ``complete``: every case ran; ``fatal``: the traceback the rank stopped on; ``installed``: what
    ``pipelining.stage`` calls, by name; ``workarounds``: torch bugs worked around; ``seconds``: the run;
    ``mode``: ``check`` (the cases of ``ppbackward check``) or ``bench`` (the schedule variants of ``ppbackward
    bench --schedule``, one case each).
    """

    rank: int
    world_size: int
    backward: str
    schema: int = SCHEMA_VERSION
    torch: str = ""
    tolerance: Tolerance | None = None
    kept_by_design: dict[str, str] = dataclasses.field(default_factory=dict)
    complete: bool = False
    fatal: str | None = None
    workarounds: list[str] = dataclasses.field(default_factory=list)
    dp: int = 1
    metadata: str = ""
    installed: dict[str, str] = dataclasses.field(default_factory=dict)
    timeouts: Timeouts | None = None
    mode: str = "check"
    cases: list[CaseRecord] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def write_verdict(path: Path, verdict: RankVerdict) -> None:
    """Write ``verdict`` to ``path`` atomically (a reader sees the old file or the new one, never half)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(to_json(verdict), indent=1))
    os.replace(tmp, path)


def read_verdict(path: Path) -> RankVerdict | None:
    """The verdict at ``path``; ``None`` where there is none (not written, or not JSON).

    Raises:
        SchemaError: the file is JSON but not a verdict of :data:`SCHEMA_VERSION`.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return from_json(RankVerdict, data, f"{path.name}")


# ----------------------------------------------------------------------------------------------------
# events
#
# Note [event stream]: every worker appends one JSON line per event to ``rank<r>.events.jsonl``, flushed
# as it happens: ``started`` (its process group is up), ``case_start`` and ``case_end`` (with the case's
# record), ``step_end`` (a measured step finished), then ``done`` or ``fatal``. Each event records the
# rank log's size when it happened (``log_offset``), so that a case's log is the bytes between its
# ``case_start`` and ``case_end``. The launcher reads these lines, never the logs' text or file times: the
# progress line (what runs, what finished), the case reports and the hang clock (Note [hang clock] in
# ``ppbackward._tools.harness.launch``) come from them. A line being written is skipped until its newline
# is there.


@dataclasses.dataclass(frozen=True)
class Event:
    """One event of one rank (Note [event stream]).

    Attributes:
        event: one of :data:`EVENTS`.
        rank: the rank.
        time: ``time.time()`` when it happened (seconds; for people, never for a verdict).
        case: the case id (``case_start``, ``step_end``, ``case_end``).
        step: the measured step (``step_end``).
        record: the case's record (``case_end``).
        log_offset: the rank log's size in bytes when it happened, ``None`` where unknown.
    """

    event: str
    rank: int
    time: float
    case: str | None = None
    step: int | None = None
    record: CaseRecord | None = None
    log_offset: int | None = None
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"Event {self.event!r}: expected one of {', '.join(EVENTS)}")


def events_path(out_dir: Path, rank: int) -> Path:
    """``<out_dir>/rank<r>.events.jsonl``."""
    return out_dir / f"rank{rank}.events.jsonl"


class EventWriter:
    """Appends one rank's events to its stream (Note [event stream]), one flushed line each."""

    def __init__(self, out_dir: Path, rank: int, log: Path | None = None) -> None:
        self.rank, self.log = rank, log
        self._file = open(events_path(out_dir, rank), "a", buffering=1)  # noqa: SIM115 - lives with the writer

    def emit(self, event: str, **fields: Any) -> Event:
        """Write and return one event (``fields``: those of :class:`Event` besides ``event``, ``rank``, ``time``)."""
        offset = None
        if self.log is not None:
            offset = self.log.stat().st_size if self.log.exists() else 0
        record = Event(event, self.rank, time.time(), log_offset=offset, **fields)
        self._file.write(json.dumps(to_json(record)) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()


class EventReader:
    """Reads one rank's stream as it grows: :meth:`poll` returns the events written since the last call."""

    def __init__(self, out_dir: Path, rank: int) -> None:
        self.path = events_path(out_dir, rank)
        self.events: list[Event] = []
        self._offset = 0

    def poll(self) -> list[Event]:
        """New complete events (a line without its newline yet waits for the next poll).

        Raises:
            SchemaError: a line that is not an event of :data:`SCHEMA_VERSION`.
        """
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        new = [
            from_json(Event, json.loads(line), f"{self.path.name}: Event")
            for line in chunk[:end].decode().splitlines()
            if line.strip()
        ]
        self.events += new
        return new


# ----------------------------------------------------------------------------------------------------
# what the check tabulates


@dataclasses.dataclass(frozen=True)
class StepMeasures:
    """One measured step of one rank, as the check's columns use it.

    Attributes:
        step: the step's number (0-based, measured steps only).
        seconds: wall time of the step on that rank.
        garbage: tensors + autograd nodes found in reference cycles after the step.
        bytes_freed_only_by_gc: bytes of saved activations freed only by a gc run (held by a cycle).
        bytes_held_after_gc: bytes of saved activations alive after the step and a gc run.
        max_abs_grad_err: max |grad - reference| over the rank's parameters.
        hooks_fired: post-accumulate-grad hook calls in the step.
        hooks_expected: calls expected (once per trainable parameter per microbatch; 0 for a frozen rank).
        regions: the compiled regions B split in the step; ``None`` where they were not counted.
    """

    step: int
    seconds: float
    garbage: int
    bytes_freed_only_by_gc: int
    bytes_held_after_gc: int
    max_abs_grad_err: float
    hooks_fired: int
    hooks_expected: int
    regions: RegionsRecord | None = None

    @classmethod
    def from_record(cls, step: StepRecord) -> StepMeasures:
        """The measures of a worker's step record (a probe that did not run counts as nothing found)."""
        garbage, lifetime = step.garbage or GarbageRecord(), step.lifetime or LifetimeRecord()
        hooks = step.hooks or HooksRecord()
        return cls(
            step=step.step,
            seconds=step.seconds,
            garbage=garbage.tensors + garbage.nodes,
            bytes_freed_only_by_gc=lifetime.bytes_freed_only_by_gc,
            bytes_held_after_gc=lifetime.bytes_held_after_gc,
            max_abs_grad_err=(step.numerics or NumericsRecord()).max_abs_grad_err,
            hooks_fired=hooks.fired,
            hooks_expected=hooks.expected,
            regions=step.regions,
        )


# ----------------------------------------------------------------------------------------------------
# what the bench reports


@dataclasses.dataclass
class ScheduleBench:
    """``ppbackward bench --schedule``'s result over every rank (Note [schedule benchmark] in
    ``ppbackward._tools.harness.schedule_bench``); :func:`to_json` gives the report's ``schedule`` object.

    Attributes:
        ranks, stages: the launch's ranks and pipeline stages; layers_per_stage, d_model, seq, microbatches,
            microbatch_size: the stage stacks and the batch; repeats: timed steps per variant.
        variants: the variant names (``Interleaved1F1B/upstream``), in run order.
        step_ms: per variant, the minimum over the repeats of the slowest rank's step, ms.
        ratio_to_1f1b: per variant, ``step_ms`` over ``Interleaved1F1B/upstream``'s.
        memory: per variant, the maximum over the ranks of each figure.
        parts_ms, slices_ms: per variant, each rank's parts and slices in its fastest step (Note [step parts]).
        grads_match: every variant's grads and losses within the case's tolerance of the reference, on every rank.
        compile: the ``torch.compile`` backend of every stage's layers (``bench --compile --schedule``); ``""``
            for eager stages.
        regions: with compiled stages, per variant, the compiled regions its B calls split in its exactness
            step, summed over the ranks (Note [regions counted] in ``ppbackward._tools.harness.probes``).
    """

    ranks: int
    stages: int
    layers_per_stage: int
    d_model: int
    seq: int
    microbatches: int
    microbatch_size: int
    repeats: int
    variants: list[str]
    step_ms: dict[str, float]
    ratio_to_1f1b: dict[str, float]
    memory: dict[str, MemoryRecord]
    parts_ms: dict[str, list[StepParts]]
    slices_ms: dict[str, list[list[list[Any]]]]
    grads_match: bool
    compile: str = ""
    regions: dict[str, RegionsRecord] = dataclasses.field(default_factory=dict)
