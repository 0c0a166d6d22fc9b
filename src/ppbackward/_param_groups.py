"""Torch's dict-like view of the B→W hand-off: a :class:`ParamGroup` reads (``group["params"]``,
``group["intermediates"]``, ``group["grads"]``) and writes (``group["grads"] = [...]``, checked when
written: :func:`_checked_grads`) like one of the dicts in the list torch's B returns, and passes for a
``Mapping`` (its ``ParamGroups`` for a ``Sequence``).

Private module; nothing here is public. The hand-off itself, :class:`ppbackward.ParamGroups` (the one
public name, re-exported by ``ppbackward`` for type hints), is in ``ppbackward._handoff``, which builds on
this module. Here too, the minimum the two share: what a group holds for W (:class:`NodeCall`,
:class:`Contribution`) and ``CLAIM_LOCK``, under which W's claim and a write into ``"grads"`` exclude
each other (Note [W claims param_groups first] in ``ppbackward._handoff``).

See Note [param groups read like torch's] on :class:`ParamGroup`.
"""

from __future__ import annotations

import collections.abc
import itertools
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.autograd.graph import GradientEdge, Node

from ppbackward._compiled import PendingWeightGrads, is_region
from ppbackward._errors import BadType, BadValue, StageBackwardError
from ppbackward._graph import Intermediate
from ppbackward._tree import check_like, versioned

# private module: what other modules use (ppbackward._handoff, backward, _weight_edges)
__all__ = ["CLAIM_LOCK", "Contribution", "NodeCall", "ParamGroup", "RegionCall"]


class NodeCall(NamedTuple):
    """An intermediate W calls again (Note [W computes only weight edges] in ``ppbackward._weight_edges``).

    Attributes:
        node: the autograd node.
        grads: the gradient flowing into each of its input slots (``None`` where none flowed), as B
            captured it or as a caller wrote it into ``group["grads"]``.
        w_edges: the indices of ``node.next_functions`` whose gradients W computes.
    """

    node: Node
    grads: tuple
    w_edges: tuple[int, ...]


class Contribution(NamedTuple):
    """A gradient W hands to its accumulating engine call as a root.

    Attributes:
        edge: the slot it flows into (a weight-only node's or a weight's ``AccumulateGrad``).
        grad: the gradient.
        seq: the sequence number that orders it among the gradients reaching one slot (Note
            [accumulation order] in ``ppbackward._weight_edges``): the producing node's, ``inf`` for an output's.
    """

    edge: GradientEdge
    grad: torch.Tensor
    seq: float


class RegionCall(NamedTuple):
    """A compiled region B split: W runs its weight half (Note [compiled regions split in two] in
    ``ppbackward._compiled``).

    Attributes:
        node: the region's ``CompiledFunctionBackward`` node (its edges name where the gradients go).
        pending: the weight half and the tensors it reads.
        alone: the only source of its param group's gradients (Note [weight halves hand their gradients
            over] in ``ppbackward._weight_edges``).
    """

    node: Node
    pending: PendingWeightGrads
    alone: bool


_KEYS = ("params", "intermediates", "grads")


class _Entries(tuple):
    """What ``group[key]`` reads: a tuple whose item writes fail with what to do instead (torch's entries
    are lists; changing an item of a copy would change nothing W reads)."""

    __slots__ = ()

    def __setitem__(self, index: object, value: object) -> None:
        raise TypeError(
            "param group entries are read-only copies: write the whole list, group['grads'] = [...] (only "
            "'grads' can be written; Note [param groups read like torch's])"
        )

    __delitem__ = __setitem__


