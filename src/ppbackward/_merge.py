"""Run a B and the W that directly follows it as one full backward (opt-in).

Private module; the switch is ``ppbackward.install(merge_bw=True)`` (and ``python -m ppbackward.run
--merge-bw``). Note [merged B and W]: a zero-bubble schedule splits each backward into B (input grads,
``BACKWARD_INPUT``) and W (weight grads, ``BACKWARD_WEIGHT``) so that W can fill a bubble later. Where a
rank's compute order runs W right after its own B (same stage, same microbatch, nothing but idle slots
between), the split buys nothing: no other work runs between them, and the pair costs more than one
full backward (docs/performance.md measures by how much). :func:`merge_actions` turns each such pair into
one ``FULL_BACKWARD`` action in the compute-only action list; torch's own lowering then places the
sends, receives, unshards, reshards and grad reductions around it as it does for any full backward. This
is what torch's unused ``schedules._merge_bw`` describes; the code here is ppbackward's own.

What changes for a step, and what does not:

* every (stage, microbatch) still runs its forward once and its backward once; gradients are those of a
  full backward, which ppbackward computes exactly as its B + W (both equal plain autograd);
* the merged pair's input gradient is sent after the pair's weight gradients were computed (a W later
  than a split B would send it): the downstream rank may wait that long;
* parameter hooks (post-accumulate-grad hooks, DDP's and FSDP2's reduce hooks) run in the full
  backward, when a full-backward schedule runs them;
* the runtime's count of finished backwards per stage (which decides the last backward, and so when DDP
  and FSDP2 reduce) counts a full backward as it counts a W, so the last backward is unchanged;
* the schedule's compute-only ``pipeline_order`` is left as torch planned it; what runs is
  ``pipeline_order_with_comms``, lowered from the merged list, and it stays merged after ``uninstall()``;
* a function registered with ``register_custom_function`` for ``BACKWARD_INPUT`` or ``BACKWARD_WEIGHT``
  does not see a merged pair: the runtime looks up the one for ``FULL_BACKWARD`` (registration comes
  after the lowering, so the merge cannot know of it);
* torch checks the caller's list before it is merged, so its errors name the caller's own positions.

Only schedules built on torch's ``_PipelineScheduleRuntime`` (the ones that lower a compute-only list:
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV`` on torch 2.10+; only
``ScheduleDualPipeV`` on 2.9; 2.5-2.8 have no such lowering, see docs/compatibility.md) are
merged, and only when their compute-only list is lowered (at construction, or by ``_load_csv`` /
``_prepare_schedule_with_comms``) while the switch is on; a schedule that runs its time steps in
lock step (``PipelineScheduleMulti`` without a lowering) is left as it is, since moving one rank's
action would change which peer action it meets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

# private module (the switch is ppbackward.install(merge_bw=True)): what other modules use
__all__ = ["lowering", "merge_actions", "merging"]


def _schedules() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules


def merge_actions(actions: Sequence[Any]) -> tuple[list[Any], int]:
    """One rank's compute-only action list with every B directly followed by its own W made one full backward.

    Args:
        actions: torch ``_Action`` records (``stage_index``, ``computation_type``, ``microbatch_index``)
            and ``None`` idle slots, in the rank's compute order. "Directly followed" skips idle slots
            only; an action with ``sub_actions`` (``OVERLAP_F_B``) is never merged into.

    Returns:
        ``(merged list, number of pairs merged)``. The B's slot becomes a ``FULL_BACKWARD`` action of
        the same stage and microbatch; the W is dropped; idle slots and every other action keep their
        order (Note [merged B and W]).
    """
    s = _schedules()
    out: list[Any] = []
    merged = 0
    skip: int | None = None
    for i, action in enumerate(actions):
        if i == skip:
            continue
        nxt = next((j for j in range(i + 1, len(actions)) if actions[j] is not None), None)
        if (
            action is not None
            and action.computation_type == s.BACKWARD_INPUT
            and nxt is not None
            and _is_own_w(actions[nxt], action, s.BACKWARD_WEIGHT)
        ):
            out.append(action._replace(computation_type=s.FULL_BACKWARD))
            merged += 1
            skip = nxt
            continue
        out.append(action)
    return out, merged


def _is_own_w(candidate: Any, b: Any, weight_type: Any) -> bool:
    return (
        candidate.computation_type == weight_type
        and getattr(candidate, "sub_actions", None) is None
        and candidate.stage_index == b.stage_index
        and candidate.microbatch_index == b.microbatch_index
    )


def lowering() -> tuple[type, Callable[..., Any]]:
    """``(torch's _PipelineScheduleRuntime, its _prepare_schedule_with_comms)``, the method the switch wraps.

    Raises:
        ppbackward.UnsupportedTorchError: (a ``RuntimeError``) the installed torch has no such class or
            method (torch 2.5-2.8; 2.5's runtime lowers with ``_load_actions``); the message names which, and the
            version. ``python -m ppbackward.run --merge-bw`` and ``ppbackward check --merge-bw`` refuse
            such a torch with it before starting anything.
    """
    s = _schedules()
    cls = getattr(s, "_PipelineScheduleRuntime", None)
    method = getattr(cls, "_prepare_schedule_with_comms", None) if cls is not None else None
    if cls is None or method is None:
        import torch

        from ppbackward._compat import UnsupportedTorchError

        missing = "_PipelineScheduleRuntime" if cls is None else "_PipelineScheduleRuntime._prepare_schedule_with_comms"
        raise UnsupportedTorchError(
            f"merge_bw: torch {torch.__version__}'s pipelining/schedules.py has no {missing}; cannot merge B and W "
            "(install() without merge_bw is unaffected)"
        )
    return cls, method


def merging(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (torch's ``_prepare_schedule_with_comms``) with every rank's compute-only list merged
    first (:func:`merge_actions`); a ``compute_comms`` list passes untouched.

    torch lowers the caller's own list first, so that a list it refuses raises torch's error naming the
    caller's actions and positions (a merged list is shorter, and names full backwards the caller never
    wrote); only a list it accepts is merged and lowered again (lowering runs once per schedule, when it
    is built or loads a CSV, and is cheap next to a step).
    """

    @functools.wraps(original)
    def prepare(self: Any, actions: dict[int, list[Any]], format: str = "compute_only") -> Any:
        result = original(self, actions, format)  # torch's checks, on the caller's list
        if format != "compute_only":
            return result
        merged = {rank: merge_actions(acts) for rank, acts in actions.items()}
        if not any(n for _, n in merged.values()):
            return result
        return original(self, {rank: acts for rank, (acts, _) in merged.items()}, format)

    prepare.__ppbackward_merging__ = True  # type: ignore[attr-defined]
    return prepare
