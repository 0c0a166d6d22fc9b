"""The one-rank step: every stage of a pipeline on one rank, torch's schedules timed in this process.

Private module (issue 22, ``ppbackward bench --split --one-rank-step``). Note [one-rank step]: a
world-1 process group (gloo; nccl on CUDA where torch has it) is set up in this process for the step
and destroyed after it (its store lives in a temporary directory, removed with it); a default group
already initialised is refused rather than replaced. The model is :data:`STAGES` stages, each a stack
of encoder layers (stage ``i`` built from seed ``100 + i``, as in the torchrun benchmark, Note
[schedule benchmark] in ``ppbackward._tools.harness.schedule_bench``), all on this rank: the loop placement and the V
placement both put stages 0 and 1 here (ZBVZeroBubble needs exactly two stages per rank), and torch's
runtime passes each stage's output to the next stage locally, so the step has no communication and no
bubble at all. What it measures is therefore the runtime's own work and the B/W split's overhead, not
what the split buys in a bubble: on one rank a zero-bubble schedule can only be slower than
Interleaved1F1B, by what its split costs.

The variants (:data:`VARIANTS`) are Interleaved1F1B with torch's backward (the reference) and with
ppbackward's, and InterleavedZeroBubble and ZBVZeroBubble with torch's B/W (``ppbackward.uninstall()``),
with ppbackward's (``ppbackward.install()``) and merged (built while ``ppbackward.install(merge_bw=True)``
is on: Note [merged B and W] in ``ppbackward._merge``; on one rank every W directly follows its own B,
so every pair is merged). Each is built once and stepped once untimed; that first step's grads are
compared with the reference's (``schedule_bench.grads_close``). A variant that torch refuses to build
(e.g. DualPipeV with fewer microbatches than stages), or whose first step raises under torch's own
backward, is recorded as skipped with the message; a first step that raises under ppbackward's backward
(``ppbackward`` or ``merged``) is an error, as is any failure of the reference. Then every repeat
steps every variant once, in an order rotated by one per repeat (Note [interleaved repeats] in
``timing``), the gc off within a repeat; the figure is the minimum over repeats, timed with a clock
that waits for the device (``timing.device_clock``). On CUDA, each step's peak is
``torch.cuda.max_memory_allocated`` (reset before the step); ``None`` on CPU. The installed state of
ppbackward found at the start is put back at the end.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import schedules as _schedules

import ppbackward
from ppbackward._install import merge_bw_enabled
from ppbackward._tools.bench.timing import device_clock, gc_paused, one_torch_thread
from ppbackward._tools.harness.actions import count_compute
from ppbackward._tools.harness.models import build_stack
from ppbackward._tools.harness.schedule_bench import build_stages, grads_close, mse_loss, param_grads, variant_name
from ppbackward._tools.repeats import rotations

__all__ = [  # private module: what other modules use
    "QUICK",
    "STAGES",
    "VARIANTS",
    "OneRankConfig",
    "format_one_rank",
    "measure",
]

STAGES = 2  # ZBVZeroBubble's V placement: exactly two stages per rank
REFERENCE = ("ScheduleInterleaved1F1B", "upstream")
# (schedule class name, backward); the first is the reference of the exactness check and of the ratios.
VARIANTS = (
    REFERENCE,
    ("ScheduleInterleaved1F1B", "ppbackward"),
    ("ScheduleInterleavedZeroBubble", "upstream"),
    ("ScheduleInterleavedZeroBubble", "ppbackward"),
    ("ScheduleInterleavedZeroBubble", "merged"),
    ("ScheduleZBVZeroBubble", "upstream"),
    ("ScheduleZBVZeroBubble", "ppbackward"),
    ("ScheduleZBVZeroBubble", "merged"),
)


class OneRankConfig(NamedTuple):
    """The one-rank step's model and repeats: :data:`STAGES` stages of ``layers_per_stage`` encoder layers
    (``d_model``, ``seq``), ``microbatches`` microbatches of ``microbatch_size`` per step."""

    layers_per_stage: int = 4
    d_model: int = 128
    seq: int = 16
    microbatches: int = 8
    microbatch_size: int = 2
    repeats: int = 8


DEFAULT = OneRankConfig()
QUICK = OneRankConfig(layers_per_stage=2, d_model=32, seq=8, microbatches=4, repeats=2)


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[str]:
    """A world-1 default process group for the block (yields its backend), destroyed after it.

    Raises:
        RuntimeError: a default process group is already initialised (it is left as it is).
    """
    if dist.is_initialized():
        raise RuntimeError(
            "one-rank step: a default process group is already initialised "
            f"(world {dist.get_world_size()}); run it in a process without one"
        )
    backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    with tempfile.TemporaryDirectory(prefix="ppbackward-one-rank-") as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield backend
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def _install_state_kept() -> Iterator[None]:
    """Put back whether ppbackward is installed, and its ``merge_bw``, as found."""
    was_installed, was_merging = ppbackward.is_installed(), merge_bw_enabled()
    try:
        yield
    finally:
        if was_installed:
            ppbackward.install(merge_bw=was_merging)
        else:
            ppbackward.uninstall()


class _Variant:
    """One schedule over all :data:`STAGES` stages on this rank, with the backward its steps run under."""

    def __init__(
        self, schedule: str, backward: str, modules: Sequence[nn.Module], cfg: OneRankConfig, device: torch.device
    ) -> None:
        self.name = variant_name(schedule, backward)
        self.backward = backward
        self.modules = list(modules)
        self.params = [q for m in self.modules for q in m.parameters()]
        self.device = device
        self.peak_bytes: int | None = None
        shape = (cfg.microbatch_size, cfg.seq, cfg.d_model)
        stages = build_stages(dict(enumerate(modules)), range(STAGES), STAGES, shape, device)
        merge = ppbackward.installed(merge_bw=True) if backward == "merged" else contextlib.nullcontext()
        with merge:  # the switch only matters while the schedule is built (it lowers its actions then)
            self.schedule = getattr(_schedules, schedule)(
                stages, n_microbatches=cfg.microbatches, loss_fn=mse_loss, scale_grads=False
            )

    def step(self, x: torch.Tensor, target: torch.Tensor) -> float:
        """One schedule step from grads ``None``; returns its seconds (device work included)."""
        (ppbackward.uninstall if self.backward == "upstream" else ppbackward.install)()
        for q in self.params:
            q.grad = None
        cuda = self.device.type == "cuda"
        clock = device_clock(self.device)
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = clock()
        self.schedule.step(x, target=target, losses=[])
        elapsed = clock() - t0
        if cuda:
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        return elapsed

    def backward_actions(self) -> dict[str, int]:
        """How many B, W and full backward actions this rank's lowered action list runs per step."""
        counts = count_compute(self.schedule.pipeline_order_with_comms[0])
        return {"B": counts["I"], "W": counts["W"], "full": counts["B"]}


