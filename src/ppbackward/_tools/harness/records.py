"""Private: typed views of what a harness worker writes (``rank<r>.json``) and ``ppbackward check`` reads.

The worker writes JSON (``ppbackward._tools.harness.worker``: a verdict with one record per case, each with one
record per measured step); the check reads the measures it tabulates through :class:`StepMeasures`, one
field per column, instead of string keys spread over the table code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["StepMeasures"]


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
    """

    step: int
    seconds: float
    garbage: int
    bytes_freed_only_by_gc: int
    bytes_held_after_gc: int
    max_abs_grad_err: float
    hooks_fired: int
    hooks_expected: int

    @classmethod
    def from_record(cls, step: dict[str, Any]) -> StepMeasures:
        """The measures of a worker's step record (``cases[i].steps[j]`` of ``rank<r>.json``)."""
        return cls(
            step=step["step"],
            seconds=step["seconds"],
            garbage=step["garbage"]["tensors"] + step["garbage"]["nodes"],
            bytes_freed_only_by_gc=step["lifetime"]["bytes_freed_only_by_gc"],
            bytes_held_after_gc=step["lifetime"]["bytes_held_after_gc"],
            max_abs_grad_err=step["numerics"]["max_abs_grad_err"],
            hooks_fired=step["hooks"]["fired"],
            hooks_expected=step["hooks"]["expected"],
        )
