"""What B does to saved tensors: release those W will never read, pin those a caller may detach, and
tell which carry saved-tensor hooks.

Private module. Between B and W a stage keeps the autograd graph of every microbatch in flight. W
only runs the intermediates and the weight-only subgraphs (Note [W computes only weight edges] in
``ppbackward._weight_edges``); every other node of the graph already ran in B and never runs again, yet
its saved tensors (activation inputs, softmax outputs, attention's q/k/v ...) would stay alive
until W returns, because the intermediates' ``next_functions`` keep those nodes alive.

Note [release unread saved tensors]: for each such node, every ``grad_fn._raw_saved_*`` saved
tensor gets hooks through the public saved-tensor API (``SavedTensor.register_hooks``): the pack
hook, called at once, returns ``None``, so the node drops its reference to the tensor; the unpack
hook raises a clear error should anything ever try to run that node again. A saved tensor that
already has hooks (activation checkpointing, CPU offloading, a user's ``saved_tensors_hooks``) is
left alone: its owner manages its memory. Nodes are never otherwise mutated (no ``metadata``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node

from ppbackward._plain import plain_autograd

__all__ = [  # private module: what other modules use
    "HOOKS_VISIBLE",
    "cpp_nodes_saving",
    "holds_saved_tensors",
    "hook_kinds",
    "observing_only",
    "pin_saved_inputs",
    "release_pinned",
    "release_saved_tensors",
    "saved_tensors",
    "unreadable_saved",
]

# Note [hooked saved tensors run once]: a saved tensor with hooks (activation checkpointing, a
# ``saved_tensors_hooks`` pair such as ``save_on_cpu``, offloading, a user's own) is unpacked by its
# unpack hook each time its node runs, and holds what its pack hook returned until the engine releases
# the node. A full backward runs every node once, in one engine call, with ``retain_graph=False``. The
# split runs B's nodes in B and calls the intermediates again in W, so, left alone, a hooked
# intermediate would be unpacked twice: a non-reentrant checkpoint recomputes its region once per
# engine call (and a selective one refuses the second time: "backward an extra time"), and other hooks
# run twice. And B must retain the graph for W, so nothing it runs is released: hooked tensors W never
# reads stay packed until the graph dies, and a pack hook that returns the tensor itself makes a node
# that saved its own output hold itself (node -> packed tensor -> grad_fn -> node), a cycle inside C++
# that the gc cannot see and nothing ever breaks (Python cannot release a node's saved tensors).
#
# So B does W's work itself wherever hooks are (``ppbackward._graph.eager_work``): every node of W's
# that has a checkpoint's saved tensors (:func:`hook_kinds`: ``"recompute"``), with whatever feeds it,
# runs entirely in B, in the engine call that recomputed the region; and where any node B runs holds a
# tensor through another hook (``"held"``), all of W's nodes run in B, so that nothing is left for W
# to call and B's engine call can release every node it runs (``retain_graph=False``). Each hooked
# tensor is then unpacked once, as in a full backward; W accumulates what B computed. Hooks that only
# observe (``ppbackward.leaks.track_activations``'s own, marked by ``observing_only``) count as no
# hooks. On a torch whose ``SavedTensor`` does not expose its hooks (before 2.13) nothing can be told
# apart: hooked tensors are treated as before (unpacked twice, kept until the graph dies).
#
# An in-place op on a view (``h[0].mul_(w)``) is a ``CopySlices`` node wrapping the op's own node, whose
# saved tensors Python cannot see: B cannot tell whether hooks hold them. So a ``CopySlices`` that W
# would call again counts as ``"recompute"``: B runs it (and what feeds it) entirely, and W never
# unpacks what it saved a second time. A ``CopySlices`` only B runs is run once anyway; its saved
# tensors, out of reach of the release, then live until the graph dies (after W).

_CHECKPOINT_HOLDER = getattr(torch.utils.checkpoint, "_Holder", None)
HOOKS_VISIBLE = hasattr(torch._C._autograd.SavedTensor, "unpack_hook")
# ``SavedTensor.data``: the saved tensor as stored (a saved input with its grad_fn), without unpacking
_DATA_VISIBLE = HOOKS_VISIBLE and hasattr(torch._C._autograd.SavedTensor, "data")

# node type -> its ``_raw_saved_*`` attribute names, for the C++ node types only (they live as long as torch).
# A custom Function's backward class (a compiled region's too) is made with its Function, which may be defined
# anywhere and die (a recompile makes a new one): kept here, it would keep its Function and what that holds
# (a compiled graph) alive. Every such class has its base's attributes.
_ATTRS: dict[type, tuple[str, ...]] = {}
_FUNCTION_ATTRS = tuple(a for a in dir(BackwardCFunction) if a.startswith("_raw_saved_"))


def _saved_attrs(node: Node) -> tuple[str, ...]:
    kind = type(node)
    attrs = _ATTRS.get(kind)
    if attrs is None:
        if isinstance(node, BackwardCFunction):
            return _FUNCTION_ATTRS
        attrs = _ATTRS[kind] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
    return attrs


def _copy_slices_type() -> type | None:
    with plain_autograd():  # Note [probes run in plain autograd]
        base = torch.zeros(2, requires_grad=True).clone()
        base[0].mul_(2.0)
    return type(base.grad_fn) if type(base.grad_fn).__name__ == "CopySlices" else None


_COPY_SLICES = _copy_slices_type()


# The pack hook of a release: keeps an int (the tensor's id) instead of the tensor. A builtin, so the engine's
# call of it runs no Python frame (one per saved tensor released, about 70 per B of a 4-layer stage).
_drop = id


def _refuse(_packed):
    raise RuntimeError(
        "ppbackward released this saved tensor after stage_backward_input (B): the node that saved "
        "it is not needed by stage_backward_weight (W). Running it again (e.g. a second backward "
        "through the same graph) is not supported; see Note [release unread saved tensors]."
    )


_TRANSPARENT = "_ppbackward_transparent"  # the mark of a saved-tensor hook that counts as none (above)
_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def observing_only(unpack: _Hook) -> _Hook:
    """Mark a saved-tensor unpack hook that only observes (it returns the very tensor autograd saved): B and W
    then treat what it unpacks as unhooked (Note [hooked saved tensors run once]). Returns ``unpack`` itself;
    usable as a decorator, on a method too."""
    setattr(unpack, _TRANSPARENT, True)
    return unpack


def _kind(raw: object) -> str | None:
    unpack = getattr(raw, "unpack_hook", None)
    if unpack is None or getattr(unpack, _TRANSPARENT, False):
        return None
    if unpack is _refuse or unpack is _unpin:  # an earlier B's own (Note [B claims its outputs])
        return "released"
    if _CHECKPOINT_HOLDER is not None and isinstance(raw.data, _CHECKPOINT_HOLDER):  # type: ignore[attr-defined]
        return "recompute"
    return "held"


def _saved_items(node: Node) -> Iterator[Any]:
    """Each ``SavedTensor`` (or ``None``) of ``node``'s ``_raw_saved_*`` attributes, lists flattened;
    nothing from an attribute already freed (:func:`_saved_values`, flattened)."""
    for saved in _saved_values(node):
        yield from saved if isinstance(saved, (list, tuple)) else (saved,)


# Note [reading saved tensors]: a node's saved tensors can be read two ways, and which one a reader
# needs depends on what it does with them. Each ``_raw_saved_<name>`` attribute is a ``SavedTensor``
# (or a list of them, or ``None``); ``_saved_<name>`` is the same value *unpacked*.
#
# * ``unpack=False`` reads ``SavedTensor.data``: the tensor as stored, or, where saved-tensor hooks were
#   active at save time, the object the pack hook returned (counted when it is a tensor or a tuple/list
#   of tensors). No hook runs, nothing is allocated, the graph is not touched. For readers that must not
#   change what they look at: the leak checker and its back-reference chains (``ppbackward.leaks``) on a
#   user's graph, whatever hooks it carries. Before torch 2.13 (no ``SavedTensor.data``) it reads
#   nothing.
# * ``unpack=True`` reads ``_saved_<name>``, which runs the unpack hook of a hooked tensor: a
#   non-reentrant checkpoint recomputes its region (and allocates it again), ``save_on_cpu`` copies back
#   to the device, a user's hook runs its own code; a tensor ppbackward released after B
#   (Note [release unread saved tensors]) raises and is skipped; one it pinned (Note [outputs detached
#   after B]) gives the alias it holds, whose storage is the one the graph keeps alive. For a reader
#   that wants the tensors as the backward would see them on graphs with no hooks but ppbackward's own:
#   ``ppbackward._tools.memory`` (bytes held between B and W), for which a pin's holder read as stored
#   would hide the storage it keeps. Any error of the read (a freed buffer, a hook that raises, a node
#   type without ``_saved_<name>``: a custom ``autograd.Function``'s node) skips that attribute.
#
# Attribute names come from the per-type cache (``_saved_attrs``), as B's own reads do.


def saved_tensors(node: Node, *, unpack: bool) -> list[torch.Tensor]:
    """The tensors ``node`` saved for backward, read as stored or unpacked (Note [reading saved tensors]).

    Args:
        node: an autograd node (``tensor.grad_fn``, or one of its ``next_functions``).
        unpack: ``False``: read ``SavedTensor.data`` (no hook runs; a hooked tensor gives what its pack
            hook returned, tensors in a tuple/list of it included). ``True``: read ``_saved_<name>``, which
            runs each hooked tensor's unpack hook (a checkpoint recomputes its region).

    Returns:
        The tensors, in attribute order, lists flattened; attributes already freed, values that are not
        tensors, and reads that raise are left out. Never raises for a node that saves nothing.
    """
    if not unpack:
        found: list[torch.Tensor] = []
        for item in _saved_items(node):
            try:
                data = item.data
            except (AttributeError, RuntimeError):  # None, freed, or a torch without SavedTensor.data
                continue
            if isinstance(data, torch.Tensor):
                found.append(data)
            elif isinstance(data, (tuple, list)):
                found.extend(t for t in data if isinstance(t, torch.Tensor))
        return found
    found = []
    for attr in _saved_attrs(node):
        try:
            value = getattr(node, "_saved_" + attr[len("_raw_saved_") :])
        except Exception:  # freed (by the engine or ppbackward's release), a hook raised, or no such name
            continue
        values = value if isinstance(value, (list, tuple)) else (value,)
        found.extend(t for t in values if isinstance(t, torch.Tensor))
    return found


def _saved_values(node: Node) -> Iterator[Any]:
    """The raw value of each of ``node``'s ``_raw_saved_*`` attributes (a ``SavedTensor``, a list of
    them, or ``None``); nothing from an attribute already freed. The attribute names are read once per
    node type (``_ATTRS``), so a node type that saves nothing costs one dict lookup."""
    attrs = _ATTRS.get(type(node))  # the cache read inline (B's hot path); filled by _saved_attrs
    if attrs is None:
        attrs = _saved_attrs(node)
    for attr in attrs:
        try:
            yield getattr(node, attr)
        except RuntimeError:  # already freed
            continue


_RANK = {"recompute": 1, "held": 2, "released": 3}  # what hook_kinds keeps for a node: the highest


def hook_kinds(nodes: Iterable[Node]) -> dict[Node, str]:
    """The nodes with hooked saved tensors (Note [hooked saved tensors run once]): ``"released"`` where an
    earlier B released or pinned one of them (Note [B claims its outputs] in ``ppbackward.backward``),
    else ``"held"`` where any of them is held through a hook other than a checkpoint's, else
    ``"recompute"`` (also every ``CopySlices``, whose saved tensors are hidden). ``{}`` on a torch that
    does not expose the hooks (``HOOKS_VISIBLE``). One read of each saved attribute; items without an
    unpack hook (the common case) cost one attribute read each."""
    if not HOOKS_VISIBLE:
        return {}
    kinds: dict[Node, str] = {}
    cache = _ATTRS
    for node in nodes:  # Note [no frame per node]: loops inline, no generator or helper per node
        kind_of = type(node)
        if kind_of is _COPY_SLICES:  # its saved tensors are out of Python's sight
            kinds.setdefault(node, "recompute")
        attrs = cache.get(kind_of)
        if attrs is None:
            attrs = _saved_attrs(node)
        for attr in attrs:
            try:
                value = getattr(node, attr)
            except RuntimeError:  # already freed
                continue
            for item in value if isinstance(value, (list, tuple)) else (value,):
                unpack = getattr(item, "unpack_hook", None)
                if unpack is None or getattr(unpack, _TRANSPARENT, False):
                    continue
                # _kind inline (Note [no frame per node] in ppbackward.backward)
                if unpack is _refuse or unpack is _unpin:
                    kind = "released"
                elif _CHECKPOINT_HOLDER is not None and isinstance(item.data, _CHECKPOINT_HOLDER):
                    kind = "recompute"
                else:
                    kind = "held"
                if _RANK[kind] > _RANK.get(kinds.get(node, ""), 0):
                    kinds[node] = kind
    return kinds


def unreadable_saved(node: Node) -> tuple[str, RuntimeError] | None:
    """The first tensor ``node`` saved that its backward could not read now (changed in place since it was
    saved, or freed) as ``(its name, torch's error)``, or ``None`` (Note [saved tensors W reads are checked]
    in ``ppbackward._handoff``). Read as the node's backward reads it (``_saved_<name>``: autograd's version
    check; for a tensor B pinned, ppbackward's own: Note [outputs detached after B]; through the tracker's
    hooks, which count as none). An attribute holding a tensor through a caller's saved-tensor hooks is not
    read (its unpack hook would run once more); on a torch that does not show the hooks (before 2.13) nothing
    is read."""
    if not HOOKS_VISIBLE:
        return None
    for attr in _saved_attrs(node):
        name = attr[len("_raw_saved_") :]
        try:
            raw = getattr(node, attr)
            hooked = False  # through a caller's hook: one _kind sees (not none, not the tracker's), not B's pin
            for item in raw if isinstance(raw, (list, tuple)) else (raw,):
                if _kind(item) is not None and item.unpack_hook is not _unpin:
                    hooked = True
            if not hooked:
                getattr(node, "_saved_" + name)
        except RuntimeError as e:
            return name, e
    return None


def cpp_nodes_saving(nodes: Iterable[Node]) -> list[Node]:
    """The C++ nodes among ``nodes`` whose type saves tensors for backward (``_raw_saved_*`` attributes, read once
    per type); not custom ``autograd.Function`` nodes. What each holds now is not read (see
    :func:`holds_saved_tensors`). One call for all: a node whose type saves nothing costs a dict read."""
    found: list[Node] = []
    cache = _ATTRS
    for node in nodes:  # Note [no frame per node] in ppbackward.backward
        attrs = cache.get(type(node))
        if attrs is None:
            if isinstance(node, BackwardCFunction):
                continue
            attrs = _saved_attrs(node)
        if attrs:
            found.append(node)
    return found


def holds_saved_tensors(node: Node) -> bool:
    """Whether ``node`` holds a tensor it saved for backward now (``False`` once the engine freed it)."""
    return any(item is not None for item in _saved_items(node))


def release_saved_tensors(nodes: Iterable[Node]) -> int:
    """Make ``nodes`` drop their saved tensors (Note [release unread saved tensors]).

    Args:
        nodes: autograd nodes that already ran and will never run again.

    Returns:
        The number of saved tensors released.
    """
    released = 0
    cache = _ATTRS
    for node in nodes:  # Note [no frame per node]
        attrs = cache.get(type(node))
        if attrs is None:
            attrs = _saved_attrs(node)
        for attr in attrs:
            try:
                value = getattr(node, attr)
            except RuntimeError:  # already freed
                continue
            for item in value if isinstance(value, (list, tuple)) else (value,):
                try:
                    item.register_hooks(_drop, _refuse)
                except (RuntimeError, AttributeError):  # already has hooks, undefined / freed, or None
                    continue
                released += 1
    return released


# --- pinning --------------------------------------------------------------------------------------

# Note [outputs detached after B]: after B the caller may detach the stage outputs in place: torch's
# PipelineStage does so on the last stage (``t.detach_()`` on every non-view output, right after B),
# and torch's own B did so on every stage. A node that saved such a tensor as one of its *inputs*
# cannot use it any more ("Trying to use a saved tensor that has been detached in-place"): autograd
# reads the saved input's grad_fn from the tensor itself, which the in-place detach cleared. (A saved
# *output* keeps what it needs, and a leaf has no grad_fn to lose.) If W runs such a node, W fails:
# e.g. a last stage whose input needs no grad (a frozen prefix before a LoRA adapter) leaves the whole
# graph to W, loss included, and the loss node saved the stage output.
#
# So B pins, through the public saved-tensor API, every saved non-leaf input of the nodes W will run
# that may hold a stage output: the consumers of the outputs B was given, and, when B was given a loss
# (the stage outputs themselves are then unknown to it), every node W will run. ``register_hooks``
# records the tensor's grad_fn when it is called, so a later in-place detach no longer matters; the
# pack hook gets a detached alias (same storage: no copy, no memory) and keeps it in a holder with the
# version it had, and the unpack hook checks that version (hooks switch off autograd's own check) and
# returns the alias. That version is the one at B, so a tensor is pinned only once autograd's own check
# passes (it is unpacked first): one changed in place between the forward and B is left unpinned, for
# autograd to refuse in W as a full backward would. W empties the holders once it is done (Note
# [release unread saved tensors] cannot re-register hooks on these), so nothing outlives W. Saved
# tensors that already have hooks (checkpointing, offloading) carry their own grad_fn the same way and
# are left alone.
# B tells leaves and outputs apart by the saved tensor as stored (``SavedTensor.data``, torch 2.13+),
# so a hooked one's unpack hook never runs for it (Note [hooked saved tensors run once]); before 2.13
# only the node's ``_saved_*`` value tells, and reading it unpacks a hooked tensor once more.


class _Pinned:
    """A pinned saved tensor: the detached alias and the version it was saved at; empty once released."""

    __slots__ = ("alias", "version")

    def __init__(self, alias: torch.Tensor) -> None:
        self.alias: torch.Tensor | None = alias
        self.version = alias._version

    def release(self) -> None:
        self.alias = None


class _PinHook:
    """The pack hook of one :func:`pin_saved_inputs` call: makes a holder per tensor and lists it (a plain
    object, no closure: Note [no closure cycle] in ``ppbackward.backward``)."""

    __slots__ = ("pinned",)

    def __init__(self) -> None:
        self.pinned: list[_Pinned] = []

    def __call__(self, alias: torch.Tensor) -> _Pinned:
        holder = _Pinned(alias)
        self.pinned.append(holder)
        return holder


def _unpin(pinned: _Pinned) -> torch.Tensor:
    alias = pinned.alias
    if alias is None:
        raise RuntimeError(
            "ppbackward released this saved tensor when stage_backward_weight (W) finished; running the "
            "node again (a second backward through the same graph) is not supported. See Note [outputs "
            "detached after B] in ppbackward._saved."
        )
    if alias._version != pinned.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{alias.dtype} {list(alias.shape)}] is at version {alias._version}; expected version "
            f"{pinned.version} instead. (Checked by ppbackward, whose saved-tensor hooks replace autograd's "
            "own check for tensors pinned after B: Note [outputs detached after B].)"
        )
    return alias


def pin_saved_inputs(nodes: Iterable[Node]) -> list[_Pinned]:
    """Pin every saved non-leaf input of ``nodes`` (Note [outputs detached after B]).

    Args:
        nodes: autograd nodes that W will run.

    Returns:
        The holders, for :func:`release_pinned` once W is done.
    """
    pack = _PinHook()
    if _DATA_VISIBLE:
        for node in nodes:
            for item in _saved_items(node):
                # A hooked item keeps its grad_fn itself; reading its data never runs its unpack hook.
                if item is not None and item.unpack_hook is None:
                    _pin(item, item.data, node, pack)
        return pack.pinned
    for node in nodes:  # before torch 2.13: the value, read through the node (unpacks hooked items)
        for attr in _saved_attrs(node):
            try:
                raw = getattr(node, attr)
                value = getattr(node, "_saved_" + attr[len("_raw_saved_") :])
            except (RuntimeError, AttributeError):  # freed, or modified in place: W raises autograd's error
                continue
            items = raw if isinstance(raw, (list, tuple)) else (raw,)
            values = value if isinstance(value, (list, tuple)) else (value,)
            for item, t in zip(items, values):
                _pin(item, t, node, pack, checked=True)  # read through the node: autograd checked its version
    return pack.pinned


def _pin(item: Any, t: object, node: Node, pack: _PinHook, checked: bool = False) -> None:
    if not isinstance(t, torch.Tensor) or t.grad_fn is None or t.grad_fn is node:
        # not a tensor, a leaf, or the node's own output (stored without its grad_fn): nothing to lose, and an
        # output could not be unpacked below without its node
        return
    try:
        if not checked:
            # the version the pin records is the one now: the tensor must still be the one the forward saved,
            # or the pin would hide autograd's check (changed in place between the forward and B)
            item.unpack()
        item.register_hooks(pack, _unpin)
    except RuntimeError:  # already has hooks (its owner keeps its grad_fn), or changed since saved: autograd refuses it
        pass


def release_pinned(pinned: Iterable[_Pinned]) -> None:
    """Drop the aliases :func:`pin_saved_inputs` kept (W is done with them)."""
    for holder in pinned:
        holder.release()