def _message(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()}"


def _first_steps(
    modules: Sequence[nn.Module], cfg: OneRankConfig, device: torch.device, x: torch.Tensor, target: torch.Tensor
) -> tuple[list[_Variant], dict[str, bool], dict[str, str]]:
    """Build and step each variant once; returns those that ran, each one's grads verdict against the
    reference's, and ``{name: torch's message}`` of those skipped."""
    ran: list[_Variant] = []
    match: dict[str, bool] = {}
    skipped: dict[str, str] = {}
    reference: list[dict[str, torch.Tensor]] = []
    for schedule, backward in VARIANTS:
        name = variant_name(schedule, backward)
        built = False
        try:
            v = _Variant(schedule, backward, modules, cfg, device)
            built = True
            v.step(x, target)
        except Exception as e:  # a schedule torch cannot build, or torch's backward cannot run: reported
            if (schedule, backward) == REFERENCE:
                raise RuntimeError(f"one-rank step: the reference {name} did not run: {_message(e)}") from e
            if built and backward != "upstream":  # ppbackward's backward failed: never a skip
                raise RuntimeError(f"one-rank step: {name}'s first step raised: {_message(e)}") from e
            skipped[name] = _message(e)
            continue
        grads = [param_grads(m) for m in modules]
        if not reference:
            reference = [{n: g.clone() for n, g in gs.items()} for gs in grads]
        match[name] = all(grads_close(got, ref) for got, ref in zip(grads, reference))
        ran.append(v)
    return ran, match, skipped


