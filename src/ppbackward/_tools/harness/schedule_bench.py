"""Private: the schedule benchmark of ``ppbackward bench --schedule``: the worker's ``--mode bench`` (the step
time, step parts and peak memory of three schedules, two backwards, under torchrun) and its launch.

Note [schedule benchmark]: the model is ``2 * world`` stages, each a stack of encoder layers
(``build_stack``; stage ``i`` built from seed ``100 + i``, so every schedule trains the same weights), fed
``microbatches`` microbatches of ``microbatch_size`` samples per step, its loss the mean squared error
(:func:`bench_spec`). Every stage gets static metadata (``input_args`` / ``output_args``,
:func:`build_stages`): no shape-inference forward, as a production run configures it. The variants are

* ``ScheduleInterleaved1F1B`` (full backward, the schedule zero-bubble exists to beat), with torch's
  ``stage_backward`` and with ppbackward's;
* ``ScheduleInterleavedZeroBubble`` (loop placement: this rank holds stages ``rank`` and
  ``rank + world``) and ``ScheduleZBVZeroBubble`` (V placement: ``rank`` and ``2 * world - 1 -
  rank``), each with torch's B/W (``ppbackward.uninstall()``), with ppbackward's
  (``ppbackward.install()``), and ``merged``: with ppbackward's, the schedule built while
  ``install(merge_bw=True)`` was on (each B directly followed by its own W one full backward: Note
  [merged B and W] in ``ppbackward._merge``).

Note [compiled schedule benchmark]: with ``compile`` (a ``torch.compile`` backend; ``ppbackward bench
--compile --schedule``) every layer of every stage is a ``torch.compile(layer)`` child, compiled after the
reference took its eager copy, and the variants are :data:`COMPILED_VARIANTS`: torch's own B/W refuses
compiled stages when its zero-bubble schedules are built, so only ``Interleaved1F1B`` runs with torch's
backward, the base of the ratios, against ppbackward's zero-bubble variants. Backward graphs are compiled
through ppbackward's splitting compiler in every variant (``ppbackward._compiled.enable()``, also while
torch's backward runs: outside ppbackward's B it runs the backend's compiled graph whole, one dictionary
test more), so that a region first compiled under torch's variant can still be split by ppbackward's;
and before any variant every rank compiles its stages, forward, backward and the split halves of each
region, one stage after another, each announced as an event (:func:`_compile_stages`: compiling is not
the step's time, and an inductor compile is minutes on a busy machine, which the launcher's hang clock
must see progress through). Each variant's exactness step also counts the regions each B call split
(``probes.RegionsProbe``: every layer of every stage but stage 0, whose B torch skips), which
``ScheduleBench.regions`` reports; a region run whole in B would time something else than the split. The
numerics rule stays :data:`BENCH_TOLERANCE` against the eager reference (inductor's kernels sum in
another order: 2e-8 at most here, 4 layers d 256, 8 microbatches).

Every step is one :func:`ppbackward._tools.harness.runner.run_step` under the bench's probes
(:mod:`ppbackward._tools.harness.bench_probes`), the step time probe first (its barrier starts every
rank together, before the other probes start their clocks). Exactness comes first, with each variant's
first (warm-up) step: the numerics probe compares every grad and loss with the single-process reference
of the same stages on the same batch, by the one rule (Note [one numerics rule] in
``ppbackward._tools.harness.probes``) at the tolerance of this model, :data:`BENCH_TOLERANCE`. Then
every repeat runs every variant once, in an order rotated by one per repeat (Note [interleaved
repeats]), under the step time and step parts probes; a step's time is the slowest rank's, the figure
the minimum over repeats, and its parts those of that fastest step (Note [step parts]). Last, one
untimed step per variant under the RSS and saved-activation probes measures memory. Each variant is one
case of the rank's verdict (its ``bench`` field: ``records.VariantRecord``); the launcher side,
:func:`run_schedule`, reads every rank's and reduces them to
one :class:`~ppbackward._tools.harness.records.ScheduleBench`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from ppbackward._tools.harness import bench_probes, probes, runner
from ppbackward._tools.harness import models as zoo
from ppbackward._tools.harness.models import build_stack
from ppbackward._tools.harness.records import (
    CaseRecord,
    EventWriter,
    MemoryRecord,
    PartsRecord,
    RegionsRecord,
    ScheduleBench,
    StepParts,
    StepRecord,
    StepTime,
    Tolerance,
    VariantRecord,
)

__all__ = [
    "BENCH_TOLERANCE",
    "COMPILED_VARIANTS",
    "VARIANTS",
    "BenchConfig",
    "ScheduleBenchError",
    "bench_spec",
    "build_stages",
    "grads_close",
    "mse_loss",
    "param_grads",
    "run",
    "run_schedule",
    "variant_name",
]

# (schedule class name, stage placement, backward); the first is the base of ``ratio_to_1f1b``.
VARIANTS = (
    ("ScheduleInterleaved1F1B", "loop", "upstream"),
    ("ScheduleInterleaved1F1B", "loop", "ppbackward"),
    ("ScheduleInterleavedZeroBubble", "loop", "upstream"),
    ("ScheduleInterleavedZeroBubble", "loop", "ppbackward"),
    ("ScheduleInterleavedZeroBubble", "loop", "merged"),
    ("ScheduleZBVZeroBubble", "v", "upstream"),
    ("ScheduleZBVZeroBubble", "v", "ppbackward"),
    ("ScheduleZBVZeroBubble", "v", "merged"),
)

#: With compiled stages (Note [compiled schedule benchmark]): torch's own B/W refuses them in its zero-bubble
#: schedules, so only its Interleaved1F1B runs, the base of ``ratio_to_1f1b``.
COMPILED_VARIANTS = (
    ("ScheduleInterleaved1F1B", "loop", "upstream"),
    ("ScheduleInterleaved1F1B", "loop", "ppbackward"),
    ("ScheduleInterleavedZeroBubble", "loop", "ppbackward"),
    ("ScheduleInterleavedZeroBubble", "loop", "merged"),
    ("ScheduleZBVZeroBubble", "v", "ppbackward"),
    ("ScheduleZBVZeroBubble", "v", "merged"),
)

#: The numerics rule of the bench's encoder stacks (Note [one numerics rule] in ``probes``): the check's. The
#: single-process reference runs the same ops in the same order per microbatch, so every variant's grads and
#: losses match it exactly on CPU (max |grad - ref| = 0.0 for all eight, torch 2.13, 2 ranks); the looser
#: rtol 1e-4 the bench once used against another pipeline variant is not needed.
BENCH_TOLERANCE = probes.CHECK_TOLERANCE


class ScheduleBenchError(RuntimeError):
    """The launch failed, crashed or hung (``command``: the torchrun command line launched)."""

    def __init__(self, message: str, command: list[str]) -> None:
        super().__init__(message)
        self.command = command


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """The stage stacks and the batch of the schedule benchmark (Note [schedule benchmark])."""

    layers_per_stage: int = 4
    d_model: int = 128
    seq: int = 16
    microbatches: int = 8
    microbatch_size: int = 2
    compile: str = ""  # a torch.compile backend for every layer (Note [compiled schedule benchmark]); "": eager

    def worker_args(self) -> list[str]:
        """The worker's ``--mode bench`` options for this configuration."""
        return ["--mode", "bench", "--layers-per-stage", str(self.layers_per_stage), "--d-model", str(self.d_model),
                "--seq", str(self.seq), "--microbatches", str(self.microbatches),
                "--microbatch-size", str(self.microbatch_size), *(["--compile", self.compile] if self.compile else [])]

    @property
    def variants(self) -> tuple[tuple[str, str, str], ...]:
        """(schedule, placement, backward) of every variant, the base of the ratios first."""
        return COMPILED_VARIANTS if self.compile else VARIANTS


