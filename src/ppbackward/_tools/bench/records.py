"""Private: the typed records of ``ppbackward bench --split``'s result, with the harness' one JSON codec.

What ``ppbackward bench --split --json FILE`` writes under ``"split"`` is :func:`to_json` of a
:class:`SplitResult`; :func:`from_json` reads it back (both are ``ppbackward._tools.harness.records``'
codec, re-exported here: one codec for every record, Note [record schema] there, whose
:class:`SchemaError` names the path of a missing, unknown or mistyped field). The JSON keeps the
shape the bench wrote as nested dicts before these records (readers outside the package use it).

Note [split keys]: per regime, :attr:`SplitConfig.time_ms` and :attr:`SplitConfig.ratios` are keyed by
*figure*: ``fwd`` and ``full`` (ppbackward's full ``stage_backward``; times only), and, for every split
variant ``v`` (``pp``, ``torch``, any extra one), ``v_b``, ``v_w`` and ``v_bw`` (:func:`split_key`). That
flat mapping is the file's shape; readers take :meth:`SplitConfig.times` and :meth:`SplitConfig.ratios_of`
instead, which give fields (``times.full``, ``times.variants["pp"].b``), and nothing else builds or
parses these keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ppbackward._tools.harness.records import ScheduleBench, SchemaError, from_json, to_json

__all__ = [
    "CompileRun",
    "CompiledSplit",
    "HeldBytes",
    "PairRatios",
    "PairTimes",
    "RatioStats",
    "ReplayRecord",
    "SchemaError",
    "SplitConfig",
    "SplitCosts",
    "SplitResult",
    "SplitRun",
    "SplitTimes",
    "from_json",
    "split_key",
    "to_json",
]

#: The parts of one split variant (Note [split keys]): B, W, and B then W timed as one.
PARTS = ("b", "w", "bw")


def split_key(variant: str, part: str) -> str:
    """The key of ``variant``'s ``part`` (one of :data:`PARTS`) in a regime's figures (Note [split keys])."""
    return f"{variant}_{part}"


@dataclasses.dataclass(frozen=True)
class RatioStats:
    """One figure's ratio to the full backward over the repeats (Note [split cost] in ``bench.split``):
    ``min_ratio`` is the figure's minimum over the full backward's minimum; ``median``, ``q1``, ``q3``
    those of the ratios taken within one repeat (dimensionless)."""

    min_ratio: float
    median: float
    q1: float
    q3: float


@dataclasses.dataclass(frozen=True)
class PairTimes:
    """One split variant's ms in one regime: B, W, and B then W (``bw``)."""

    b: float
    w: float
    bw: float


@dataclasses.dataclass(frozen=True)
class PairRatios:
    """One split variant's ratios to the full backward in one regime: B's, W's and B then W's."""

    b: RatioStats
    w: RatioStats
    bw: RatioStats


@dataclasses.dataclass(frozen=True)
class SplitTimes:
    """One regime's ms, min over the repeats: the (untimed elsewhere) forward ``fwd``, ppbackward's
    ``full`` backward, and each split variant's :class:`PairTimes` by name, in measurement order."""

    fwd: float
    full: float
    variants: dict[str, PairTimes]


@dataclasses.dataclass(frozen=True)
class HeldBytes:
    """CUDA allocator bytes alive between B and W beyond what the stage holds after W (``bench.split.held_bytes``),
    for ppbackward's split (``pp``) and torch's (``torch``)."""

    pp: int
    torch: int


@dataclasses.dataclass(frozen=True)
class SplitCosts:
    """Per-stage action costs of one configuration in the accumulating regime, ms: forward ``F``, full
    backward ``full``, ppbackward's ``B`` and ``W``; the input of the replay (Note [replayed step])."""

    F: float
    full: float
    B: float
    W: float