class ParamGroup:
    """One param group ready for W; reads and writes like one of torch's param-group dicts.

    Attributes (W's work):
        calls: a :class:`NodeCall` for each intermediate W must call, with the gradients B captured
            flowing into it (``group["intermediates"]`` reads the nodes, torch's way).
        ready: the :class:`Contribution`\\ s already known after B: output edges leading straight into
            weight-only nodes (sequence number ``inf``), the weight edges of custom ``autograd.Function``
            intermediates (which ran once, in B) and the weight gradients B computed itself (Note [cheap
            weight gradients in B] in ``ppbackward._graph``).
        params: the leaf tensors whose ``AccumulateGrad`` the group reaches.
        inputs: ``GradientEdge(leaf, 0)`` for each of those ``AccumulateGrad`` nodes: what W's accumulating
            call names (Note [W accumulates through the graph's AccumulateGrad nodes]).

    Note [param groups read like torch's]: torch's B returns a list of dicts with ``"params"`` (the
    weights' ``AccumulateGrad`` nodes), ``"intermediates"`` (the nodes where weight paths branch off)
    and ``"grads"`` (per intermediate, the gradients flowing into it), and its W computes the weight
    gradients from ``"grads"``; a caller may replace them between B and W. ``group[key]`` gives the same
    three. ``"intermediates"`` lists the intermediates W could still compute from: those whose weight
    gradients are deferred (a linear layer's ``addmm``: ``"grads"`` holds what B captured flowing into it)
    and custom ``autograd.Function`` nodes (their ``"grads"`` entry is ``None``: B captured what they
    returned, not what flowed in). The nodes whose weight gradients B computed itself (norms, Note [cheap
    weight gradients in B]) are not listed: referencing them would keep their graph, and the stage input,
    alive until W. ``group["grads"] = [...]`` is checked when written (one entry per listed intermediate
    at most, ``None`` or a tuple of gradients, each ``None`` or a tensor shaped like the node's input:
    what the engine would refuse inside W),
    and W then computes each listed intermediate's weight gradients from its entry, as torch's W does: a
    tuple makes W call the node for all its weight edges (a custom Function then runs its backward a
    second time, as in torch's W), replacing what B had computed for them (a bias B reduced, a custom
    Function's outputs); ``None`` (or no entry: a shorter list) keeps what B has for that node. That is the
    one difference from torch in what W computes, whose W then leaves the node's weights without a gradient:
    here reading ``"grads"`` and writing it back gives exactly the gradients of no write (a custom Function's
    entry reads ``None``). Refused when written, so that W never fails on it after claiming the groups: a tuple
    for a node whose weight shares one of B's sums with another node (a bias used twice), and one for a custom
    Function that saved tensors (B released them, or its engine call freed them with the node; B notes which
    held any before that call; one that saved none runs again; torch's B keeps the whole graph, and its W runs
    the backward again), and deleting a key (``del group["grads"]``). Output edges straight into weights and the
    weights of nodes B finished (norms) are accumulated as without a write. The group references nodes and
    tensors only and nothing refers back to it (Note [param_groups hold no cycle] in ``ppbackward._handoff``).
    """

    __slots__ = (
        "_captured",
        "_claimed",
        "_index",
        "_leaves",
        "_nodes",
        "_replaced",
        "_spent",
        "_written",
        "_written_versions",
        "calls",
        "inputs",
        "params",
        "ready",
        "regions",
        "taken",
    )

    def __init__(
        self,
        calls: list[NodeCall],
        ready: list[Contribution],
        params: list[torch.Tensor],
        nodes: list[Intermediate] | None = None,
        leaves: list[Node] | None = None,
        replaced: dict[Node, list] | None = None,
        spent: frozenset[Node] = frozenset(),
        regions: list[RegionCall] | None = None,
        taken: dict[Node, tuple[torch.Tensor, int]] | None = None,
    ) -> None:
        self.calls = calls
        # node -> (mat1, version): W computes these intermediates' weight gradients from what B took out of
        # them (Note [weight matmuls from their saved input] in ppbackward._matmul_weights)
        self.taken = taken or {}
        self.ready = ready
        self.regions = regions or []
        self.params = params
        self._nodes = nodes if nodes is not None else [Intermediate(c.node, c.w_edges) for c in calls]
        self._leaves = leaves or []
        # Note [W accumulates through the graph's AccumulateGrad nodes]; a group built without its leaves
        # (a test's) names the parameters themselves. Plain loops, edges made by tuple.__new__: no frame per
        # leaf or call (Note [no frame per node] in ppbackward.backward)
        inputs: list[GradientEdge | torch.Tensor] = []
        if self._leaves:
            for leaf in self._leaves:
                inputs.append(tuple.__new__(GradientEdge, (leaf, 0)))
        else:
            inputs += params
        self.inputs = inputs
        captured = {}
        for call in calls:
            captured[call[0]] = call[1]
        self._captured = captured
        # node -> the entries of ``ready`` its written gradients replace (a custom Function's outputs, the
        # cheap weight gradients it alone fed); a ``None`` among them: shared with another node
        self._replaced = replaced or {}
        # the custom Function nodes (of the stage: a group reads those among ``_nodes``) that saved tensors,
        # which B released (or its engine call freed): W could not run their backward again (not compiled
        # regions: _checked_grads refuses those by type)
        self._spent = spent
        self._written: list | None = None
        self._written_versions: list[tuple[torch.Tensor, int]] = []
        self._claimed = False  # set by W's claim: no write after it
        self._index: int | None = None  # its place in its ParamGroups, for error messages

    def __getitem__(self, key: str) -> tuple:
        # tuples, not lists: changing an item of what was read (``group["grads"][0] = ...``) would change
        # nothing W reads; the tuple refuses it, saying so, and ``group["grads"] = [...]`` is the write
        if key == "params":
            return _Entries(self._leaves)
        if key == "intermediates":
            return _Entries(inter.node for inter in self._nodes)
        if key == "grads":
            if self._written is not None:
                return _Entries(self._written)
            return _Entries(self._captured.get(inter.node) for inter in self._nodes)
        raise KeyError(f"ParamGroup[{key!r}]: a param group has the keys {', '.join(map(repr, _KEYS))}")

    def __setitem__(self, key: str, value: object) -> None:
        if key != "grads":
            raise TypeError(
                f"ParamGroup[{key!r}] = ...: only 'grads' can be written (W accumulates into the group's "
                "parameters through the intermediates B found; Note [param groups read like torch's])"
            )
        written = _checked_grads(value, self._nodes, self._replaced, self._captured, self._spent, self._label())
        with CLAIM_LOCK:  # Note [captured gradients are checked at W] (_handoff): W has read what it checks
            if self._claimed:
                raise StageBackwardError(
                    f"{self._label()}['grads'] = ...: stage_backward_weight has started on these param groups "
                    "(a hook of it, or another thread); write the gradients before W"
                )
            self._written = written
            # as B's own gradients: the versions now, compared when W reads them
            self._written_versions = [(g, g._version) for entry in written for g in entry or () if g is not None]

    def __delitem__(self, key: str) -> None:
        raise BadType(
            f"del {self._label()}[{key!r}]: a param group's keys cannot be deleted (torch's W deletes them itself "
            "as it runs; stage_backward_weight empties the whole ParamGroups). To drop a node's weight gradients "
            "write a tuple of zeros for it into 'grads'; to keep what stage_backward_input captured, leave 'grads' "
            "as it is (or write None for that node)"
        )

    def _label(self) -> str:
        """How errors name this group: ``param_groups[i]`` within its ``ParamGroups``."""
        return "param_group" if self._index is None else f"param_groups[{self._index}]"

    def get(self, key: str, default: object = None) -> object:
        return self[key] if key in _KEYS else default

    def keys(self) -> tuple[str, ...]:
        return _KEYS

    def values(self) -> tuple[tuple, ...]:
        return tuple(self[key] for key in _KEYS)

    def items(self) -> tuple[tuple[str, tuple], ...]:
        return tuple((key, self[key]) for key in _KEYS)

    def __contains__(self, key: object) -> bool:
        return key in _KEYS

    def __iter__(self):
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(_KEYS)

    def __repr__(self) -> str:
        return (
            f"ParamGroup(params={len(self._leaves)}, intermediates={len(self._nodes)}, "
            f"grads={'written' if self._written is not None else 'captured by B'})"
        )

    @property
    def written(self) -> list | None:
        """The gradients a caller wrote into ``group["grads"]`` (checked), or ``None``."""
        return self._written

    def w_work(self) -> tuple[list[NodeCall], list[Contribution], list[RegionCall]]:
        """``(calls, ready, regions)`` W runs for this group: B's, or with the written gradients (Note [param
        groups read like torch's])."""
        if self._written is None:
            return self.calls, self.ready, self.regions
        calls: list[NodeCall] = []
        replaced: set[int] = set()
        kept = {call.node: call for call in self.calls}
        for inter, grads in itertools.zip_longest(self._nodes, self._written[: len(self._nodes)]):
            if grads is None:  # what B has for it stays
                if inter.node in kept:
                    calls.append(kept[inter.node])
                continue
            replaced.update(id(entry) for entry in self._replaced.get(inter.node, ()))
            calls.append(NodeCall(inter.node, grads, inter.w_edges))
        ready = [c for c in self.ready if id(c) not in replaced]
        return calls, ready, self.regions  # a tuple for a compiled region is refused when written

    def kept_gradients(self) -> Iterator[torch.Tensor]:
        """The gradient tensors B captured that W still reads (those a write into ``"grads"`` did not replace;
        the written ones are checked apart: ``_written_versions``)."""
        calls, ready, regions = self.w_work()
        mine = {id(call) for call in self.calls}
        for call in calls:
            if id(call) in mine:  # B's capture (written ones are checked apart)
                yield from (g for g in call.grads if g is not None)
        for c in ready:
            yield c.grad
        for region in regions:
            for t, _ in region.pending.versions:
                yield t
        for x, _ in self.taken.values():
            yield x