def variant_name(schedule: str, backward: str) -> str:
    """``Interleaved1F1B/upstream`` for ``("ScheduleInterleaved1F1B", "upstream")``."""
    return f"{schedule.removeprefix('Schedule')}/{backward}"


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The bench's loss: the mean squared error of one microbatch."""
    return (out - target).pow(2).mean()


def bench_spec(config: BenchConfig) -> zoo.ModelSpec:
    """The bench's model as a zoo model: stage ``i`` is ``build_stack(layers_per_stage, d_model, seed=100 + i)``;
    with ``compile``, each of its layers is a compiled region (:func:`compile_layers`, applied by ``_setup``)."""
    return zoo.ModelSpec(
        name=f"encoder-{config.layers_per_stage}x{config.d_model}x{config.seq}",
        features="stacks of nn.TransformerEncoderLayer, mean squared error (the schedule benchmark)",
        build_stage=lambda i, n: build_stack(config.layers_per_stage, config.d_model, seed=100 + i),
        loss_fn=mse_loss,
        metadata="static",
        regions_per_b=config.layers_per_stage if config.compile else 0,
    )


def compile_layers(stack: nn.Module, backend: str) -> nn.Module:
    """Put ``torch.compile(layer, backend=backend)`` in place of every child of ``stack`` (a stack of
    layers: a child ``OptimizedModule`` each, one compiled region per layer); returns ``stack``."""
    for name, layer in list(stack.named_children()):
        setattr(stack, name, torch.compile(layer, backend=backend))
    return stack