@dataclasses.dataclass(frozen=True)
class ReplayRecord:
    """One replayed step (Note [replayed step] in ``bench.replay``) at ``ranks`` ranks and ``microbatches``.

    Attributes:
        step_ms: the step's ms by schedule and costing: ``ScheduleInterleaved1F1B``, ``<zb>/measured``,
            ``<zb>/ideal``, ``<zb>/merged`` for each zero-bubble schedule class name ``zb``.
        ratio_to_1f1b: the same keys, each step over ``ScheduleInterleaved1F1B``'s (dimensionless).
        merged_share: per zero-bubble schedule, the fraction of its W actions merged into a full backward.
    """

    ranks: int
    microbatches: int
    step_ms: dict[str, float]
    ratio_to_1f1b: dict[str, float]
    merged_share: dict[str, float]


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """One configuration of ``--split`` (``bench.split.measure_config``, then ``measure``).

    Attributes:
        name: the stage shape, ``Config.name`` (``4x64x16``); label: its display label (``L4 d64 s16``).
        batch: the microbatch size; repeats: the timed repeats per regime.
        nodes: autograd nodes of one microbatch's backward of the stage; ``None`` where not counted.
        limit_bw: the target on B+W over the full backward (docs/performance.md); ``None`` for none.
        time_ms: per regime, ms by figure (Note [split keys]; read with :meth:`times`).
        ratios: per regime, :class:`RatioStats` by figure but ``fwd`` and ``full`` (read with :meth:`ratios_of`).
        held_bytes: on CUDA, the bytes held between B and W; ``None`` elsewhere.
        costs_ms: the replay's input (``None`` until ``measure`` sets it).
        replay: the replayed steps by ``"<n> ranks"``.
    """

    name: str
    label: str
    batch: int
    nodes: int | None
    repeats: int
    limit_bw: float | None
    time_ms: dict[str, dict[str, float]]
    ratios: dict[str, dict[str, RatioStats]]
    held_bytes: HeldBytes | None = None
    costs_ms: SplitCosts | None = None
    replay: dict[str, ReplayRecord] = dataclasses.field(default_factory=dict)

    def variants(self, regime: str) -> list[str]:
        """The split variants measured in ``regime``, in measurement order."""
        return list(dict.fromkeys(k.rsplit("_", 1)[0] for k in self.ratios[regime]))

    def times(self, regime: str) -> SplitTimes:
        """``regime``'s ms as fields (Note [split keys])."""
        t = self.time_ms[regime]
        pairs = {v: PairTimes(*(t[split_key(v, p)] for p in PARTS)) for v in self.variants(regime)}
        return SplitTimes(fwd=t["fwd"], full=t["full"], variants=pairs)

    def ratios_of(self, regime: str) -> dict[str, PairRatios]:
        """``regime``'s ratios to the full backward per split variant, in measurement order (Note [split keys])."""
        r = self.ratios[regime]
        return {v: PairRatios(*(r[split_key(v, p)] for p in PARTS)) for v in self.variants(regime)}


@dataclasses.dataclass(frozen=True)
class SplitResult:
    """``ppbackward bench --split``'s measurement: the ``device`` it ran on (``"cpu"``, ``"cuda"``) and one
    :class:`SplitConfig` per configuration, in order."""

    device: str
    configs: list[SplitConfig]


@dataclasses.dataclass
class SplitRun:
    """The whole ``--split`` report, as ``ppbackward bench --split`` prints it and writes it (``--json``).

    Attributes:
        meta: the run's circumstances (``cli.bench._meta``: ``date``, ``torch``, ``cpu_count``, ...; the
            run adds ``loadavg_end``).
        split: the measurement.
        schedule: with ``--schedule``, the real torchrun step; ``None`` without it or when it failed.
        schedule_error: why the real step failed; ``None`` when it did not.
        one_rank_step: with ``--one-rank-step``, ``bench.one_rank.measure``'s result or ``{"error": why}``.
        calls: Python calls per microbatch of the full backward, B and W, and the stage's node count, per
            configuration (``bench.calls.count_calls`` as dicts: Note [counted host cost]).
        slow_paths: B's slow paths timed, by path (``"tensor hook"``, ``"saved-tensor hooks"``): each a
            :class:`SplitConfig` of the stage taking that path (Note [slow paths timed] in ``bench.split``).
        targets: the rows of ``report.target_row``, evaluated last.

    Its JSON object (:meth:`to_report`) has ``schedule`` as ``{"error": why}`` for a failed real step, so it
    is assembled here from the codec's pieces rather than by :func:`to_json` of the whole.
    """

    meta: dict[str, Any]
    split: SplitResult
    schedule: ScheduleBench | None = None
    schedule_error: str | None = None
    one_rank_step: dict[str, Any] | None = None
    targets: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    slow_paths: dict[str, SplitConfig] = dataclasses.field(default_factory=dict)

    def to_report(self) -> dict[str, Any]:
        """The JSON object of ``--json``: ``meta``, ``split``, ``schedule`` and ``one_rank_step`` where
        there are, ``targets``."""
        out: dict[str, Any] = {"meta": self.meta, "split": to_json(self.split)}
        if self.schedule_error is not None:
            out["schedule"] = {"error": self.schedule_error}
        elif self.schedule is not None:
            out["schedule"] = to_json(self.schedule)
        if self.one_rank_step is not None:
            out["one_rank_step"] = self.one_rank_step
        if self.calls:
            out["calls"] = self.calls
        if self.slow_paths:
            out["slow_paths"] = {path: to_json(c) for path, c in self.slow_paths.items()}
        out["targets"] = self.targets
        return out

    @classmethod
    def from_report(cls, data: dict[str, Any]) -> SplitRun:
        """The run whose :meth:`to_report` is ``data`` (a ``--json`` file's object).

        Raises:
            SchemaError: ``split`` or ``schedule`` not of their record types (the path of the field named).
        """
        sched = data.get("schedule")
        error = sched.get("error") if isinstance(sched, dict) else None
        return cls(
            meta=data["meta"],
            split=from_json(SplitResult, data["split"], "split"),
            schedule=None if sched is None or error is not None else from_json(ScheduleBench, sched, "schedule"),
            schedule_error=error,
            one_rank_step=data.get("one_rank_step"),
            targets=data.get("targets", []),
            calls=data.get("calls", []),
            slow_paths={
                path: from_json(SplitConfig, c, f"slow_paths[{path!r}]")
                for path, c in data.get("slow_paths", {}).items()
            },
        )


