"""The hand-off from B (``stage_backward_input``) to W (``stage_backward_weight``): torch's param groups.

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

import collections.abc
import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.autograd.graph import GradientEdge, Node

from ppbackward._errors import BadType, BadValue, StageBackwardError
from ppbackward._graph import Intermediate
from ppbackward._saved import release_pinned
from ppbackward._tree import check_like

# ParamGroups is re-exported by ppbackward (for type hints); the rest is what B and W use
__all__ = ["CONSUMED", "Contribution", "NodeCall", "ParamGroup", "ParamGroups", "WeightSet", "WeightWork"]


class WeightSet(NamedTuple):
    """The weights B was given: their ids, how many, and whether any is a DTensor (Note [FSDP2 swaps
    parameters] in ``ppbackward.backward``)."""

    ids: frozenset[int]
    n_weights: int
    sharded: bool


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


class WeightWork(NamedTuple):
    """What W runs for some param groups: the intermediates to call, the gradients already known after
    B, and the edges into the ``AccumulateGrad`` nodes of the parameters accumulated (Note [W accumulates
    through the graph's AccumulateGrad nodes])."""

    calls: list[NodeCall]
    ready: list[Contribution]
    inputs: list[GradientEdge | torch.Tensor]


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
    tensors only and nothing refers back to it (Note [param_groups hold no cycle]).
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
    ) -> None:
        self.calls = calls
        self.ready = ready
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
        # which B released (or its engine call freed): W could not run their backward again
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
        with _CLAIM_LOCK:  # Note [captured gradients are checked at W]: W has read what it checks
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

    def w_work(self) -> tuple[list[NodeCall], list[Contribution]]:
        """``(calls, ready)`` W runs for this group: B's, or with the written gradients (Note [param groups
        read like torch's])."""
        if self._written is None:
            return self.calls, self.ready
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
        return calls, ready

    def kept_gradients(self) -> Iterator[torch.Tensor]:
        """The gradient tensors B captured that W still reads (those a write into ``"grads"`` did not replace;
        the written ones are checked apart: ``_written_versions``)."""
        calls, ready = self.w_work()
        mine = {id(call) for call in self.calls}
        for call in calls:
            if id(call) in mine:  # B's capture (written ones are checked apart)
                yield from (g for g in call.grads if g is not None)
        for c in ready:
            yield c.grad


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
        if not isinstance(entry, (list, tuple)):  # a caller's mistake of type
            raise BadType(
                f"{path}: expected a tuple of gradients for {node.name()} (or None), got {type(entry).__name__}"
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
        metas = node._input_metadata
        if len(entry) > len(metas):
            raise BadValue(f"{path}: {len(entry)} gradients for {node.name()}, which takes {len(metas)}")
        for j, g in enumerate(entry):
            if g is not None:
                if not isinstance(g, torch.Tensor):
                    raise BadType(f"{path}[{j}]: gradient must be a torch.Tensor or None, got {type(g).__name__}")
                check_like(g, metas[j], f"{path}[{j}]", f"{node.name()} input")
        label = node.name()
        if all(g is None for g in entry):  # W would call the node on nothing: torch's W refuses it too
            raise BadValue(
                f"{path}: no gradient for {label} (every entry None); write None instead of a tuple to keep "
                "what stage_backward_input captured for it"
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
        out.append(tuple(entry) + (None,) * (len(metas) - len(entry)))
    return out


class ParamGroups:
    """What ``stage_backward_input`` hands to ``stage_backward_weight`` for one microbatch.

    A sequence of :class:`ParamGroup`, each reading (and, for ``"grads"``, writing) like one of the
    dicts in the list torch's B returns (Note [param groups read like torch's]); pass it to
    :func:`ppbackward.stage_backward_weight` exactly once.

    See Note [param_groups hold no cycle] in this module.
    """

    __slots__ = ("_consumed", "_groups", "_hooked_in_b", "_owners", "_pinned", "_shapes", "_versions", "_weights")

    def __init__(
        self,
        groups: list[ParamGroup],
        weights: WeightSet,
        owners: tuple[Node, ...] = (),
        pinned: list | None = None,
        hooked_in_b: list[tuple[torch.Tensor, tuple[int, ...]]] | None = None,
    ) -> None:
        self._groups = groups
        for i, group in enumerate(groups):
            group._index = i
        self._weights = weights
        self._owners = owners  # Note [custom Function nodes need an owner] (ppbackward._node_owner)
        self._pinned = pinned or []  # Note [outputs detached after B] (ppbackward._saved)
        self._hooked_in_b = hooked_in_b or []  # Note [W mutes B's hooks]
        self._consumed = False
        # Note [captured gradients are checked at W]: by id, so that W checks only what it will read.
        # _captured_grads inline, plain loops (Note [no frame per node] in ppbackward.backward)
        versions = {}
        shapes = []
        for group in groups:
            for call in group.calls:
                for g in call[1]:
                    if g is not None:
                        versions[id(g)] = (g, g._version)
            for c in group.ready:
                g = c[1]
                versions[id(g)] = (g, g._version)
            for p in group.params:
                shapes.append((p, p.shape))
        self._versions = versions
        self._shapes = shapes

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
            for group in self._groups:  # no write into "grads" from now on
                group._claimed = True
            return True

    @contextlib.contextmanager
    def _consumed_by_w(self, weights: list[torch.Tensor], retain_graph: bool) -> Iterator[Iterator[WeightWork]]:
        """W's use of this object: claim it (Note [W claims param_groups first]), check what B captured is
        unchanged (Note [captured gradients are checked at W]), give W its work in chunks (Note [W in
        chunks]), and release everything when the block ends, whatever happens (Note [param_groups hold no
        cycle]; the pinned saved tensors too unless ``retain_graph``: Note [outputs detached after B] in
        ``ppbackward._saved``).

        Raises:
            StageBackwardError: already consumed; or a captured gradient changed in place since B.
            ValueError: a parameter's shape changed since B. Nothing has run then.
        """
        if not self._claim():
            raise StageBackwardError(CONSUMED)
        try:
            self._check_unchanged(weights)
            with _hooks_muted(self._hooked_in_b):
                yield self._chunks(_W_CHUNK_BYTES)
        finally:
            if not retain_graph:
                release_pinned(self._pinned)
            self._release()

    def _chunks(self, limit: int) -> Iterator[WeightWork]:
        """W's work, one chunk of param groups at a time (Note [W in chunks]), made as W reaches it. A chunk
        after the first is checked again first: a hook of an earlier chunk's accumulation (a user's
        ``register_post_accumulate_grad_hook``) could have changed its gradients in place (Note [captured
        gradients are checked at W]). The chunks holding a parameter with a tensor hook, and those between
        them, run as one (Note [parameters with tensor hooks accumulate in one call])."""
        for i, run in enumerate(_hooked_runs_joined(_runs(self._groups, limit))):
            if i:
                self._check_versions(run, during_w=True)
            yield _weight_work(run)

    def _check_unchanged(self, weights: list[torch.Tensor]) -> None:
        """Raise naming the gradient or parameter changed in place since B (Note [captured gradients
        are checked at W]); ``weights`` (W's) name the parameters."""
        self._check_versions(self._groups, during_w=False)
        for p, shape in self._shapes:
            if p.shape != shape:
                where = next((f"weights[{i}]" for i, w in enumerate(weights) if w is p), "a leaf of the stage")
                raise BadValue(
                    f"{where}: parameter of shape {tuple(shape)} at stage_backward_input now has shape "
                    f"{tuple(p.shape)} (changed in place between B and W); W accumulates nothing"
                )

    def _check_versions(self, groups: list[ParamGroup], during_w: bool) -> None:
        """Raise naming the first gradient of ``groups`` W will read whose version changed since it was
        recorded (at B, or at the write into ``"grads"``)."""
        if not any([group._written is not None for group in groups]):  # what B captured, all of it read
            if groups is self._groups:
                read = list(self._versions.values())
            else:  # _captured_grads inline (Note [no frame per node] in ppbackward.backward)
                versions = self._versions
                read = []
                for group in groups:
                    for call in group.calls:
                        for g in call[1]:
                            if g is not None:
                                read.append(versions[id(g)])
                    for c in group.ready:
                        read.append(versions[id(c[1])])
        else:  # what the written gradients left of B's
            kept = [g for group in groups for g in group.kept_gradients()]
            read = [self._versions[id(g)] for g in kept if id(g) in self._versions]
        written = [(g, v) for group in groups for g, v in group._written_versions]
        for grad, version in [*read, *written]:
            if grad._version != version:
                raise _changed_gradient(self._groups, grad, version, during_w)

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self):
        return iter(tuple(self._groups))

    def __getitem__(self, i: int) -> ParamGroup:
        return self._groups[i]

    def __repr__(self) -> str:
        if self._consumed:
            return "ParamGroups(consumed)"
        n_params = sum(len(g.params) for g in self._groups)
        n_inter = sum(len(g.calls) for g in self._groups)
        return (
            f"ParamGroups(groups={len(self._groups)}, params={n_params}, intermediates={n_inter})"
        )

    def _release(self) -> None:
        """Drop every node, tensor and gradient; mark consumed."""
        self._groups = []
        self._owners = ()
        self._pinned = []
        self._hooked_in_b = []
        self._versions = {}
        self._shapes = []
        self._consumed = True


# Note [W mutes B's hooks]: the tensor hooks registered during B's engine call on a parameter whose gradient
# B captured at its ``AccumulateGrad`` ran in B, on the gradient W accumulates, or were registered after that
# ``AccumulateGrad``'s turn in a full backward (Note [hooks registered during B] in ``ppbackward.backward``):
# either way a full backward does not run them again for this microbatch, so W takes exactly those out of the
# parameter's hook dict (which torch's C++ hook reads at call time) for its accumulating calls and puts them
# back afterwards, whatever happens, in their order among the hooks the dict holds then. Nothing to do in the
# usual case (no hook registered during B): the list is empty.
@contextlib.contextmanager
def _hooks_muted(hooked_in_b: list[tuple[torch.Tensor, tuple[int, ...]]]) -> Iterator[None]:
    parked = []
    for leaf, keys in hooked_in_b:
        hooks = leaf._backward_hooks
        if hooks:
            order = list(hooks)
            taken = {key: hooks.pop(key) for key in keys if key in hooks}
            parked.append((hooks, order, taken))
    try:
        yield
    finally:
        for hooks, order, taken in parked:
            now = dict(hooks)  # what the dict holds after W: hooks removed during W stay removed
            hooks.clear()
            for key in order:
                if key in taken:
                    hooks[key] = taken[key]
                elif key in now:
                    hooks[key] = now.pop(key)
            hooks.update(now)  # registered during W, after the others


_CLAIM_LOCK = threading.Lock()
CONSUMED = (
    "param_groups: already consumed by an earlier stage_backward_weight call (finished, or still running: "
    "W called from a hook it fired, or from another thread); W runs once per microbatch"
)

# Note [W in chunks]: W's first engine call materialises the weight gradients of every intermediate it
# covers, all alive at once until the accumulating call consumes them. Over a whole stage that is a
# stage's worth of parameter-sized temporaries: the allocator maps them fresh and returns them to the
# system afterwards, every microbatch (page faults a full backward, which adds each gradient as it is
# made, does not pay). W therefore runs its two engine calls per chunk of consecutive param groups
# holding about ``_W_CHUNK_BYTES`` of parameters, so the temporaries of one chunk are freed before the
# next is made and their memory is reused. On glibc, freeing a chunk's temporaries at once leaves a free
# region at the top of the heap larger than its trim threshold, which is returned to the system and
# faulted in again by the next microbatch; smaller chunks trigger that less, and chunks too small cost
# more engine calls where layers are narrow (the sizes measured: docs/performance.md, "W in chunks").
# Exactness is kept: a param group's weight-only nodes and parameters belong to it alone, so every
# gradient reaching one node is still summed in one engine call in the order of Note [accumulation
# order], and each parameter still gets exactly one ``AccumulateGrad`` call. A small stage is one chunk
# (two engine calls).
_W_CHUNK_BYTES = 4 * 2**20


def _runs(groups: list[ParamGroup], limit: int) -> Iterator[list[ParamGroup]]:
    """Consecutive runs of ``groups`` whose parameters reach ``limit`` bytes (the last may be smaller)."""
    run: list[ParamGroup] = []
    size = 0
    for group in groups:
        run.append(group)
        for p in group.params:
            size += p.numel() * p.element_size()
        if size >= limit:
            yield run
            run, size = [], 0
    if run:
        yield run


# Note [parameters with tensor hooks accumulate in one call]: a full backward accumulates every parameter in
# one engine call, and a hook may group gradients by engine call: ``register_multi_grad_hook`` (its "all"
# mode waits, per engine call, for the gradients of the tensors whose nodes that call runs, and fires once
# with them; "any" fires once per call) or any hook keyed on ``torch._C._current_graph_task_id()``. Over
# chunks (Note [W in chunks]) such a hook over a stage's parameters fired once per chunk, each time with that
# chunk's gradients only. So the chunks from the first to the last that hold a parameter with a tensor hook
# (``register_hook``, which ``register_multi_grad_hook`` uses) are joined into one (consecutive groups:
# exactness is kept, Note [W in chunks]); the others stay as they were. Only read where W has more than one
# chunk (a stage of over ``_W_CHUNK_BYTES`` of parameters): one hook-dict read per parameter.
def _hooked_runs_joined(runs: Iterator[list[ParamGroup]]) -> list[list[ParamGroup]]:
    listed = list(runs)
    if len(listed) < 2:  # one chunk (or none): nothing to join, nothing read
        return listed
    hooked = []
    for i, run in enumerate(listed):  # plain loops: no frame per parameter (Note [no frame per node] in backward)
        if [p for group in run for p in group.params if p._backward_hooks]:
            hooked.append(i)
    if len(hooked) > 1:
        start, stop = hooked[0], hooked[-1] + 1
        listed[start:stop] = [[group for run in listed[start:stop] for group in run]]
    return listed


def _weight_work(groups: list[ParamGroup]) -> WeightWork:
    """The work of ``groups`` together (B's, or with the gradients a caller wrote)."""
    calls: list[NodeCall] = []
    ready: list[Contribution] = []
    for group in groups:
        if group._written is None:  # w_work's common case inline (Note [no frame per node] in ppbackward.backward)
            calls += group.calls
            ready += group.ready
            continue
        group_calls, group_ready = group.w_work()
        calls += group_calls
        ready += group_ready
    return WeightWork(calls, ready, [edge for group in groups for edge in group.inputs])  # one frame

# code that checks what it holds (``isinstance(groups, Sequence)``, ``isinstance(group, Mapping)``) sees
# the forms of torch's list of dicts
collections.abc.Sequence.register(ParamGroups)
collections.abc.Mapping.register(ParamGroup)


def _captured_grads(group: ParamGroup) -> Iterator[torch.Tensor]:
    """The gradient tensors B captured for ``group``."""
    for call in group.calls:
        yield from (g for g in call.grads if g is not None)
    for c in group.ready:
        yield c.grad


def _changed_gradient(
    groups: list[ParamGroup], grad: torch.Tensor, version: int, during_w: bool = False
) -> StageBackwardError:
    where = "a gradient"
    for group in groups:
        for call in group.calls:
            for i, g in enumerate(call.grads):
                if g is grad:
                    where = f"the gradient B captured for {call.node.name()}'s input {i}"
        for c in group.ready:
            if c.grad is grad:
                where = f"the gradient B captured for the edge into {c.edge.node.name()} (input {c.edge.output_nr})"
        for i, entry in enumerate(group.written or ()):
            for j, g in enumerate(entry or ()):
                if g is grad:
                    where = f"the gradient written into {group._label()}['grads'][{i}][{j}]"
    if during_w:
        return StageBackwardError(
            f"param_groups: {where} ({grad.dtype} {list(grad.shape)}) was modified in place during "
            f"stage_backward_weight (version {version} -> {grad._version}), by a hook of an earlier chunk's "
            "accumulation; W would accumulate the changed values. The earlier chunks were accumulated, this "
            "one and the later ones were not. A hook must not change gradients W has still to read"
        )
    return StageBackwardError(
        f"param_groups: {where} ({grad.dtype} {list(grad.shape)}) was modified in place after "
        f"stage_backward_input (version {version} -> {grad._version}); W would accumulate the changed "
        "values. Keep a microbatch's output gradients (e.g. a receive buffer) unchanged until its W; "
        "W accumulates nothing"
    )
