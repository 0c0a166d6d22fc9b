"""Private: the bench's probes, what ``ppbackward bench --schedule`` measures around one schedule step.

Each is a :class:`~ppbackward._tools.harness.runner.Probe` (Note [probe phases] there) filling one field of
the step's ``StepRecord``; :mod:`ppbackward._tools.harness.schedule_bench` runs them (Note [schedule
benchmark] there):

* :class:`StepTimeProbe` — a barrier before the step, then the slowest rank's time of it (``time``); it
  goes first in a list, so that its barrier comes before the others start;
* :class:`PartsProbe` — where the step's time went on this rank (``parts``, Note [step parts]);
* :class:`RssProbe` — the RSS high-water mark of the step (``rss``);
* :class:`SavedPeakProbe` — the peak bytes of live saved activations (``saved_peak_bytes``).

The RSS probe reads ``/proc/self/status``: ``VmHWM``, reset by writing ``5`` to ``/proc/self/clear_refs``
after ``malloc_trim`` returned freed heap to the system, so that each step starts from the same floor.
The saved-activation probe takes, after each stage forward, weak references to the storages the new graph
saved (parameters excluded); saved tensors are only created by forwards here, so the largest sum seen
right after a forward is the peak. No saved-tensor hook is installed (it would change what ppbackward's B
does: Note [hooked saved tensors run once]).

Note [step parts]: where a step's time goes on each rank. While the parts probe is in place, every call
of the stages it was given is timed (``forward_one_chunk``: F; ``backward_one_chunk``: a full backward or
B, by its ``full_backward`` argument; ``backward_weight_one_chunk``: W), and so is every wait for a peer's
send or receive (torch's ``schedules._wait_batch_p2p``, called through, put back by :meth:`PartsProbe.close`;
about a microsecond per call). ``other`` is the step's rest on that rank: the schedule's own Python, posting
sends and receives, the loss. Against the replayed step (compute at the costs measured alone, sending free)
the parts say which share of a real step's excess is the split's cost (B + W against full), which is
waiting for a peer, and which is the runtime's. The bench keeps the parts of each variant's fastest timed
step.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import schedules as _schedules

from ppbackward._tools.harness.records import Failure, PartsRecord, RssRecord, StepParts, StepTime
from ppbackward._tools.harness.runner import Probe, StepRun
from ppbackward._tools.memory import alive_bytes, saved_storages

__all__ = ["PartsProbe", "RssProbe", "SavedPeakProbe", "StepTimeProbe"]


class StepTimeProbe(Probe):
    """A barrier on the world group just before the step (so that every rank starts it together, and no
    rank's sends of one schedule meet another's receives of the previous), then the step's time on the
    slowest rank (an all-reduce of this rank's seconds). List it first (Note [probe phases])."""

    field = "time"

    def __init__(self) -> None:
        self._slowest = 0.0

    def before(self, step: StepRun) -> None:
        dist.barrier()

    def after_step(self, step: StepRun) -> None:
        elapsed = torch.tensor([step.seconds], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        self._slowest = float(elapsed.item())

    def finish(self, step: StepRun) -> tuple[StepTime, list[Failure]]:
        return StepTime(own_s=step.seconds, slowest_s=self._slowest), []


_STAGE_CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class PartsProbe(Probe):
    """Where one step's time goes on this rank (Note [step parts]): from its making to :meth:`close`, every
    call of ``stages`` and every wait for a peer is timed, by kind, in ms, and kept as a slice."""

    field = "parts"
    KINDS = ("F", "full", "B", "W", "wait")

    def __init__(self, stages: Sequence[Any]) -> None:
        self._ms = dict.fromkeys(self.KINDS, 0.0)
        self._recorded: list[list[Any]] = []  # [kind, perf_counter() at the call, seconds, stage, microbatch]
        self._stages = list(stages)
        for stage in self._stages:
            index = stage.stage_index
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, lambda *a, **k: "F", index)
            stage.backward_one_chunk = self._timed(
                stage.backward_one_chunk, lambda *a, **k: "full" if k.get("full_backward", True) else "B", index
            )
            stage.backward_weight_one_chunk = self._timed(stage.backward_weight_one_chunk, lambda *a, **k: "W", index)
        self._wait = _schedules._wait_batch_p2p
        _schedules._wait_batch_p2p = self._timed(self._wait, lambda *a, **k: "wait", None)

    def _timed(self, fn: Callable[..., Any], kind_of: Callable[..., str], stage: int | None) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                kind = kind_of(*args, **kwargs)
                self._ms[kind] += (t1 - t0) * 1e3
                microbatch = args[0] if stage is not None and args and isinstance(args[0], int) else None
                self._recorded.append([kind, t0, t1 - t0, stage, microbatch])

        return timed

    def before(self, step: StepRun) -> None:
        self._ms = dict.fromkeys(self.KINDS, 0.0)
        self._recorded = []

    def finish(self, step: StepRun) -> tuple[PartsRecord, list[Failure]]:
        """The parts on this rank, ms, ``other`` the rest of its ``step.seconds``; each timed call of the
        step as a slice, its start from the step's (``step.start``, the runner's clock), rounded to the
        microsecond."""
        total = step.seconds * 1e3
        parts = StepParts(**{k: round(v, 3) for k, v in self._ms.items()},
                          other=round(total - sum(self._ms.values()), 3), step=round(total, 3))
        slices = [[k, round((t - step.start) * 1e3, 3), round(d * 1e3, 3), s, m] for k, t, d, s, m in self._recorded]
        return PartsRecord(parts, slices), []

    def close(self) -> None:
        _schedules._wait_batch_p2p = self._wait
        for stage in self._stages:  # the instance attributes go; the class's methods show again
            for name in _STAGE_CALLS:
                vars(stage).pop(name, None)


def _proc_status_kib(field: str) -> int | None:
    """``field`` of ``/proc/self/status`` in KiB; ``None`` where there is none."""
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


class RssProbe(Probe):
    """The step's RSS high-water mark and its growth over the RSS at the step's start (module docstring)."""

    field = "rss"

    def __init__(self) -> None:
        self._reset = False
        self._before: int | None = None
        self._peak: int | None = None

    def before(self, step: StepRun) -> None:
        self._reset = _reset_rss_peak()
        self._before = _proc_status_kib("VmRSS")

    def after_step(self, step: StepRun) -> None:
        self._peak = _proc_status_kib("VmHWM") if self._reset else None

    def finish(self, step: StepRun) -> tuple[RssRecord, list[Failure]]:
        peak, before = self._peak, self._before
        growth = None if peak is None or before is None else (peak - before) * 1024
        return RssRecord(None if peak is None else peak * 1024, growth), []


class SavedPeakProbe(Probe):
    """The peak bytes of live saved activations during the step, from forward hooks on ``modules``
    (``params`` excluded; module docstring)."""

    field = "saved_peak_bytes"

    def __init__(self, modules: Sequence[nn.Module], params: Sequence[torch.Tensor]) -> None:
        self.modules, self.params = modules, params
        self._storages: dict[int, Any] = {}
        self._peak = 0
        self._handles: list[Any] = []

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        outs = output if isinstance(output, tuple) else (output,)
        roots = [t.grad_fn for t in outs if isinstance(t, torch.Tensor)]
        self._storages = {k: v for k, v in self._storages.items() if v[0]() is not None}
        self._storages.update(saved_storages(roots, exclude=self.params))
        self._peak = max(self._peak, alive_bytes(self._storages))

    def before(self, step: StepRun) -> None:
        self._peak = 0
        self._handles = [m.register_forward_hook(self._after_forward) for m in self.modules]

    def after_step(self, step: StepRun) -> None:
        self.close()

    def finish(self, step: StepRun) -> tuple[int, list[Failure]]:
        return self._peak, []

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._storages.clear()