@dataclasses.dataclass(frozen=True)
class CompiledSplit:
    """``ppbackward bench --compile``'s in-process measurement (Note [compiled split cost] in
    ``bench.compiled``): the split's cost on one stage whose layers are ``torch.compile``'d.

    Attributes:
        backend: the ``torch.compile`` backend of every layer (``inductor``, ``aot_eager``).
        device: where it ran (``"cpu"``, ``"cuda"``).
        config: the timings, as ``--split``'s (Note [split keys]): ``full`` is the compiled full backward
            (ppbackward's ``stage_backward``, each region's compiled backward run whole), the one split
            variant ``pp`` ppbackward's B then W (each region's input half, then its weight half); torch's
            split is not timed (its B keeps the graph, which compiled regions' donated buffers refuse).
        regions: the stage's compiled regions (one per layer).
        eager_nodes: autograd nodes of the same stage's backward without compiling (``config.nodes``: with).
        regions_per_b: the regions ppbackward's B split in the exactness check (``regions`` when all split).
        grads_match: B then W's parameter and input grads equal the compiled full backward's within
            ``|x - ref| <= 1e-6 + 1e-5 |ref|``.
    """

    backend: str
    device: str
    config: SplitConfig
    regions: int
    eager_nodes: int | None
    regions_per_b: int
    grads_match: bool


@dataclasses.dataclass
class CompileRun:
    """The whole ``--compile`` report, as ``ppbackward bench --compile`` prints it and writes it (``--json``).

    Attributes:
        meta: the run's circumstances (``cli.bench._meta``), as :class:`SplitRun`'s.
        compiled: the in-process measurement.
        schedule: with ``--schedule``, the real torchrun step with compiled layers (``ScheduleBench.compile``
            set); ``None`` without it or when it failed.
        schedule_error: why the real step failed; ``None`` when it did not.
        targets: the rows of ``report.target_row``, evaluated last.
    """

    meta: dict[str, Any]
    compiled: CompiledSplit
    schedule: ScheduleBench | None = None
    schedule_error: str | None = None
    targets: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_report(self) -> dict[str, Any]:
        """The JSON object of ``--json``: ``meta``, ``compiled``, ``schedule`` where there is one (``{"error":
        why}`` for a failed real step), ``targets``."""
        out: dict[str, Any] = {"meta": self.meta, "compiled": to_json(self.compiled)}
        if self.schedule_error is not None:
            out["schedule"] = {"error": self.schedule_error}
        elif self.schedule is not None:
            out["schedule"] = to_json(self.schedule)
        out["targets"] = self.targets
        return out

    @classmethod
    def from_report(cls, data: dict[str, Any]) -> CompileRun:
        """The run whose :meth:`to_report` is ``data``.

        Raises:
            SchemaError: ``compiled`` or ``schedule`` not of their record types (the path of the field named).
        """
        sched = data.get("schedule")
        error = sched.get("error") if isinstance(sched, dict) else None
        return cls(
            meta=data["meta"],
            compiled=from_json(CompiledSplit, data["compiled"], "compiled"),
            schedule=None if sched is None or error is not None else from_json(ScheduleBench, sched, "schedule"),
            schedule_error=error,
            targets=data.get("targets", []),
        )
