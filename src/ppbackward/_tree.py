"""Pair stage outputs with their gradients, with a readable path for every leaf.

Private module. ``stage_backward`` and ``stage_backward_input`` receive a stage's outputs and the
gradients of those outputs as arbitrarily nested tuples/lists/dicts. This module walks both trees
together, validates them, and returns flat, aligned lists of the tensors that take part in the
backward. Every error names the offending leaf by its path, e.g. ``stage_output[1]['h']``.

The walk is an explicit stack, never a nested recursive function: see Note [no closure cycle] in
``ppbackward.backward``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import GradientEdge

from ppbackward._errors import BadAssertion, BadType, BadValue, StageBackwardError

# private module: what other modules use
__all__ = ["FlatOutputs", "check_like", "flatten_outputs_and_grads", "versioned"]


class FlatOutputs(NamedTuple):
    """Flat, aligned view of the differentiable outputs of a stage.

    Attributes:
        tensors: output tensors that take part in the backward (``requires_grad`` or ``grad_fn``),
            and ``GradientEdge`` outputs (Note [GradientEdge outputs]).
        grads: the gradient for each entry of ``tensors`` (implicit ones already materialised for
            scalar outputs whose gradient was ``None``).
    """

    tensors: list[torch.Tensor | GradientEdge]
    grads: list[torch.Tensor]


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _is_differentiable(t: torch.Tensor) -> bool:
    return t.requires_grad or t.grad_fn is not None


def _check_grad(out: torch.Tensor, grad: Any, path: str, grads_given: bool) -> torch.Tensor:
    """Return the gradient to use for ``out``; raise naming ``path`` when it does not fit."""
    if grad is None:
        if out.numel() != 1:
            where = "output_grads is None" if not grads_given else "its gradient is None"
            hint = (
                "; in a pipeline, the next stage sent none for it: does the example tensor of its "
                "PipelineStage output_args/input_args require grad?"
                if grads_given
                else ""
            )
            raise BadValue(
                f"{path}: {where} but the output has shape {_shape(out)}; an implicit gradient "
                f"(ones) exists only for outputs with exactly one element{hint}"
            )
        return torch.ones_like(out, memory_format=torch.preserve_format)
    if not isinstance(grad, torch.Tensor):
        raise BadType(f"{path}: gradient must be a torch.Tensor or None, got {type(grad).__name__}")
    return check_like(grad, out, path, "output")


# Note [inference-tensor gradients]: a gradient made under ``torch.inference_mode()`` (an output gradient made
# beside a B called there, or received there; one written into ``group["grads"]`` there) has no version counter,
# and B and W record the version of every gradient B keeps or a caller writes for W (Note [captured gradients are
# checked at W] in ``ppbackward._handoff``): an output's gradient is one of them, and the gradient flowing into the
# last intermediate may be that very tensor. So such a gradient is used as a copy made outside inference mode: the
# same values, with a version counter. B runs outside inference mode anyway (``stage_backward_input`` re-enters
# itself with it off: leaves' ``AccumulateGrad`` nodes are found through views inference mode does not record); W
# keeps the caller's mode, so that under inference mode the weights' ``.grad`` are inference tensors, as a full
# backward there makes them. What a copy gives up: an in-place change of the caller's inference tensor between B
# and W is not seen (it could not be: such a tensor has no version to compare); W uses its values at B (or at the
# write). Torch's own split fails under inference mode (``Attempted to get grad_fn, but got None``, torch 2.13).
def versioned(grad: torch.Tensor) -> torch.Tensor:
    """``grad``, or where it is an inference tensor a copy of it made outside inference mode (Note
    [inference-tensor gradients])."""
    if not grad.is_inference():
        return grad
    with torch.inference_mode(False):
        return grad.clone()


def check_like(grad: torch.Tensor, like: Any, path: str, what: str) -> torch.Tensor:
    """``grad`` if its shape, dtype and device are ``like``'s (a tensor, or a node's input metadata), else
    raise naming ``path`` and ``what`` ``like`` is."""
    if tuple(grad.shape) != tuple(like.shape):
        raise BadValue(f"{path}: grad shape {_shape(grad)} != {what} shape {tuple(like.shape)}")
    if grad.dtype != like.dtype:
        raise BadType(f"{path}: grad dtype {grad.dtype} != {what} dtype {like.dtype}")
    if grad.device != like.device:
        raise BadValue(f"{path}: grad device {grad.device} != {what} device {like.device}")
    layout = getattr(like, "layout", torch.strided)  # a node's input metadata has none: strided
    if layout == torch.strided and grad.layout != layout:
        # a sparse gradient for a dense output: the engine would fail deep inside ('aten::view' for
        # 'SparseCPU'); a dense gradient for a sparse output is fine, as for autograd
        raise BadType(f"{path}: grad layout {grad.layout} != {what} layout {layout}")
    return grad


def _check_edge_grad(edge: GradientEdge, grad: Any, path: str, grads_given: bool) -> torch.Tensor:
    """The gradient for a ``GradientEdge`` output: required, and shaped like what the edge's node takes.

    Note [GradientEdge outputs]: torch's pipelining after 2.14 lets a stage pass
    ``torch.autograd.graph.get_gradient_edge(out)`` instead of ``out``, so that the stage can drop the output
    tensor (its activation) before backward. An edge is always differentiable, has no value to make an
    implicit gradient from, and cannot be detached: its gradient must be given, and checked against the
    input metadata of the edge's node (shape, dtype, device).
    """
    node, nr = edge.node, edge.output_nr
    if node is None or not hasattr(node, "_input_metadata"):
        raise BadValue(f"{path}: GradientEdge node is {type(node).__name__}, not an autograd node")
    if not isinstance(nr, int) or not 0 <= nr < len(node._input_metadata):
        raise BadValue(
            f"{path}: GradientEdge output_nr {nr!r} is out of range for {node.name()}, "
            f"which takes {len(node._input_metadata)} gradient(s)"
        )
    if grad is None:
        where = "output_grads is None" if not grads_given else "its gradient is None"
        raise BadAssertion(
            f"{path}: a GradientEdge output requires output gradients ({where}); an edge has no value to "
            "make an implicit gradient from"
        )
    if not isinstance(grad, torch.Tensor):
        raise BadType(f"{path}: gradient must be a torch.Tensor, got {type(grad).__name__}")
    return check_like(grad, node._input_metadata[nr], path, "GradientEdge input")


def _check_opaque_leaf(out: Any, path: str) -> None:
    """Refuse leaves that would silently hide differentiable tensors."""
    if isinstance(out, (set, frozenset, types.GeneratorType, Iterator)):
        raise BadType(
            f"{path}: a {type(out).__name__} cannot be matched with gradients (unordered or "
            "one-shot); use a tuple, list or dict"
        )
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        for field in dataclasses.fields(out):
            value = getattr(out, field.name, None)
            if isinstance(value, torch.Tensor) and _is_differentiable(value):
                raise BadType(
                    f"{path}: dataclass {type(out).__name__} holds a tensor that requires grad "
                    f"({field.name!r}); return a tuple, list or dict so it gets a gradient"
                )


def flatten_outputs_and_grads(
    outputs: Any,
    grads: Any,
    root: str = "stage_output",
    consumed: Mapping[int, torch.Tensor] | None = None,
) -> FlatOutputs:
    """Walk ``outputs`` and ``grads`` together and return the differentiable pairs.

    Rules (they mirror torch's ``stage_backward`` tree walk, with errors instead of asserts):

    * a tensor output that neither requires grad nor has a ``grad_fn`` is skipped, whatever its grad;
    * a ``GradientEdge`` output always takes part, with a gradient that must be given
      (Note [GradientEdge outputs]);
    * a tuple/list output whose grad is ``None`` is skipped entirely; otherwise the grad must be a
      tuple/list of the same length;
    * a dict output whose grad is ``None`` is skipped; otherwise the grad must be a dict with the
      same keys;
    * any other output (int, str, custom object) is ignored;
    * ``grads=None`` at the top level means "implicit": every differentiable output must then have
      exactly one element (a loss) and gets a gradient of ones.

    Args:
        outputs: a tensor or ``GradientEdge``, or nested tuples/lists/dicts whose leaves may be anything.
        grads: ``None``, or a structure matching ``outputs``.
        root: the name used at the start of every path in error messages.
        consumed: ``id -> tensor`` of outputs an earlier B already detached in place; meeting one
            again is an error rather than a silently skipped output.

    Returns:
        A :class:`FlatOutputs`.

    Raises:
        ValueError: structure mismatch, shape or device mismatch, ``None`` gradient for an output
            with more than one element.
        TypeError: a gradient that is neither a tensor nor ``None``, a dtype mismatch, a set or
            generator in the outputs, a dataclass holding a tensor that requires grad.
        RuntimeError: an output that an earlier B already consumed (see ``consumed``).
    """
    grads_given = grads is not None
    flat = FlatOutputs([], [])
    # Note [no closure cycle]: an explicit stack of (output, grad, path) instead of a recursive
    # nested function; nothing here can refer to itself.
    stack: list[tuple[Any, Any, str, bool]] = [(outputs, grads, root, grads_given)]
    while stack:
        out, grad, path, given = stack.pop()
        if isinstance(out, GradientEdge):  # a tuple too: checked first (Note [GradientEdge outputs])
            flat.tensors.append(out)
            flat.grads.append(_check_edge_grad(out, grad, path, given))
        elif isinstance(out, torch.Tensor):
            if _is_differentiable(out):
                flat.tensors.append(out)
                flat.grads.append(_check_grad(out, grad, path, given))
            elif consumed is not None and consumed.get(id(out)) is out:
                raise StageBackwardError(
                    f"{path}: this output was already backpropagated by stage_backward_input, "
                    "which detached it in place; a microbatch's outputs go through backward once"
                )
        elif isinstance(out, (tuple, list)):
            if not given:
                children = [(o, None, f"{path}[{i}]", False) for i, o in enumerate(out)]
            elif grad is None:
                continue
            elif not isinstance(grad, (tuple, list)):
                raise BadType(
                    f"{path}: output is a {type(out).__name__} of length {len(out)} but its "
                    f"gradient is a {type(grad).__name__}"
                )
            elif len(grad) != len(out):
                raise BadValue(
                    f"{path}: output has {len(out)} elements but its gradient has {len(grad)}"
                )
            else:
                children = [(o, g, f"{path}[{i}]", True) for i, (o, g) in enumerate(zip(out, grad))]
            stack.extend(reversed(children))
        elif isinstance(out, dict):
            if not given:
                children = [(o, None, f"{path}[{k!r}]", False) for k, o in out.items()]
            elif grad is None:
                continue
            elif not isinstance(grad, dict):
                raise BadType(
                    f"{path}: output is a dict but its gradient is a {type(grad).__name__}"
                )
            elif set(grad) != set(out):
                missing = sorted(map(repr, set(out) - set(grad)))
                extra = sorted(map(repr, set(grad) - set(out)))
                raise BadValue(
                    f"{path}: gradient keys differ from output keys "
                    f"(missing: {', '.join(missing) or '-'}; unexpected: {', '.join(extra) or '-'})"
                )
            else:
                children = [(o, grad[k], f"{path}[{k!r}]", True) for k, o in out.items()]
            stack.extend(reversed(children))
        else:  # any other leaf: not differentiable, ignored (as upstream), unless it hides tensors
            _check_opaque_leaf(out, path)
    return flat
