"""One rank of the schedule benchmark: the step time and peak memory of three schedules, two backwards.

Private module, launched by :mod:`ppbackward._tools.bench.schedule` under torchrun (gloo, CPU, one thread
per rank). Note [schedule benchmark]: the model is ``2 * world`` stages, each a stack of encoder
layers (stage ``i`` built from seed ``100 + i``, so every schedule trains the same weights), fed
``microbatches`` microbatches per step. Every stage gets static metadata (``input_args`` /
``output_args``): no shape-inference forward, as a production run configures it. The variants are

* ``ScheduleInterleaved1F1B`` (full backward, the schedule zero-bubble exists to beat), with torch's
  ``stage_backward`` and with ppbackward's;
* ``ScheduleInterleavedZeroBubble`` (loop placement: this rank holds stages ``rank`` and
  ``rank + world``) and ``ScheduleZBVZeroBubble`` (V placement: ``rank`` and ``2 * world - 1 -
  rank``), each with torch's B/W (``ppbackward.uninstall()``), with ppbackward's
  (``ppbackward.install()``), and ``merged``: with ppbackward's, the schedule built while
  ``install(merge_bw=True)`` was on (each B directly followed by its own W one full backward: Note
  [merged B and W] in ``ppbackward._merge``).

After one warm-up step each, every repeat runs every variant once, in an order rotated by one per
repeat; a step's time is the slowest rank's; the figure is the minimum over repeats. Then one untimed
step per variant measures memory; the timed steps also record their parts (Note [step parts]). Memory:
the RSS high-water mark (``/proc/self/status`` ``VmHWM``, reset by writing ``5`` to
``/proc/self/clear_refs`` after ``malloc_trim`` returned freed heap to the system, so each variant
starts from the same floor) and the peak bytes of live saved activations (after each stage forward, weak
references to the storages the new graph saved, parameters excluded; saved tensors are only created by
forwards here, so the largest sum seen right after a forward is the peak). No saved-tensor hook is
installed (it would change what ppbackward's B does: Note [hooked saved tensors run once]). Exactness
comes first, with each variant's first (warm-up) step: ``ScheduleInterleaved1F1B`` under torch's
backward is the reference, its gradients gathered from every rank by global stage index (the V placement
puts on this rank a stage that the loop placement puts on another), and every other variant's gradients
are compared with it for every stage it holds; the verdict is reduced over ranks. Rank 0 writes the
result as JSON to ``--out``; every rank writes its pid to ``rank<r>.pid`` next to it, for the launcher
to kill it on a timeout (Note [killing a hung launch] in ``ppbackward._tools.torchrun``).

Note [step parts]: where a step's time goes on each rank, in the fastest timed step of each variant.
While the steps are timed, every call of this rank's stages is timed (``forward_one_chunk``: F;
``backward_one_chunk``: a full backward or B, by its ``full_backward`` argument;
``backward_weight_one_chunk``: W), and so is every wait for a peer's send or receive (torch's
``schedules._wait_batch_p2p``, called through, put back after; about a microsecond per call).
``other`` is the step's rest on that rank: the schedule's own Python, posting sends and receives, the
loss. Against the replayed step (compute at the costs measured alone, sending free) the parts say which
share of a real step's excess is the split's cost (B + W against full), which is waiting for a peer,
and which is the runtime's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules

import ppbackward
from ppbackward._tools.bench.timing import rotations
from ppbackward._tools.harness.models import build_stack
from ppbackward._tools.memory import alive_bytes, saved_storages

__all__: list[str] = []  # private module

# (schedule class name, stage placement, backward); the first, 1F1B with torch's backward over the loop
# placement (every stage on some rank), is the reference of the exactness check.
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


def variant_name(schedule: str, backward: str) -> str:
    return f"{schedule.removeprefix('Schedule')}/{backward}"


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _stage_ids(placement: str, rank: int, world: int) -> list[int]:
    return [rank, rank + world] if placement == "loop" else [rank, 2 * world - 1 - rank]


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    """Return freed heap to the system, then reset ``VmHWM`` to the current RSS; False where unsupported."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build_stages(
    modules: Mapping[int, nn.Module], stage_ids: Sequence[int], num_stages: int, shape: tuple[int, ...],
    device: torch.device,
) -> list[PipelineStage]:
    """A ``PipelineStage`` per index of ``stage_ids`` (of ``num_stages``), over ``modules[i]``, with static
    metadata: one input and one output of ``shape`` on ``device`` (no shape-inference forward). Shared
    with the one-rank step (``one_rank``)."""
    # a receive buffer requires grad only when its example does: every stage input but stage 0's
    return [
        PipelineStage(
            modules[i], i, num_stages, device,
            input_args=(torch.zeros(shape, device=device, requires_grad=i > 0),),
            output_args=(torch.zeros(shape, device=device, requires_grad=True),),
        )
        for i in stage_ids
    ]