def build_stages(
    modules: Mapping[int, nn.Module], stage_ids: Sequence[int], num_stages: int, shape: tuple[int, ...],
    device: torch.device,
) -> list[Any]:
    """A ``PipelineStage`` per index of ``stage_ids`` (of ``num_stages``), over ``modules[i]``, with static
    metadata: one input and one output of ``shape`` on ``device`` (no shape-inference forward). Shared
    with the one-rank step (``ppbackward._tools.bench.one_rank``)."""
    from torch.distributed.pipelining import PipelineStage

    # a receive buffer requires grad only when its example does: every stage input but stage 0's
    return [
        PipelineStage(
            modules[i], i, num_stages, device,
            input_args=(torch.zeros(shape, device=device, requires_grad=i > 0),),
            output_args=(torch.zeros(shape, device=device, requires_grad=True),),
        )
        for i in stage_ids
    ]


def param_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: grad}`` of the parameters of ``module`` that have a grad."""
    return {n: q.grad for n, q in module.named_parameters() if q.grad is not None}


def grads_close(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], tolerance: Tolerance = BENCH_TOLERANCE
) -> bool:
    """The same parameters have grads in both, each within ``tolerance`` of the reference's (the one rule:
    ``Tolerance.outside``, Note [one numerics rule] in ``probes``)."""
    return set(ref) == set(got) and not any(bool(tolerance.outside(got[n], g).any()) for n, g in ref.items())


# ----------------------------------------------------------------------------------------------------
# the worker's --mode bench


def _stage_ids(placement: str, rank: int, world: int) -> list[int]:
    return [rank, rank + world] if placement == "loop" else [rank, 2 * world - 1 - rank]


class _Variant:
    """One schedule over this rank's stages, with the backward it runs under, as a runner case."""

    def __init__(self, schedule: str, placement: str, backward: str, bench: _Bench) -> None:
        from torch.distributed.pipelining import schedules

        import ppbackward

        self.name, self.schedule, self.backward = variant_name(schedule, backward), schedule, backward
        self.stage_ids = _stage_ids(placement, bench.rank, bench.world)
        cfg = bench.config
        shape = (cfg.microbatch_size, cfg.seq, cfg.d_model)
        stages = build_stages(bench.modules, self.stage_ids, 2 * bench.world, shape, torch.device("cpu"))
        merge: Any = contextlib.nullcontext()
        if backward == "merged":
            merge = ppbackward.installed(merge_bw=True)
        elif backward == "ppbackward" and cfg.compile:  # torch's zero-bubble schedules refuse compiled stages
            merge = ppbackward.installed()
        with merge:  # a schedule lowers its action list when it is built
            built = getattr(schedules, schedule)(stages, n_microbatches=cfg.microbatches, loss_fn=mse_loss,
                                                 scale_grads=False)
        modules = {i: bench.modules[i] for i in self.stage_ids}
        named = [pair for i in self.stage_ids for pair in zoo.param_names(i, modules[i])]
        self.case = runner.CaseRun(built, stages, modules, named, bench.spec, cfg.microbatches, BENCH_TOLERANCE,
                                   reference=bench.reference)

    def step(self, bench: _Bench, probes: list[runner.Probe], step: int) -> tuple[StepRecord, list[Any]]:
        """One step under ``probes`` with this variant's backward installed; its record and failures."""
        import ppbackward
        from ppbackward import _compiled

        (ppbackward.uninstall if self.backward == "upstream" else ppbackward.install)()
        if bench.config.compile:  # Note [compiled schedule benchmark]: backward graphs stay splittable
            _compiled.enable()
        return runner.run_step(self.case, probes, [bench.batch], step, bench.expected)

    def regions_expected(self, bench: _Bench) -> int:
        """The regions each B call of this variant must split (Note [compiled schedule benchmark])."""
        from ppbackward import _compiled

        split = self.backward != "upstream" and _compiled.support().ok
        return bench.spec.regions_per_b if split else 0


