"""Private: a harness-only workaround for torch < 2.8 schedules dropping P2P works (pytorch/pytorch#132644).

Note [dropped P2P works]: torch 2.5-2.7's ``schedules._batch_p2p`` returns only the *last* ``Work`` of
``dist.batch_isend_irecv`` (``.pop()``). NCCL coalesces a batch into one ``Work``; gloo returns one per op,
and a gloo ``Work`` dropped before it completes takes its pending send or receive with it, so any
schedule that batches two or more ops (every one but ``ScheduleGPipe``) hangs in ``recv`` on gloo, with
torch's own backward as with ppbackward. Upstream fixed it in pytorch/pytorch#152938 (first shipped in
2.8): ``_batch_p2p`` returns every ``Work`` and the schedules wait on each.

:func:`apply` replaces that ``_batch_p2p`` with one that keeps every ``Work`` and waits on all of them
behind the single ``.wait()`` the old callers make. It touches only communication: the stage, its
backward and the schedule's actions are torch's own, so the upstream-vs-ppbackward comparison stays
fair. It is applied by the torchrun worker (both backwards alike), never by ``ppbackward.install()``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DESCRIPTION", "ISSUE", "apply", "needed"]

ISSUE = "pytorch/pytorch#132644"
DESCRIPTION = (
    f"torch {torch.__version__}'s schedules drop all but one gloo P2P work per batch ({ISSUE}, fixed in 2.8); "
    "the harness keeps and waits on every one, for both backwards"
)


class _AllWorks:
    """Every ``Work`` of one ``batch_isend_irecv``; ``wait()`` waits on each (the old callers' one call)."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _batch_p2p_keeping_all(p2p_ops: list[Any], desc: str | None = None) -> _AllWorks | None:
    if not p2p_ops:
        return None
    return _AllWorks(dist.batch_isend_irecv(p2p_ops))


def needed(fn: Any = None) -> bool:
    """Whether ``fn`` (default: the installed ``schedules._batch_p2p``) drops all but one ``Work``.

    Read from its source (see the note); ``False`` without source or once :func:`apply` has run.
    """
    if fn is None:
        from torch.distributed.pipelining import schedules

        fn = getattr(schedules, "_batch_p2p", None)
    if fn is None or fn is _batch_p2p_keeping_all:
        return False
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "batch_isend_irecv(p2p_ops).pop()" in source.replace(" ", "")


def apply() -> bool:
    """Put in the fix if :func:`needed`; return whether it did. Process-wide, for the worker's lifetime."""
    if not needed():
        return False
    from torch.distributed.pipelining import schedules

    schedules._batch_p2p = _batch_p2p_keeping_all  # type: ignore[assignment]  # returns one handle, not a list
    return True
