"""Private: the schedule matrix of the installed torch, with placement and microbatch rules.

Note [schedule placement]: a schedule places ``stages_per_rank`` stages on each of ``world_size`` ranks,
``num_stages = stages_per_rank * world_size`` in all.

* single-stage schedules (``ScheduleGPipe``, ``Schedule1F1B``): stage ``r`` on rank ``r``;
* loop style (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``, and
  torch 2.5's ``ScheduleFlexibleInterleaved1F1B``):
  rank ``r`` holds stages ``r, r + ws, r + 2 ws, ...``;
* V style (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``; exactly two stages per rank): rank ``r``
  holds stages ``r`` and ``2 ws - 1 - r``, so rank ``ws - 1`` holds two adjacent stages and passes
  activations and grads between them locally (torch's ``[Note: V-schedule special case]``).

Note [microbatch rules] (torch 2.13; each rule picks the smallest count >= 2 that the schedule accepts):
``Schedule1F1B`` needs ``n >= num_stages``; the interleaved and zero-bubble loop schedules need ``n`` to be
a multiple of ``max(1, n // ws)`` (``n = ws`` is; the same for 2.5's ``ScheduleFlexibleInterleaved1F1B``, whose
relaxed rule 2.6 folded into ``ScheduleInterleaved1F1B``); ``ScheduleDualPipeV`` needs ``n >= num_stages``;
``ScheduleZBVZeroBubble`` plans at least ``2 ws - 1`` microbatches and is given ``2 ws``. On torch 2.5
``ScheduleLoopedBFS`` gets ``n = ws``: its time-step plan with fewer microbatches than ranks runs a backward
before its grads have arrived (world size 4, ``n = 2``: "[4] for chunk 1 has gradients None", with torch's
own backward as with ppbackward).

Every class named ``Schedule*`` in ``torch.distributed.pipelining.schedules`` is discovered; one without a
rule here becomes a case that fails with "no placement rule" (so a new torch schedule cannot be silently
left out), and a rule whose class the installed torch lacks becomes a skip naming the releases that ship it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ppbackward._compat import torch_release

__all__ = ["RULES", "ScheduleCase", "ScheduleRule", "discover", "matrix"]


@dataclasses.dataclass(frozen=True)
class ScheduleRule:
    name: str
    stages_per_rank: int
    style: str  # "single" | "loop" | "v"
    microbatches: Callable[[int, int], int]  # (world_size, num_stages) -> n_microbatches
    split_backward: bool  # runs B and W separately (stage_backward_input / stage_backward_weight)
    since: str  # first torch release that shipped the class
    until: str | None = None  # last torch release that shipped it (None: still shipped)

    def releases(self) -> str:
        if self.until is None:
            return f"first shipped in {self.since}"
        if self.until == self.since:
            return f"shipped in {self.since} only"
        return f"shipped in {self.since}-{self.until}"


_TORCH_RELEASE = torch_release()[:2]
_TORCH_2_5 = _TORCH_RELEASE == (2, 5)

RULES: dict[str, ScheduleRule] = {
    rule.name: rule
    for rule in (
        ScheduleRule("ScheduleGPipe", 1, "single", lambda ws, ns: 2, False, "2.4"),
        ScheduleRule("Schedule1F1B", 1, "single", lambda ws, ns: ns, False, "2.4"),
        ScheduleRule("ScheduleInterleaved1F1B", 2, "loop", lambda ws, ns: ws, False, "2.4"),
        ScheduleRule("ScheduleLoopedBFS", 2, "loop", lambda ws, ns: ws if _TORCH_2_5 else 2, False, "2.4"),
        ScheduleRule("ScheduleInterleavedZeroBubble", 2, "loop", lambda ws, ns: ws, True, "2.5"),
        ScheduleRule("ScheduleFlexibleInterleaved1F1B", 2, "loop", lambda ws, ns: ws, False, "2.5", until="2.5"),
        ScheduleRule("ScheduleZBVZeroBubble", 2, "v", lambda ws, ns: 2 * ws, True, "2.6"),
        ScheduleRule("ScheduleDualPipeV", 2, "v", lambda ws, ns: ns, True, "2.8"),
    )
}


@dataclasses.dataclass(frozen=True)
class ScheduleCase:
    """One schedule at one world size. ``skip``: why it cannot run here; ``error``: why it is broken."""

    name: str
    world_size: int
    rule: ScheduleRule | None
    skip: str | None = None
    error: str | None = None
    microbatches: int = 0  # > 0: overrides the rule (the schedule's constructor validates it)

    @property
    def num_stages(self) -> int:
        assert self.rule is not None
        return self.rule.stages_per_rank * self.world_size

    @property
    def n_microbatches(self) -> int:
        assert self.rule is not None
        if self.microbatches > 0:
            return self.microbatches
        return self.rule.microbatches(self.world_size, self.num_stages)

    def stage_indices(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, in increasing order (see Note [schedule placement])."""
        assert self.rule is not None
        ws, per = self.world_size, self.rule.stages_per_rank
        if self.rule.style == "v":
            return sorted({rank, 2 * ws - 1 - rank})
        return [rank + k * ws for k in range(per)]

    def build(self, stages: list[Any], loss_fn: Callable[..., torch.Tensor]) -> Any:
        """Instantiate the schedule on this rank's ``stages`` (``PipelineStage`` objects).

        Grads are not scaled (``scale_grads=False``): the loss is sum-reduced.
        """
        cls = _schedule_module().__dict__[self.name]
        params = inspect.signature(cls.__init__).parameters
        kwargs: dict[str, Any] = {"loss_fn": loss_fn}
        if "scale_grads" in params:
            kwargs["scale_grads"] = False
        # else: torch < 2.6 has no grad scaling in its schedules at all
        first = stages[0] if self.rule is not None and self.rule.style == "single" else stages
        return cls(first, self.n_microbatches, **kwargs)