def measure(cfg: OneRankConfig = DEFAULT, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The one-rank step (Note [one-rank step]) on ``device``: per variant the minimum step time over
    ``cfg.repeats`` (ms), its ratio to Interleaved1F1B with torch's backward, the CUDA peak (bytes; None
    on CPU), the lowered B/W/full backward counts and the grads verdict; torch's thread count at 1.

    Raises:
        RuntimeError: a default process group already exists, the reference variant did not run, or
            the first step of a variant under ppbackward's backward raised (the message names it).
    """
    device = torch.device(device)
    with one_torch_thread(), _install_state_kept(), world_of_one(device) as backend:
        return {"backend": backend, **_measure(cfg, device)}


def _measure(cfg: OneRankConfig, device: torch.device) -> dict[str, Any]:
    modules = [build_stack(cfg.layers_per_stage, cfg.d_model, seed=100 + i).to(device) for i in range(STAGES)]
    gen = torch.Generator().manual_seed(7)
    shape = (cfg.microbatches * cfg.microbatch_size, cfg.seq, cfg.d_model)
    x = torch.randn(shape, generator=gen).to(device)
    target = torch.randn(shape, generator=gen).to(device)
    variants, match, skipped = _first_steps(modules, cfg, device, x, target)
    best = {v.name: float("inf") for v in variants}
    peak: dict[str, int | None] = {v.name: None for v in variants}
    for order in rotations(tuple(variants), cfg.repeats):
        with gc_paused():
            for v in order:
                best[v.name] = min(best[v.name], v.step(x, target))
                if v.peak_bytes is not None:
                    peak[v.name] = max(peak[v.name] or 0, v.peak_bytes)
    base = best[variant_name(*REFERENCE)]
    return {
        "device": str(device),
        "ranks": 1,
        "stages": STAGES,
        **cfg._asdict(),
        "variants": [v.name for v in variants],
        "step_ms": {k: t * 1e3 for k, t in best.items()},
        "ratio_to_1f1b": {k: t / base for k, t in best.items()},
        "peak_bytes": peak,
        "backward_actions": {v.name: v.backward_actions() for v in variants},
        "grads_match_by_variant": match,
        "grads_match": all(match.values()),
        "skipped": skipped,
    }


def format_one_rank(result: dict[str, Any]) -> str:
    """The one-rank step as a table: per variant ms, ratio to Interleaved1F1B/upstream, CUDA peak (MiB),
    the lowered backward actions and the grads verdict; then the skipped variants with torch's message."""
    from ppbackward._tools.text_table import format_table

    if "error" in result:
        return f"\nOne-rank step: ERROR\n{result['error']}"
    rows = []
    for name in result["variants"]:
        peak = result["peak_bytes"][name]
        acts = result["backward_actions"][name]
        rows.append([
            name, f"{result['step_ms'][name]:.1f}", f"{result['ratio_to_1f1b'][name]:.2f}x",
            "-" if peak is None else f"{peak / 2**20:.1f}", f"{acts['B']}/{acts['W']}/{acts['full']}",
            "yes" if result["grads_match_by_variant"][name] else "NO",
        ])
    rows += [[name, f"skipped: {(why.splitlines() or [''])[0]}"] for name, why in result["skipped"].items()]
    return (
        f"\nOne-rank step ({result['device']}, {result['backend']}, world 1: {result['stages']} stages x "
        f"{result['layers_per_stage']} layers d {result['d_model']} s {result['seq']}, {result['microbatches']} "
        f"microbatches of {result['microbatch_size']}, min of {result['repeats']}; no communication, no bubble: "
        "the runtime's and the split's overhead; ratio to Interleaved1F1B/upstream)\n"
        + format_table(
            ["variant", "step ms", "vs 1F1B", "CUDA peak MiB", "B/W/full per step", "grads match"], rows, left=1
        )
    )
