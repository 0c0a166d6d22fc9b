"""Keeping custom ``autograd.Function`` nodes alive from B to W on torch releases that hold them weakly.

Private module, used by :func:`ppbackward.stage_backward_input`.

Note [custom Function nodes need an owner]: before torch 2.13, the Python object of a custom
``autograd.Function`` node (``BackwardCFunction``) holds its C++ node weakly, and so may a
``GradientEdge`` to it. Once B has detached the stage outputs, a custom node that B's
``ParamGroups`` reaches only by such an edge (an output edge; a weight edge of a custom
intermediate, which ran in B) or by its Python object (a custom intermediate a group lists, which
a write into its ``"grads"`` entry makes W call again) may have no owner left, and W then fails
with a ``RuntimeError`` (``element 0 of tensors does not require grad``) or, depending on the
call path, crashes the process (a dead node handed to the engine, or its input metadata read
where such a write is checked: torch 2.5.1). :func:`custom_nodes_need_owner` probes this once, the
way B holds nodes; where it holds and B's param groups reference a custom node,
:func:`candidate_owners` gives one C++ node per stage output (a view of it), taken before B runs,
and B stores them in its ``ParamGroups`` (:func:`owners_needed`); W's release drops them. This
keeps the output side of that microbatch's graph (nodes, not the saved tensors B released) until
W, as if B had not detached the outputs; graphs without custom Function nodes, and torch 2.13+,
are unaffected. No cycle: the owners are autograd nodes, which never refer back.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

from ppbackward._plain import plain_autograd

__all__ = ["candidate_owners", "custom_nodes_need_owner", "owners_needed"]


class _Clone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad


@functools.cache
def custom_nodes_need_owner() -> bool:
    """True when a custom Function node that B's ``ParamGroups`` references can die before W.

    Mirrors how B holds such nodes: the ``GradientEdge`` of an output (``get_gradient_edge``), and a
    ``GradientEdge`` built from a custom Function node's ``next_functions``; each is kept while
    every tensor and node that owned the custom node is dropped. Measured: true on torch 2.5.1
    through 2.12.1, false on 2.13.0 and 2.14.1 (docs/compatibility.md).
    """
    with plain_autograd():  # Note [probes run in plain autograd]
        x = torch.zeros(1, requires_grad=True)
        out = _Clone.apply(x)
        top = _Mul.apply(x, _Clone.apply(x))
    held = (
        torch.autograd.graph.get_gradient_edge(out),
        GradientEdge(*top.grad_fn.next_functions[1][:2]),
    )
    del out, top
    for edge in held:
        try:
            _ = edge.node.next_functions
        except RuntimeError:
            return True
    return False


def _references_custom_node(groups: Any) -> bool:
    """Whether any node in ``groups`` (nested tuples/lists: intermediates, edges) is a custom Function node."""
    todo: list[Any] = list(groups)
    while todo:  # explicit stack: Note [no closure cycle]
        item = todo.pop()
        if isinstance(item, BackwardCFunction):
            return True
        if isinstance(item, (tuple, list)):
            todo.extend(item)
    return False


def _owner(t: torch.Tensor) -> Node:
    """A C++ node whose only edge leads to ``t``'s ``grad_fn``: a view where the layout has views,
    else a clone (sparse tensors; the clone's memory is freed at once, only its node is kept)."""
    try:
        owner = t.view_as(t).grad_fn
    except (RuntimeError, NotImplementedError):
        owner = t.clone().grad_fn
    return cast(Node, owner)  # t requires grad: its view and clone have a grad_fn


def candidate_owners(outputs: list[Any]) -> tuple[Node, ...]:
    """Owners for every output that requires grad, taken before B runs anything (so that a failure
    here leaves nothing behind); ``()`` where torch keeps custom nodes alive itself.

    Args:
        outputs: the stage's outputs (tensors; a ``GradientEdge`` output gets none).
    """
    if not custom_nodes_need_owner():
        return ()
    with torch.enable_grad():  # a GradientEdge output has no tensor to take a view of
        return tuple(_owner(t) for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad)


def owners_needed(owners: tuple[Node, ...], groups: Any) -> tuple[Node, ...]:
    """``owners`` if B's param groups reference a custom Function node, else ``()``
    (Note [custom Function nodes need an owner])."""
    return owners if owners and _references_custom_node(groups) else ()