def _checked_grads(
    value: object, nodes: list, replaced: dict, captured_of: dict, spent: frozenset, group: str
) -> list:
    """``value`` as W will use it, or a :class:`StageBackwardError` naming the entry of ``group`` (how the
    group is named: ``param_groups[i]``) (Note [param groups read like torch's])."""
    if not isinstance(value, (list, tuple)):
        raise BadType(
            f"{group}['grads']: expected a list with one entry per intermediate, got {type(value).__name__}"
        )
    if len(value) > len(nodes):
        if not nodes:
            raise BadValue(
                f"{group}['grads']: {len(value)} entries for a group with no intermediate W computes from: "
                "stage_backward_input computed its weights' gradients itself (norms, biases, elementwise scales: "
                "Note [cheap weight gradients in B]); there is nothing to write"
            )
        raise BadValue(
            f"{group}['grads']: {len(value)} entries for {len(nodes)} intermediate(s) "
            f"({', '.join(inter.node.name() for inter in nodes)})"
        )
    out: list = []
    for i, (entry, inter) in enumerate(zip(value, nodes)):
        node = inter.node
        path = f"{group}['grads'][{i}]"
        if entry is None:
            out.append(None)
            continue
        if is_region(node):  # only its Python type read: the node may be freed (torch 2.5-2.12)
            raise BadValue(
                f"{path}: only None can be written for {type(node).__name__}, a torch.compile'd region, whose "
                "backward ran in stage_backward_input (whole, or its input half, the weight half waiting for W); W "
                "cannot run it again from written gradients (what its compiled backward reads is gone). Write None "
                "to keep what B computed, or run a full backward (stage_backward) where the gradients must change"
            )
        if node in spent:  # first: on torch 2.5-2.12 a spent node may be freed; only its Python type is safe
            raise BadValue(
                f"{path}: {type(node).__name__} is a custom autograd.Function whose backward ran once, in "
                "stage_backward_input, which then released what it saved (or freed the node, where B needed no "
                "retained graph): B keeps its outputs for W, not its saved tensors (torch's B keeps the whole "
                "graph, so its W can run the backward again), so W cannot compute from written gradients here. "
                "Write None to keep what B computed, or run a full backward (stage_backward) where the "
                "gradients must change"
            )
        if not isinstance(entry, (list, tuple)):  # a caller's mistake of type (after the nodes that take none)
            raise BadType(
                f"{path}: expected a tuple of gradients for {node.name()} (or None), got {type(entry).__name__}"
            )
        metas = node._input_metadata
        if len(entry) > len(metas):
            raise BadValue(f"{path}: {len(entry)} gradients for {node.name()}, which takes {len(metas)}")
        for j, g in enumerate(entry):
            if g is not None:
                if not isinstance(g, torch.Tensor):
                    raise BadType(f"{path}[{j}]: gradient must be a torch.Tensor or None, got {type(g).__name__}")
                check_like(g, metas[j], f"{path}[{j}]", f"{node.name()} input")
        label = node.name()
        if all(g is None for g in entry):  # W would call the node on nothing (torch 2.13's W drops the node)
            raise BadValue(
                f"{path}: no gradient for {label} (every entry None); to drop its weight gradients write zeros "
                "for them, to keep what stage_backward_input captured for it write None instead of a tuple"
            )
        captured = captured_of.get(node)
        if captured is not None and len(entry) == len(captured) and all(a is b for a, b in zip(entry, captured)):
            out.append(None)  # B's own gradients written back: keep what B has (no recomputation)
            continue
        if None in replaced.get(node, ()):
            raise BadValue(
                f"{path}: {label} shares a weight with another intermediate whose weight gradient "
                "stage_backward_input computed in one sum (Note [cheap weight gradients in B]); W cannot replace "
                "its part alone: write None for it"
            )
        # Note [inference-tensor gradients] (ppbackward._tree): W records each written gradient's version
        kept = tuple(None if g is None else versioned(g) for g in entry)
        out.append(kept + (None,) * (len(metas) - len(entry)))
    return out


# W's claim and a write into "grads" exclude each other (Note [W claims param_groups first] in ppbackward._handoff)
CLAIM_LOCK = threading.Lock()

# code that checks what it holds (``isinstance(group, Mapping)``, ``isinstance(groups, Sequence)``) sees
# the forms of torch's list of dicts (ParamGroups is registered as a Sequence in ppbackward._handoff)
collections.abc.Mapping.register(ParamGroup)
