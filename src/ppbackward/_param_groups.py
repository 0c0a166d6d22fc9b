"""The opaque hand-off from B (``stage_backward_input``) to W (``stage_backward_weight``).

Private module; :class:`ParamGroups` is re-exported by ``ppbackward`` for type hints only.

Note [param_groups hold no cycle]: a ``ParamGroups`` references gradient tensors and autograd nodes
(through ``GradientEdge``), and nothing that references it back: no hook, no closure and no autograd
node ever points at a ``ParamGroups`` or at one of its groups. It is therefore freed by reference
counting the moment its owner drops it, and :meth:`ParamGroups._release` (called by W whatever
happens) empties it, so that after W it references no node, tensor or hook at all. Upstream
(pytorch/pytorch#136584) kept intermediates and grads in dicts that the hooks on those intermediates
referenced: a cycle that pinned activations until the gc ran.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["ParamGroups"]


class WeightSet(NamedTuple):
    """The weights B was given: their ids, how many, and whether any is a DTensor (Note [FSDP2 swaps
    parameters] in ``ppbackward.backward``)."""

    ids: frozenset[int]
    n_weights: int
    sharded: bool


class ParamGroup(NamedTuple):
    """One param group ready for W.

    Attributes:
        intermediates: ``(node, grads, w_edges)`` for each intermediate W must call: the gradient B
            captured for each of the node's input slots (``None`` where none flowed) and the
            indices of the node's ``next_functions`` that lead into weight-only nodes.
        ready: ``(sequence_nr, edge, grad)`` contributions already known after B: output edges
            leading straight into weight-only nodes, and the weight edges of custom
            ``autograd.Function`` intermediates (which ran once, in B).
        params: the leaf tensors whose ``AccumulateGrad`` the group reaches.
    """

    intermediates: list[tuple[Node, tuple, tuple[int, ...]]]
    ready: list[tuple[float, GradientEdge, torch.Tensor]]
    params: list[torch.Tensor]

    def __getitem__(self, key):
        if isinstance(key, str):  # torch's param groups are dicts: param_group["grads"]
            raise _not_a_dict(key)
        return tuple.__getitem__(self, key)

    def __setitem__(self, key, value) -> None:
        raise _not_a_dict(key)


def _not_a_dict(key: object) -> TypeError:
    return TypeError(
        f"ParamGroup[{key!r}]: ppbackward's param groups are opaque, not torch's dicts of 'params', "
        "'intermediates' and 'grads'; W uses the gradients B captured. To change what W accumulates, "
        "register a tensor hook on the activation or a post-accumulate-grad hook on the parameter "
        "(docs/api.md, Differences from torch's functions)"
    )


class ParamGroups:
    """What ``stage_backward_input`` hands to ``stage_backward_weight`` for one microbatch.

    Opaque to callers, like the ``param_groups`` list of dicts upstream returns; pass it to
    :func:`ppbackward.stage_backward_weight` exactly once. ``len()`` and iteration expose the groups
    (read-only :class:`ParamGroup` tuples) for inspection and debugging.

    See Note [param_groups hold no cycle] in this module.
    """

    __slots__ = ("_consumed", "_groups", "_owners", "_pinned", "_weight_ids")

    def __init__(
        self,
        groups: list[ParamGroup],
        weight_ids: WeightSet,
        owners: tuple[Node, ...] = (),
        pinned: list | None = None,
    ) -> None:
        self._groups = groups
        self._weight_ids = weight_ids
        self._owners = owners  # Note [custom Function nodes need an owner] (ppbackward._node_owner)
        self._pinned = pinned or []  # Note [outputs detached after B] (ppbackward._saved)
        self._consumed = False

    @property
    def consumed(self) -> bool:
        """True once ``stage_backward_weight`` has run (or failed) with this object."""
        return self._consumed

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self):
        return iter(tuple(self._groups))

    def __repr__(self) -> str:
        if self._consumed:
            return "ParamGroups(consumed)"
        n_params = sum(len(g.params) for g in self._groups)
        n_inter = sum(len(g.intermediates) for g in self._groups)
        return (
            f"ParamGroups(groups={len(self._groups)}, params={n_params}, intermediates={n_inter})"
        )

    def _release(self) -> None:
        """Drop every node, tensor and gradient; mark consumed."""
        self._groups = []
        self._owners = ()
        self._pinned = []
        self._consumed = True