@dataclasses.dataclass
class _Bench:
    """The stages, batch and reference every variant of this rank shares."""

    config: BenchConfig
    rank: int
    world: int
    spec: zoo.ModelSpec
    modules: dict[int, nn.Module]
    reference: list[nn.Module]
    batch: zoo.Batch
    expected: zoo.ReferenceResult


def _setup(config: BenchConfig, rank: int, world: int) -> _Bench:
    """Every stage (this rank keeps its own), the reference's copy, the batch and the reference's result."""
    spec = bench_spec(config)
    every = zoo.build_stages(spec, 2 * world, seed=0)  # build_stack seeds each stage itself
    reference = copy.deepcopy(every)
    mine = sorted({i for _, placement, _ in config.variants for i in _stage_ids(placement, rank, world)})
    if config.compile:  # after the reference's copy: it stays eager (Note [compiled schedule benchmark])
        for i in mine:
            compile_layers(every[i], config.compile)
    gen = torch.Generator().manual_seed(7)
    size = config.microbatches * config.microbatch_size
    x = torch.randn(size, config.seq, config.d_model, generator=gen)
    batch = zoo.Batch(args=(x,), kwargs={}, target=torch.randn(size, config.seq, config.d_model, generator=gen))
    expected = zoo.reference_step(reference, batch, config.microbatches, spec.loss_fn)
    return _Bench(config, rank, world, spec, {i: every[i] for i in mine}, reference, batch, expected)


def _compile_stages(bench: _Bench, events: EventWriter) -> None:
    """Compile this rank's stages under ``ppbackward.install()``, one after another, each announced
    (Note [compiled schedule benchmark]): a forward and ppbackward's B and W of one microbatch, which compiles
    each region's forward, backward and split halves; stage 0, whose input needs no grad and whose B torch
    skips (its W is a full backward), a forward and a full backward. The grads are dropped."""
    import ppbackward

    cfg = bench.config
    with ppbackward.installed():
        for i, module in sorted(bench.modules.items()):
            events.emit("case_start", case=f"compile stage {i}")
            x = torch.randn(cfg.microbatch_size, cfg.seq, cfg.d_model, requires_grad=i > 0)
            params = list(module.parameters())
            if i == 0:
                module(x).sum().backward()
            else:
                _, groups = ppbackward.stage_backward_input([module(x).sum()], None, [x], iter(params))
                ppbackward.stage_backward_weight(iter(params), groups)
                del groups
            del x
            module.zero_grad(set_to_none=True)
            events.emit("step_end", case=f"compile stage {i}", step=0)


