"""Private: what kind of compute each action of a rank's schedule is, and how many of each it runs.

Measurement only (the check's ``lowered`` / ``planned`` counts, the bench's one-rank step and replay);
the library's merge (``ppbackward._merge``) does not need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["COMPUTE_KINDS", "compute_kind", "count_compute"]

# torch's _ComputationType names of compute actions -> the letters torch's action lists print them as
# (communication, unsharding and grad reduction are not compute)
COMPUTE_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def compute_kind(action: Any) -> str | None:
    """``"F"``, ``"B"`` (full backward), ``"I"`` (B: input grads) or ``"W"`` of one torch ``_Action``;
    ``None`` for an idle slot or an action that is not compute."""
    if action is None:
        return None
    return COMPUTE_KINDS.get(getattr(action.computation_type, "name", ""))


def count_compute(actions: Sequence[Any]) -> dict[str, int]:
    """How many of each compute kind (:func:`compute_kind`) one rank's action list runs: every key of
    ``F``, ``B``, ``I``, ``W`` present, 0 where none. Top-level actions only (an ``OVERLAP_F_B`` is not
    compute itself and its sub-actions are not counted)."""
    counts = dict.fromkeys(COMPUTE_KINDS.values(), 0)
    for action in actions:
        kind = compute_kind(action)
        if kind:
            counts[kind] += 1
    return counts
