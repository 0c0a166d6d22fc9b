"""Release, right after B, the saved tensors that W will never read.

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

from collections.abc import Iterable

from torch.autograd.graph import Node

__all__: list[str] = []  # private module

_ATTRS: dict[type, tuple[str, ...]] = {}  # node type -> its ``_raw_saved_*`` attribute names


def _saved_attrs(node: Node) -> tuple[str, ...]:
    kind = type(node)
    attrs = _ATTRS.get(kind)
    if attrs is None:
        attrs = _ATTRS[kind] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
    return attrs


def _drop(_tensor):
    return None


def _refuse(_packed):
    raise RuntimeError(
        "ppbackward released this saved tensor after stage_backward_input (B): the node that saved "
        "it is not needed by stage_backward_weight (W). Running it again (e.g. a second backward "
        "through the same graph) is not supported; see Note [release unread saved tensors]."
    )


def release_saved_tensors(nodes: Iterable[Node]) -> int:
    """Make ``nodes`` drop their saved tensors (Note [release unread saved tensors]).

    Args:
        nodes: autograd nodes that already ran and will never run again.

    Returns:
        The number of saved tensors released.
    """
    released = 0
    for node in nodes:
        for attr in _saved_attrs(node):
            try:
                saved = getattr(node, attr)
            except RuntimeError:  # already freed
                continue
            for item in saved if isinstance(saved, (list, tuple)) else (saved,):
                if item is None or not hasattr(item, "register_hooks"):
                    continue
                try:
                    item.register_hooks(_drop, _refuse)
                except RuntimeError:  # already has hooks, or undefined / freed
                    continue
                released += 1
    return released