def grads_close(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> bool:
    """The same parameters have grads in both, each close to the reference's (rtol 1e-4, atol 1e-5)."""
    return set(ref) == set(got) and all(torch.allclose(got[n], g, rtol=1e-4, atol=1e-5) for n, g in ref.items())


class _SavedPeak:
    """Forward hooks that track the peak bytes of live saved activations (module docstring)."""

    def __init__(self, modules: Sequence[nn.Module], params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.storages: dict[int, Any] = {}
        self.peak = 0
        self.handles = [m.register_forward_hook(self._after_forward) for m in modules]

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        roots = [t.grad_fn for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
        self.storages = {k: v for k, v in self.storages.items() if v[0]() is not None}
        self.storages.update(saved_storages(roots, exclude=self.params))
        self.peak = max(self.peak, alive_bytes(self.storages))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.storages.clear()


class _StepParts:
    """Where one step's time goes on this rank (Note [step parts]): while in place, every stage call and
    every wait for a peer is timed, by kind, in ms, and kept as a slice (the timeline of ``--trace``)."""

    KINDS = ("F", "full", "B", "W", "wait")

    def __init__(self, stages: Sequence[Any]) -> None:
        self.ms = dict.fromkeys(self.KINDS, 0.0)
        self.parts: dict[str, float] = {}
        self.slices: list[list] = []  # [kind, start ms from the step's start, ms, stage, microbatch]
        self._recorded: list[list] = []
        self._t0 = time.perf_counter()
        self._stages = list(stages)
        for stage in self._stages:
            fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
            index = stage.stage_index
            stage.forward_one_chunk = self._timed(fwd, lambda *a, **k: "F", index)
            stage.backward_one_chunk = self._timed(
                bwd, lambda *a, **k: "full" if k.get("full_backward", True) else "B", index
            )
            stage.backward_weight_one_chunk = self._timed(wgt, lambda *a, **k: "W", index)
        self._wait = _schedules._wait_batch_p2p
        _schedules._wait_batch_p2p = self._timed(self._wait, lambda *a, **k: "wait", None)

    def _timed(self, fn: Any, kind_of: Any, stage: int | None) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                kind = kind_of(*args, **kwargs)
                self.ms[kind] += (t1 - t0) * 1e3
                microbatch = args[0] if stage is not None and args and isinstance(args[0], int) else None
                self._recorded.append([kind, (t0 - self._t0) * 1e3, (t1 - t0) * 1e3, stage, microbatch])

        return timed

    def reset(self) -> None:
        self.ms = dict.fromkeys(self.KINDS, 0.0)
        self._recorded = []
        self._t0 = time.perf_counter()

    def finish(self, own_s: float) -> None:
        """``parts``: the step's parts on this rank, ms, ``other`` the rest of its ``own_s`` seconds;
        ``slices``: each timed call of the step, rounded to the microsecond."""
        step = own_s * 1e3
        parts = {**self.ms, "other": step - sum(self.ms.values()), "step": step}
        self.parts = {k: round(v, 3) for k, v in parts.items()}
        self.slices = [[k, round(t, 3), round(d, 3), s, m] for k, t, d, s, m in self._recorded]

    def remove(self) -> None:
        _schedules._wait_batch_p2p = self._wait
        for stage in self._stages:  # the instance attributes go; the class's methods show again
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                vars(stage).pop(name, None)


class _Variant:
    """One schedule over this rank's stages, with the backward it runs under."""

    def __init__(
        self, schedule: str, stage_ids: list[int], backward: str, modules: Mapping[int, nn.Module], args: Any
    ) -> None:
        shape = (args.microbatch_size, args.seq, args.d_model)
        stages = build_stages(modules, stage_ids, 2 * dist.get_world_size(), shape, torch.device("cpu"))
        self.stages = stages
        self.name = variant_name(schedule, backward)
        self.backward = backward
        self.stage_ids = list(stage_ids)
        self.modules = [modules[i] for i in stage_ids]
        self.params = [q for m in self.modules for q in m.parameters()]
        merge = contextlib.nullcontext() if backward != "merged" else ppbackward.installed(merge_bw=True)
        with merge:  # a schedule lowers its action list when it is built
            self.schedule = getattr(_schedules, schedule)(
                stages, n_microbatches=args.microbatches, loss_fn=mse_loss, scale_grads=False
            )

    def step(self, x: torch.Tensor, target: torch.Tensor, timer: _StepParts | None = None) -> float:
        """One step; its time in seconds on the slowest rank. ``timer``: reset first, and left holding this
        rank's parts of the step (Note [step parts])."""
        (ppbackward.uninstall if self.backward == "upstream" else ppbackward.install)()
        for q in self.params:
            q.grad = None
        dist.barrier()
        if timer is not None:
            timer.reset()
        t0 = time.perf_counter()
        self.schedule.step(x, target=target, losses=[])
        own = time.perf_counter() - t0
        if timer is not None:
            timer.finish(own)
        elapsed = torch.tensor([own], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())

    def memory(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, int | None]:
        """One untimed step: peak RSS (bytes), its growth over the step's start, peak live saved bytes."""
        tracker = _SavedPeak(self.modules, self.params)
        try:
            ok = _reset_rss_peak()
            before = _proc_status_kib("VmRSS")
            self.step(x, target)
            peak = _proc_status_kib("VmHWM") if ok else None
        finally:
            tracker.remove()
        return {
            "rss_peak_bytes": None if peak is None else peak * 1024,
            "rss_growth_bytes": None if peak is None or before is None else (peak - before) * 1024,
            "saved_peak_bytes": tracker.peak,
        }


def param_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: grad}`` of the parameters of ``module`` that have a grad."""
    return {n: q.grad for n, q in module.named_parameters() if q.grad is not None}


def _reference_grads(reference: _Variant) -> dict[int, dict[str, torch.Tensor]]:
    """``{global stage index: grads}`` of every stage, from whichever rank ``reference`` holds it on
    (after its step; copied, every rank gets all of them)."""
    held = zip(reference.stage_ids, reference.modules)
    mine = {i: {n: g.clone() for n, g in param_grads(m).items()} for i, m in held}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {i: grads for part in gathered for i, grads in part.items()}


def _reduce_max(values: dict[str, int | None]) -> dict[str, int | None]:
    keys = sorted(values)
    t = torch.tensor([-1 if values[k] is None else values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: None if v < 0 else int(v) for k, v in zip(keys, t.tolist())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers-per-stage", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args(argv)
    pid_file = Path(args.out).parent / f"rank{os.environ.get('RANK', '0')}.pid"
    pid_file.write_text(str(os.getpid()))  # Note [killing a hung launch] in ppbackward._tools.torchrun

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return _run(args)
    finally:
        ppbackward.uninstall()
        dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = sorted({i for _, placement, _ in VARIANTS for i in _stage_ids(placement, rank, world)})
    modules = {i: build_stack(args.layers_per_stage, args.d_model, seed=100 + i) for i in ids}
    variants = [_Variant(s, _stage_ids(pl, rank, world), b, modules, args) for s, pl, b in VARIANTS]
    gen = torch.Generator().manual_seed(7)
    batch = args.microbatches * args.microbatch_size
    x = torch.randn(batch, args.seq, args.d_model, generator=gen)
    target = torch.randn(batch, args.seq, args.d_model, generator=gen)

    # Exactness first: every variant's grads against 1F1B with torch's backward, for every stage it holds
    # (by global stage index: the reference may have run that stage on another rank).
    first, *others = variants  # each step below is also the variant's warm-up
    first.step(x, target)
    reference = _reference_grads(first)
    match = True
    for v in others:
        v.step(x, target)
        for i, m in zip(v.stage_ids, v.modules):
            match = match and grads_close(param_grads(m), reference[i])
    verdict = torch.tensor([1 if match else 0])
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)

    best = {v.name: float("inf") for v in variants}
    mine: dict[str, dict[str, float]] = {}  # this rank's parts of each variant's fastest step
    slices: dict[str, list] = {}  # and its timeline
    timer = _StepParts([st for v in variants for st in v.stages])
    try:
        for order in rotations(tuple(variants), args.repeats):
            for v in order:
                elapsed = v.step(x, target, timer)
                if elapsed < best[v.name]:
                    best[v.name], mine[v.name], slices[v.name] = elapsed, timer.parts, timer.slices
    finally:
        timer.remove()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine, slices))
    parts = {v.name: [g[0][v.name] for g in gathered] for v in variants}
    timelines = {v.name: [g[1][v.name] for g in gathered] for v in variants}
    memory = {v.name: _reduce_max(v.memory(x, target)) for v in variants}
    base = best[variant_name("ScheduleInterleaved1F1B", "upstream")]
    if rank == 0:
        result = {
            "ranks": world,
            "stages": 2 * world,
            "layers_per_stage": args.layers_per_stage,
            "d_model": args.d_model,
            "seq": args.seq,
            "microbatches": args.microbatches,
            "microbatch_size": args.microbatch_size,
            "repeats": args.repeats,
            "variants": [variant_name(s, b) for s, _, b in VARIANTS],
            "step_ms": {k: t * 1e3 for k, t in best.items()},
            "ratio_to_1f1b": {k: t / base for k, t in best.items()},
            "memory": memory,
            "parts_ms": parts,
            "slices_ms": timelines,
            "grads_match": bool(verdict.item()),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
