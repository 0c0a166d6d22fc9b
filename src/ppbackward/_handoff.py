"""The hand-off from B (``stage_backward_input``) to W (``stage_backward_weight``): :class:`ParamGroups`
as W consumes it: its claim (once), the check that what B captured is unchanged, W's work in chunks
(:class:`WeightWork`), B's hooks muted while W accumulates, and its release.

Private module; its one public name is :class:`ParamGroups`, re-exported by ``ppbackward`` for type
hints only. Its groups, read and written like torch's dicts, are ``ppbackward._param_groups``'s
:class:`ParamGroup` (Note [param groups read like torch's] there).

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

Note [saved tensors W reads are checked]: an intermediate W calls again (a ``BmmBackward0`` of an einsum, a
convolution: not a linear layer's matmul, whose saved input B took out and versioned: Note [weight matmuls
from their saved input] in ``ppbackward._matmul_weights``) reads the tensors it saved in the forward, a stage
input or a parameter among them. Changed in place after B (or freed by another backward through the graph),
autograd refuses them inside W's call of the node, with a message that names neither the node nor the param
group. W's call of a chunk's intermediates comes before anything of the chunk accumulates, and calling a node
releases nothing, so where it raises, W reads each called node's saved tensors as its backward would
(:func:`ppbackward._saved.unreadable_saved`; none held through a caller's saved-tensor hooks, whose unpack hook
would run once more) and raises naming the first one that cannot be read, the node and its group, from
autograd's error; an error of another kind is raised as it came. Nothing is read where W succeeds. The
weight-only nodes W's accumulating calls run (``a @ b`` of a merged weight, not a linear layer's ``TBackward0``,
which saves nothing) cannot be checked that way: autograd refuses them inside the accumulating engine call,
after other parameters of the chunk accumulated there. So B lists those whose type saves tensors (a dict read per
weight-only node) and W reads their saved tensors the same way before anything runs: a weight changed in place
since B, or a weight computed once for several microbatches whose graph the first microbatch's W freed, is
refused with every ``.grad`` untouched (torch's split fails there with autograd's message). A full backward
cannot meet this: nothing runs between its forward and its backward.

Note [a weight-only node B runs was freed before]: B runs the weight-only nodes on the way to the weight gradients
it computes itself (Note [cheap weight gradients in B] in ``ppbackward._graph``: ``b * s`` feeding a bias), and its
engine call frees them as a full backward does. A weight computed once and used by several microbatches (under
``torch.nn.utils.parametrize.cached()``, or ``b * s`` once per step) is then freed by the first microbatch's B, where
torch's B (which runs no weight-only node) and a W with ``retain_graph=True`` keep it; the next B stopped inside its
engine call with autograd's message alone. So B reads, before anything runs, the saved tensors of the C++ weight-only
nodes it will run, as W reads those it runs (above), and refuses naming the node and the cause: freed, or changed in
place since the forward (a parameter stepped between the forward and B, which a plain backward refuses too). The read
costs nothing on graphs without such nodes (a linear layer's bias and a norm's weight lead straight into their
``AccumulateGrad``), a dict read per such node whose type saves nothing (a cast, a view), and one read per saved
tensor otherwise. Before torch 2.13 (saved tensors' hooks not visible) nothing is read and autograd's message comes
through.
"""

from __future__ import annotations

import collections.abc
import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

from ppbackward._errors import BadValue, StageBackwardError
from ppbackward._graph import is_accumulate_grad
from ppbackward._param_groups import CLAIM_LOCK, Contribution, NodeCall, ParamGroup, RegionCall
from ppbackward._saved import cpp_nodes_saving, release_pinned, unreadable_saved

# ParamGroups is re-exported by ppbackward (for type hints); the rest is what B and W use
__all__ = ["CONSUMED", "ParamGroups", "WeightSet", "WeightWork", "unreadable_saved_error"]


class WeightSet(NamedTuple):
    """The weights B was given: their ids, how many, and whether any is a DTensor (Note [FSDP2 swaps
    parameters] in ``ppbackward.backward``)."""

    ids: frozenset[int]
    n_weights: int
    sharded: bool


class WeightWork(NamedTuple):
    """What W runs for some param groups: the intermediates to call, the gradients already known after
    B, and the edges into the ``AccumulateGrad`` nodes of the parameters accumulated (Note [W accumulates
    through the graph's AccumulateGrad nodes])."""

    calls: list[NodeCall]
    ready: list[Contribution]
    inputs: list[GradientEdge | torch.Tensor]
    regions: list[RegionCall]  # compiled regions' weight halves (Note [compiled regions split in two])
    # node -> (mat1, version) of the matmuls W computes from what B took out (Note [weight matmuls from their
    # saved input] in ppbackward._matmul_weights)
    taken: dict
    groups: list[ParamGroup]  # whose work it is (errors name them)
    first_chunk: bool  # W's first chunk: nothing was accumulated before it