def _timed(bench: _Bench, variants: list[_Variant], repeats: int, events: EventWriter) -> dict[str, StepRecord]:
    """The interleaved timed repeats (Note [interleaved repeats]); each variant's fastest step's record."""
    from ppbackward._tools.repeats import rotations

    best: dict[str, StepRecord] = {}
    parts = bench_probes.PartsProbe([s for v in variants for s in v.case.pp_stages])
    try:
        for repeat, order in enumerate(rotations(tuple(variants), repeats), start=1):
            for v in order:
                record, _ = v.step(bench, [bench_probes.StepTimeProbe(), parts], repeat)
                assert record.time is not None
                old = best.get(v.name)
                if old is None or (old.time is not None and record.time.slowest_s < old.time.slowest_s):
                    best[v.name] = record
                events.emit("step_end", case=v.name, step=repeat)
    finally:
        parts.close()
    return best


def _memory(bench: _Bench, v: _Variant, step: int) -> MemoryRecord:
    """One untimed step of ``v`` under the RSS and saved-activation probes."""
    params = [p for m in v.case.modules.values() for p in m.parameters()]
    saved = bench_probes.SavedPeakProbe(list(v.case.modules.values()), params)
    record, _ = v.step(bench, [bench_probes.StepTimeProbe(), bench_probes.RssProbe(), saved], step)
    saved.close()
    assert record.rss is not None
    return MemoryRecord(record.rss.peak_bytes, record.rss.growth_bytes, record.saved_peak_bytes)


def _variant_record(best: StepRecord, memory: MemoryRecord) -> VariantRecord:
    """A variant's figures on this rank: its fastest timed step's (the slowest rank's time) and ``memory``."""
    time = best.time if best.time is not None else StepTime(0.0, 0.0)
    parts = best.parts if best.parts is not None else PartsRecord(parts=StepParts(), slices=[])
    return VariantRecord(step_ms=time.slowest_s * 1e3, parts=parts.parts, slices=parts.slices, memory=memory)


def run(config: BenchConfig, repeats: int, rank: int, world: int, events: EventWriter) -> list[CaseRecord]:
    """The schedule benchmark on this rank (Note [schedule benchmark]): one record per variant, in
    :data:`VARIANTS`' order (:data:`COMPILED_VARIANTS`' with compiled stages), each with its exactness step
    (``steps[0]``, its numerics failures in ``failures``; with compiled stages, the regions its B calls split
    in ``steps[0].regions``) and its ``bench`` figures. Collective over the world group; raises what a step
    raised."""
    import ppbackward

    bench = _setup(config, rank, world)
    records = {}
    try:
        if config.compile:
            _compile_stages(bench, events)
        variants = [_Variant(s, placement, b, bench) for s, placement, b in config.variants]
        for v in variants:  # exactness first; each variant's first step is also its warm-up
            events.emit("case_start", case=v.name)
            check: list[runner.Probe] = [bench_probes.StepTimeProbe(), probes.NumericsProbe(v.case)]
            if config.compile:  # the regions each B split (Note [compiled schedule benchmark]), not a failure here
                check.append(probes.RegionsProbe(v.regions_expected(bench)))
            step, failures = v.step(bench, check, 0)
            failures = [f for f in failures if f.check != "regions"]
            records[v.name] = CaseRecord(
                id=v.name, schedule=v.schedule, model=bench.spec.name, status="fail" if failures else "pass",
                failures=failures, steps=[step], world_size=world, stages=v.stage_ids, num_stages=2 * world,
                n_microbatches=config.microbatches, metadata="static",
            )
        best = _timed(bench, variants, repeats, events)
        for v in variants:
            record = records[v.name]
            record.bench = _variant_record(best[v.name], _memory(bench, v, repeats + 1))
            events.emit("case_end", case=v.name, record=record)
    finally:
        ppbackward.uninstall()
    return [records[v.name] for v in variants]


# ----------------------------------------------------------------------------------------------------
# the launch


