"""The errors ppbackward's stage backward raises for a bad call, before anything runs.

Public name (re-exported by ``ppbackward``): :class:`StageBackwardError`.

Note [errors are RuntimeErrors]: torch's ``stage_backward*`` functions wrap every failure in a
``RuntimeError("Failed to run stage backward ...")``, so a caller written for torch catches
``RuntimeError``. ppbackward names the bad argument and its path instead (``stage_output[1]['h']:
grad shape (3, 4) != output shape (3, 5)``) and raises it before running anything; the error is a
:class:`StageBackwardError`, which is a ``RuntimeError`` (so that such a caller still catches it) and
also a ``ValueError`` or ``TypeError`` as the mistake is one of value or of type. Where torch raises a
bare ``AssertionError`` instead (torch 2.15's B, for a ``GradientEdge`` output without output gradients),
the error is also an ``AssertionError`` (:class:`BadAssertion`), so that code written for that torch
catches it as it did.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = [
    "BadAssertion", "BadIndex", "BadType", "BadValue", "StageBackwardError", "backpropagated_before", "nan_output"
]


class StageBackwardError(RuntimeError):
    """A bad call of ``stage_backward``, ``stage_backward_input`` or ``stage_backward_weight``: raised
    before anything runs; the message names what is wrong and where. Also a ``ValueError`` or
    ``TypeError`` where the mistake is one of value or type (Note [errors are RuntimeErrors])."""


class BadValue(StageBackwardError, ValueError):
    """A value that does not fit: a shape, a structure, a missing gradient, other weights."""


class BadType(StageBackwardError, TypeError):
    """An argument of the wrong type: a gradient that is not a tensor, a dtype, ``param_groups``."""


class BadAssertion(BadValue, AssertionError):
    """A bad value torch's own function refuses with a bare ``AssertionError`` (not wrapped in its
    ``RuntimeError``): a ``GradientEdge`` output without output gradients (torch 2.15's B). Also an
    ``AssertionError``, so that code written for torch catches it as it did."""


class BadIndex(StageBackwardError, IndexError):
    """An index out of range (``outputs_with_grads_idxs``): an ``IndexError``, as torch's own indexing raises."""


def nan_output(node: Any, index: int) -> RuntimeError:
    """What the engine raises under anomaly mode for a node whose output ``index`` holds a NaN, after
    warning with the forward traceback it recorded (Note [anomaly mode names W's nodes] in
    ``ppbackward._weight_edges``): for the nodes W runs itself."""
    trace = node.metadata.get("traceback_")
    if trace:
        warnings.warn(
            f"Error detected in {node.name()}. Traceback of forward call that caused the error:\n" + "".join(trace),
            stacklevel=3,
        )
    return RuntimeError(f"Function '{node.name()}' returned nan values in its {index}th output.")


_NOTHING_RUN = "Nothing was run: if an earlier B returned, its W is intact"


def backpropagated_before(by: str, seen: str, outcome: str = _NOTHING_RUN) -> StageBackwardError:
    """B's refusal of outputs whose graph an earlier backward already ran (Note [B claims its outputs] in
    ``ppbackward.backward``): ``by`` names the earlier call, ``seen`` what showed it (naming the node), ``outcome``
    what this B ran and left."""
    return StageBackwardError(
        f"stage_outputs_or_loss: the graph of these outputs was already backpropagated by an earlier {by} ({seen}), "
        "or by a B that failed part-way (an exception from a hook: what it ran is freed, so run that microbatch's "
        f"forward again); a microbatch's outputs go through backward once. {outcome}"
    )