class ParamGroups:
    """What ``stage_backward_input`` hands to ``stage_backward_weight`` for one microbatch.

    A sequence of :class:`ParamGroup`, each reading (and, for ``"grads"``, writing) like one of the
    dicts in the list torch's B returns (Note [param groups read like torch's] in
    ``ppbackward._param_groups``); pass it to :func:`ppbackward.stage_backward_weight` exactly once.

    See Note [param_groups hold no cycle] in this module.
    """

    __slots__ = (
        "_consumed", "_groups", "_hooked_in_b", "_owners", "_pinned", "_shapes", "_versions", "_weight_only", "_weights"
    )

    def __init__(
        self,
        groups: list[ParamGroup],
        weights: WeightSet,
        owners: tuple[Node, ...] = (),
        pinned: list | None = None,
        hooked_in_b: list[tuple[torch.Tensor, tuple[int, ...]]] | None = None,
        weight_only: list[Node] | None = None,
    ) -> None:
        self._groups = groups
        for i, group in enumerate(groups):
            group._index = i
        self._weights = weights
        self._owners = owners  # Note [custom Function nodes need an owner] (ppbackward._node_owner)
        self._pinned = pinned or []  # Note [outputs detached after B] (ppbackward._saved)
        self._hooked_in_b = hooked_in_b or []  # Note [W mutes B's hooks]
        # the weight-only nodes W's accumulating calls run that saved tensors (Note [saved tensors W reads are checked])
        self._weight_only = weight_only or []
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
            for region in group.regions:  # what a compiled region's weight half reads, versions as B left them
                for g, v in region.pending.versions:
                    versions[id(g)] = (g, v)
            for g, v in group.taken.values():  # a matmul's mat1 B took out, its version then
                versions[id(g)] = (g, v)
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
        with CLAIM_LOCK:
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
            work = _weight_work(run)
            yield work._replace(first_chunk=False) if i else work

    def _check_unchanged(self, weights: list[torch.Tensor]) -> None:
        """Raise naming the gradient or parameter changed in place since B (Note [captured gradients
        are checked at W]), or the weight-only node that cannot read a tensor it saved (Note [saved tensors W reads
        are checked]); ``weights`` (W's) name the parameters."""
        self._check_versions(self._groups, during_w=False)
        for node in self._weight_only:  # Note [saved tensors W reads are checked]: these first, as nothing has run
            found = unreadable_saved(node)
            if found is not None:
                raise _unreadable_error(_group_of(self._groups, node), node, "a weight-only node W runs", *found, True)
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
                    for region in group.regions:
                        read += [versions[id(g)] for g, _ in region.pending.versions]
                    for g, _ in group.taken.values():
                        read.append(versions[id(g)])
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
        for group in self._groups:  # a weight half W did not run (it raised, or an earlier chunk did)
            for region in group.regions:
                region.pending.drop()
        self._groups = []
        self._owners = ()
        self._pinned = []
        self._hooked_in_b = []
        self._weight_only = []
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
    regions: list[RegionCall] = []
    taken: dict = {}
    for group in groups:
        if group.taken:
            taken.update(group.taken)
        if group._written is None:  # w_work's common case inline (Note [no frame per node] in ppbackward.backward)
            calls += group.calls
            ready += group.ready
            regions += group.regions
            continue
        group_calls, group_ready, group_regions = group.w_work()
        calls += group_calls
        ready += group_ready
        regions += group_regions
    inputs = [edge for group in groups for edge in group.inputs]  # one frame
    return WeightWork(calls, ready, inputs, regions, taken, groups, True)  # _chunks marks the later chunks

# code that checks what it holds (``isinstance(groups, Sequence)``) sees the form of torch's list of dicts
# (ParamGroup is registered as a Mapping in ppbackward._param_groups)
collections.abc.Sequence.register(ParamGroups)


def _captured_grads(group: ParamGroup) -> Iterator[torch.Tensor]:
    """The gradient tensors B captured for ``group``."""
    for call in group.calls:
        yield from (g for g in call.grads if g is not None)
    for c in group.ready:
        yield c.grad


def unreadable_saved_error(work: WeightWork, calls: list[NodeCall]) -> StageBackwardError | None:
    """Once W's call of the intermediates ``calls`` of ``work`` raised: the refusal naming the param group, the
    node and the saved tensor it could not read, or ``None`` where every call can read what it saved (W's error
    is another one: re-raise it). Note [saved tensors W reads are checked]."""
    for call in calls:  # plain loop (Note [no frame per node] in ppbackward.backward)
        node = call[0]
        if isinstance(node, BackwardCFunction):  # B released what a custom Function saved (reading it raises
            continue  # "freed"); the ones W may run again saved nothing, writes for the others are refused
        found = unreadable_saved(node)
        if found is None:
            continue
        label = next((g._label() for g in work.groups for c in g.w_work()[0] if c[0] is node), "param_groups")
        return _unreadable_error(
            label, node, "an intermediate W calls again for its weight gradients", *found, work.first_chunk
        )
    return None