def _schedule_module() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules


def discover() -> list[str]:
    """Names of every concrete schedule class (``Schedule*``) in the installed torch."""
    mod = _schedule_module()
    base = getattr(mod, "_PipelineSchedule", object)
    names = []
    for name, obj in vars(mod).items():
        if (
            name.startswith("Schedule")
            and inspect.isclass(obj)
            and issubclass(obj, base)
            and not inspect.isabstract(obj)
        ):
            names.append(name)
    return sorted(names, key=lambda n: (list(RULES).index(n) if n in RULES else len(RULES), n))


def matrix(world_size: int, only: list[str] | None = None, microbatches: int = 0) -> list[ScheduleCase]:
    """Every schedule (known rules first, then unknown classes) at ``world_size``.

    ``only`` filters by class name; ``microbatches > 0`` replaces every rule's count (a count a schedule
    refuses makes that case fail with the schedule's own message).
    """
    found = discover()
    names = list(RULES) + [n for n in found if n not in RULES]
    cases = []
    for name in names:
        if only is not None and name not in only:
            continue
        rule = RULES.get(name)
        if rule is None:
            cases.append(ScheduleCase(name, world_size, None, error=f"no placement rule for {name}"))
        elif name not in found:
            cases.append(
                ScheduleCase(
                    name,
                    world_size,
                    rule,
                    skip=f"{name} is not in torch {torch.__version__} ({rule.releases()})",
                )
            )
        elif world_size == 1 and rule.stages_per_rank > 1 and _TORCH_RELEASE < (2, 12):
            cases.append(
                ScheduleCase(
                    name,
                    world_size,
                    rule,
                    skip=f"{name} needs 2 or more ranks on torch {torch.__version__}: its stages on one rank "
                    "exchange activations through P2P, and gloo cannot send to its own rank (torch 2.12+ "
                    "hands them over locally)",
                )
            )
        else:
            cases.append(ScheduleCase(name, world_size, rule, microbatches=microbatches))
    return cases