def _max(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def collect(verdicts: Sequence[Any], config: BenchConfig, repeats: int) -> ScheduleBench:
    """Every rank's variant records (``verdicts``: ``RankVerdict`` of ``--mode bench``, rank order) as one
    result: step times and memory reduced by maximum over the ranks, parts and slices kept per rank.

    Raises:
        ValueError: a rank without a variant's figures.
    """
    names = [variant_name(s, b) for s, _, b in config.variants]
    per: dict[str, list[CaseRecord]] = {n: [next(c for c in v.cases if c.id == n) for v in verdicts] for n in names}
    figures: dict[str, list[VariantRecord]] = {}
    for name, cases in per.items():
        found = [c.bench for c in cases if c.bench is not None]
        if len(found) != len(cases):
            raise ValueError(f"{name}: {len(cases) - len(found)} rank(s) without the variant's figures")
        figures[name] = found
    step_ms = {n: max(f.step_ms for f in figures[n]) for n in names}
    base = step_ms[names[0]]
    memory = {
        n: MemoryRecord(*(_max([getattr(f.memory, k) for f in figures[n]]) for k in
                          ("rss_peak_bytes", "rss_growth_bytes", "saved_peak_bytes")))
        for n in names
    }
    return ScheduleBench(
        ranks=len(verdicts), stages=2 * len(verdicts), layers_per_stage=config.layers_per_stage,
        d_model=config.d_model, seq=config.seq, microbatches=config.microbatches,
        microbatch_size=config.microbatch_size, repeats=repeats, variants=names, step_ms=step_ms,
        ratio_to_1f1b={n: t / base for n, t in step_ms.items()}, memory=memory,
        parts_ms={n: [f.parts for f in figures[n]] for n in names},
        slices_ms={n: [f.slices for f in figures[n]] for n in names},
        grads_match=all(c.status == "pass" for cases in per.values() for c in cases),
        compile=config.compile,
        regions=_regions(per) if config.compile else {},
    )


def _regions(per: dict[str, list[CaseRecord]]) -> dict[str, RegionsRecord]:
    """Per variant, the regions its exactness step's B calls split, summed over the ranks (variants without
    a B call, or not counted, are left out)."""
    out = {}
    for name, cases in per.items():
        summed = RegionsRecord.summed([c.steps[0].regions if c.steps else None for c in cases])
        if summed is not None and summed.b_calls and summed.counted:
            out[name] = summed
    return out


def run_schedule(
    repeats: int = 8, timeout_s: float = 300.0, nproc: int = 2, d_model: int = 128,
    out_dir: str | None = None, worker_args: Sequence[str] = (), compile: str = "",
) -> ScheduleBench:
    """Run the schedule benchmark under torchrun through the harness launcher and return its result.

    Args:
        repeats: timed steps per schedule variant.
        timeout_s: seconds without progress (a new event of any rank, once every rank has started) before
            every rank's stack is dumped and the launch killed (Note [hang clock] in
            ``ppbackward._tools.harness.launch``).
        nproc: ranks to start, all on this machine.
        d_model: width of every stage's encoder layers.
        out_dir: folder for the launch's logs, verdicts and events (default: a temporary one, deleted).
        worker_args: further worker options (tests: ``--hang-rank``).
        compile: a ``torch.compile`` backend for every layer (Note [compiled schedule benchmark]); ``""``: eager.

    Raises:
        ScheduleBenchError: a rank crashed, wrote no complete verdict, or the launch hung; the message
            has the command, what went wrong and every rank's log tail.
    """
    from ppbackward._tools.harness.launch import launch

    config = BenchConfig(d_model=d_model, compile=compile)
    args = [*config.worker_args(), "--repeats", str(repeats), *worker_args]
    with tempfile.TemporaryDirectory(prefix="ppbackward-bench-") as tmp:
        result = launch(nproc, args, out_dir or tmp, timeout=timeout_s)
        if not result.complete:
            raise ScheduleBenchError(f"schedule benchmark: {result.format_launch()}", result.command)
        return collect([result.verdicts[r] for r in range(nproc)], config, repeats)