def refuse_unreadable_in_b(nodes: list[Node]) -> None:
    """Raise naming the first of ``nodes`` (weight-only nodes B would run) that cannot read a tensor it saved
    (Note [a weight-only node B runs was freed before]).

    Raises:
        StageBackwardError: also a ``ValueError``; the node, the saved tensor's name, autograd's reason and what
            to do. Nothing has run.
    """
    for node in cpp_nodes_saving(nodes):
        found = unreadable_saved(node)
        if found is None:
            continue
        name, cause = found
        if _CHANGED_IN_PLACE in str(cause):
            why = ("a tensor it saved was changed in place since the forward (a parameter an optimizer stepped in "
                   "between): run the forward again after the change")
        else:
            why = ("an earlier backward freed it: a weight computed once and used by several microbatches (e.g. "
                   "under torch.nn.utils.parametrize.cached(), or a product of parameters taken once per step) is "
                   "freed by the first microbatch's B, which runs its node as a full backward does; compute it in "
                   "each microbatch's forward")
        raise BadValue(
            f"stage_backward_input: {node.name()}, a weight-only node B runs for a weight gradient it computes itself "
            f"(a bias, a norm weight or an elementwise scale), cannot read its saved '{name}': {_autograd_said(cause)} "
            f"So {why}. Nothing was run"
        )


_CHANGED_IN_PLACE = "modified by an inplace operation"  # autograd's version-counter error, torch 2.5-2.15


def _autograd_said(cause: RuntimeError) -> str:
    """The reason in ``cause`` (autograd's, or the check of a tensor B pinned) without autograd's advice (its hint
    about anomaly mode, its "Specify retain_graph=True"), which names calls B and W make for the caller."""
    said = str(cause).split(" Hint: ")[0]
    return said.split(" Saved intermediate values of the graph are freed")[0].strip()


def _unreadable_error(
    label: str, node: Node, what: str, name: str, cause: RuntimeError, first_chunk: bool
) -> StageBackwardError:
    """The refusal of Note [saved tensors W reads are checked]: ``node`` (``what`` it is to W) of the group
    ``label`` cannot read its saved ``name`` (autograd's ``cause``)."""
    said = _autograd_said(cause)
    head = (
        f"{label}: {node.name()}, {what}, cannot read its saved '{name}': {said} W reads what the forward saved for "
        "it as it was at B: a tensor changed in place since (a stage input, an activation, a parameter), or a graph "
        "another backward freed (a weight computed once and used by several microbatches, freed by the first one's "
        "W or backward), cannot be used"
    )
    if first_chunk:
        return StageBackwardError(f"{head}; W accumulates nothing")
    return StageBackwardError(
        f"{head}; W runs this stage in chunks: the earlier chunks were accumulated, this one and the later ones "
        "were not"
    )


def _group_of(groups: list[ParamGroup], node: Node) -> str:
    """How errors name the group whose weights a weight-only ``node`` leads to (``param_groups`` if none is found)."""
    leaves: set[Node] = set()
    seen = {node}
    todo = [node]
    while todo:  # the weight-only subgraph below the node (an error path)
        for kid, _ in todo.pop().next_functions:
            if kid is None or kid in seen:
                continue
            seen.add(kid)
            if is_accumulate_grad(kid):
                leaves.add(kid)
            else:
                todo.append(kid)
    return next((g._label() for g in groups if any(leaf in leaves for leaf in g._leaves)), "param_groups")


def _changed_gradient(
    groups: list[ParamGroup], grad: torch.Tensor, version: int, during_w: bool = False
) -> StageBackwardError:
    where = "a gradient"
    keep = (
        "Keep a microbatch's output gradients (e.g. a receive buffer) and the input gradients B returned (where a "
        "gradient reaches a stage input unchanged, B returns the tensor it holds for W) unchanged until its W"
    )
    for group in groups:
        for call in group.calls:
            for i, g in enumerate(call.grads):
                if g is grad:
                    where = f"the gradient B captured for {call.node.name()}'s input {i}"
        for c in group.ready:
            if c.grad is grad:
                where = f"the gradient B captured for the edge into {c.edge.node.name()} (input {c.edge.output_nr})"
        for region in group.regions:
            if any(g is grad for g, _ in region.pending.versions):
                where = f"a tensor the weight half of compiled region {region.node.name()} reads (held since B)"
        for node, (g, _) in group.taken.items():
            if g is grad:
                where = f"the input {node.name()} saved for its weight gradient ({group._label()}, held since B)"
                keep = "An activation W reads must not change between B and W (a full backward would refuse it too)"
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
        f"values. {keep}; W accumulates nothing"
    )
