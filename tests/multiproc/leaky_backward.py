"""Test-only: a deliberately leaky stage backward, the negative control of ``tests/multiproc``.

Loaded by the worker with ``--backward leaky:<path to this file>``, which calls :func:`install`. It wraps
the three functions ``ppbackward.install()`` puts in for the installed torch (exact grads, no leak of
their own -- torch 2.5's own functions leak, which would blur the counts) and adds one leak per call of
``stage_backward`` or
``stage_backward_input`` -- exactly one of the two runs once per stage per microbatch (stage 0 of a
zero-bubble schedule skips B and runs a full backward at W time). The kind comes from the environment
variable ``PPBACKWARD_LEAK_KIND``:

* ``cycle`` (default) -- pytorch/pytorch#136507's kind: a recursive nested closure that refers to
  itself and to a list holding the stage's first output tensor and that tensor's ``grad_fn`` (torch
  2.15 hands a released output over as a ``GradientEdge``: then its first input tensor and the edge's
  node). Every call leaves exactly **1 tensor and 1 autograd node** in a reference cycle.
* ``live`` -- a module-level list keeps the stage's tensor inputs (``input_values``) alive. The stage's
  first op saved each of them for backward, so every call keeps **1 saved activation** alive past
  the step through a live reference (per model input; 1 for the ``mlp`` model). Nothing is cyclic.
* ``cxx-cycle`` -- the kind of Note [leaks the gc cannot see] (``ppbackward.leaks``): under a pack hook
  that returns the tensor itself, a ``tanh`` of the stage's first output (its first input, for an
  edge) saves its own output, and is backpropagated with ``retain_graph=True``. The node then holds
  itself through C++ (node -> packed tensor -> grad_fn -> node): every call leaves **1 autograd node
  and 1 packed tensor** alive for ever, and nothing in ``gc.garbage``.

Nothing here is imported by ``ppbackward``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

_NAMES = ("stage_backward", "stage_backward_input", "stage_backward_weight")
_MODULES = ("torch.distributed.pipelining._backward", "torch.distributed.pipelining.stage")
_ORIGINALS: dict[str, Any] = {}
KEPT_ALIVE: list[torch.Tensor] = []  # the ``live`` kind's module-level list


def _first_root(obj: Any) -> torch.Tensor | GradientEdge | None:
    """The first output tensor, or ``GradientEdge`` (torch 2.15's stand-in for a released output)."""
    if isinstance(obj, (torch.Tensor, GradientEdge)):  # an edge is a tuple too: checked first
        return obj
    if isinstance(obj, (tuple, list)):
        for item in obj:
            found = _first_root(item)
            if found is not None:
                return found
    return None


def _tensor_and_node(stage_output: Any, input_values: Any) -> tuple[torch.Tensor | None, Any]:
    """What a leak holds: the stage's first output tensor and its ``grad_fn``; for a released output
    (a ``GradientEdge``: its tensor is gone), the first input tensor and the edge's node."""
    root = _first_root(stage_output)
    if isinstance(root, GradientEdge):
        inputs = [v for v in input_values if isinstance(v, torch.Tensor)]
        return (inputs[0] if inputs else None), root.node
    return root, (root.grad_fn if root is not None else None)


def _leak(stage_output: Any, input_values: Any) -> None:
    """Called *before* torch's function, which may detach the outputs (its B does)."""
    kind = os.environ.get("PPBACKWARD_LEAK_KIND", "cycle")
    if kind == "live":
        KEPT_ALIVE.extend(v for v in input_values if isinstance(v, torch.Tensor))
        return
    out, node = _tensor_and_node(stage_output, input_values)
    if out is None or node is None:
        return
    if kind == "cxx-cycle":
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            looped = torch.tanh(out.detach().requires_grad_())  # TanhBackward0 saves ``looped`` itself
        torch.autograd.grad(looped.sum(), looped.grad_fn.next_functions[0][0].variable, retain_graph=True)
        return
    held = [out, node]

    def walk(depth: int) -> list[Any]:  # refers to itself through its own closure cell: a cycle
        return held if depth == 0 else walk(depth - 1)

    walk(1)


def stage_backward(stage_output, output_grads, input_values, outputs_with_grads_idxs=None):
    _leak(stage_output, input_values)
    return _ORIGINALS["stage_backward"](stage_output, output_grads, input_values, outputs_with_grads_idxs)


def stage_backward_input(stage_outputs_or_loss, output_grads, input_values, weights):
    _leak(stage_outputs_or_loss, input_values)
    return _ORIGINALS["stage_backward_input"](stage_outputs_or_loss, output_grads, input_values, weights)


def stage_backward_weight(weights, param_groups, retain_graph=False):
    return _ORIGINALS["stage_backward_weight"](weights, param_groups, retain_graph)


def install() -> None:
    """Swap the leaky functions into both pipelining modules, wrapping what ``ppbackward.install()`` put in."""
    import ppbackward

    ppbackward.install()
    stage = importlib.import_module(_MODULES[1])
    for name in _NAMES:
        _ORIGINALS.setdefault(name, getattr(stage, name))
    for mod_name in _MODULES:
        mod = importlib.import_module(mod_name)
        for name in _NAMES:
            setattr(mod, name, globals()[name])
