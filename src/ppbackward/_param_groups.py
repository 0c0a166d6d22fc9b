"""The opaque hand-off from B (``stage_backward_input``) to W (``stage_backward_weight``).

Private module; :class:`ParamGroups` is re-exported by ``ppbackward`` for type hints only.

Note [param_groups hold no cycle]: a ``ParamGroups`` references gradient tensors and autograd nodes
(through ``GradientEdge``), and nothing that references it back: no hook, no closure and no autograd
node ever points at a ``ParamGroups`` or at one of its groups. It is therefore freed by reference
counting the moment its owner drops it, and :meth:`ParamGroups._release` (called by W whatever
happens) empties it, so that after W it references no node, tensor or hook at all. Upstream
(pytorch/pytorch#136584) kept intermediates and grads in dicts that the hooks on those intermediates
referenced: a cycle that pinned activations until the gc ran.

Note [W claims param_groups first]: W marks its ``ParamGroups`` consumed before it runs anything
(:meth:`ParamGroups._claim`, under a lock), not when it is done. A second W on the same object that
starts while the first is still running (from a post-accumulate-grad hook the first one fires, or from
another thread) is refused instead of accumulating every gradient a second time; torch's W fails there
too (a ``KeyError``, its dicts already emptied).

Note [captured gradients are checked at W]: B keeps the gradients it captured by reference (no copy:
that would double what a stage holds between B and W). A caller that changes one in place after B (a
stage reusing its receive buffer for the next microbatch, an in-place op between B and W) would
silently change what W accumulates; torch's split has the same hole. So B records each captured
gradient's version counter (``Tensor._version``, bumped by every in-place op on the tensor or a view
of its storage) and the shape of every parameter W accumulates into, and W compares both before it
runs anything (:meth:`ParamGroups._check_unchanged`): a few integer reads per intermediate.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
from torch.autograd.graph import GradientEdge, Node

from ppbackward._errors import BadValue, StageBackwardError

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

    __slots__ = ("_consumed", "_groups", "_owners", "_pinned", "_shapes", "_versions", "_weight_ids")

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
        # Note [captured gradients are checked at W]
        self._versions = [(g, g._version) for group in groups for g in _captured(group)]
        self._shapes = [(p, p.shape) for group in groups for p in group.params]

    @property
    def consumed(self) -> bool:
        """True once ``stage_backward_weight`` has started (or failed after its argument checks) with
        this object."""
        return self._consumed

    def _claim(self) -> bool:
        """Mark consumed; ``False`` if an earlier call already did (Note [W claims param_groups first])."""
        with _CLAIM_LOCK:
            if self._consumed:
                return False
            self._consumed = True
            return True

    def _check_unchanged(self, weights: list[torch.Tensor]) -> None:
        """Raise naming the gradient or parameter changed in place since B (Note [captured gradients
        are checked at W]); ``weights`` (W's) name the parameters."""
        for grad, version in self._versions:
            if grad._version != version:
                raise _changed_gradient(self._groups, grad, version)
        for p, shape in self._shapes:
            if p.shape != shape:
                where = next((f"weights[{i}]" for i, w in enumerate(weights) if w is p), "a leaf of the stage")
                raise BadValue(
                    f"{where}: parameter of shape {tuple(shape)} at stage_backward_input now has shape "
                    f"{tuple(p.shape)} (changed in place between B and W); W accumulates nothing"
                )

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
        self._versions = []
        self._shapes = []
        self._consumed = True


_CLAIM_LOCK = threading.Lock()


def _captured(group: ParamGroup):
    """The gradient tensors B captured for ``group``."""
    for _, grads, _ in group.intermediates:
        yield from (g for g in grads if g is not None)
    for _, _, grad in group.ready:
        yield grad


def _changed_gradient(groups: list[ParamGroup], grad: torch.Tensor, version: int) -> StageBackwardError:
    where = "a gradient"
    for group in groups:
        for node, grads, _ in group.intermediates:
            for i, g in enumerate(grads):
                if g is grad:
                    where = f"the gradient B captured for {node.name()}'s input {i}"
        for _, edge, g in group.ready:
            if g is grad:
                where = f"the gradient B captured for the edge into {edge.node.name()} (input {edge.output_nr})"
    return StageBackwardError(
        f"param_groups: {where} ({grad.dtype} {list(grad.shape)}) was modified in place after "
        f"stage_backward_input (version {version} -> {grad._version}); W would accumulate the changed "
        "values. Keep a microbatch's output gradients (e.g. a receive buffer) unchanged until its W; "
        "W accumulates nothing"
    )
