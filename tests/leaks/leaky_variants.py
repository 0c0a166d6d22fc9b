"""Tests-only leaky variants (negative controls) for ``ppbackward.leaks``, each beside its fixed twin.

Written by us after the public reports, not copied from torch. Every variant runs one pipeline-stage
step on a tiny stage (Linear 8->16, Tanh, Linear 16->8; batch 2) and returns nothing, so whatever
survives the call is held by a reference cycle or by a live reference, never by the caller.

Sizes (float32, batch 2): a stage output or its grad is 2*8*4 = 64 bytes; a hidden activation or
its grad is 2*16*4 = 128 bytes.
"""

from __future__ import annotations

import functools

import torch

from ppbackward.leaks._heap import instances_of

BATCH, IN, HIDDEN = 2, 8, 16
OUT_BYTES = BATCH * IN * 4  # 64
HIDDEN_BYTES = BATCH * HIDDEN * 4  # 128


def make_stage(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, IN))


def make_input(requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(BATCH, IN, requires_grad=requires_grad)


# -- (1) pytorch/pytorch#136507's kind: a recursive nested closure ---------------------------------
def closure_leak_backward(stage: torch.nn.Module) -> None:
    """torch 2.4's ``stage_backward`` kind: the nested ``extract`` refers to itself (recursion through
    its own closure cell) and to the lists of outputs and grads, so function, cells, lists and the
    two outputs and two grads form cyclic garbage after the call: 4 tensors, 4 * 64 bytes."""
    x = make_input()
    outputs = (stage(x), stage(x) * 2)
    grads = (torch.ones_like(outputs[0]), torch.ones_like(outputs[1]))
    tensors: list[torch.Tensor] = []
    tensor_grads: list[torch.Tensor] = []

    def extract(out: object, grad: object) -> None:
        if isinstance(out, torch.Tensor):
            tensors.append(out)
            tensor_grads.append(grad)  # type: ignore[arg-type]
        else:
            for o, g in zip(out, grad):  # type: ignore[call-overload]
                extract(o, g)  # the self-reference that closes the cycle

    extract(outputs, grads)
    torch.autograd.backward(tensors, tensor_grads)


def clean_backward(stage: torch.nn.Module) -> None:
    """The fixed twin of :func:`closure_leak_backward`: no nested self-referring function."""
    x = make_input()
    outputs = (stage(x), stage(x) * 2)
    grads = (torch.ones_like(outputs[0]), torch.ones_like(outputs[1]))
    torch.autograd.backward(list(outputs), list(grads))


# -- (2) pytorch/pytorch#136584's kind: param groups kept alive through a hook -----------------------
def param_group_leak_backward(stage: torch.nn.Sequential, fixed: bool = False) -> None:
    """torch 2.5's zero-bubble split kind. B registers a pre-hook on the intermediate node (where the
    input path meets the weights: the first Linear's ``AddmmBackward0``) that stores the node's grad
    in a param-group dict; the dict keeps the intermediate nodes and the grads for W. W consumes
    them but never removes the hook nor clears the dict. Cycle: node -> its pre-hooks -> hook ->
    cell -> group dict -> list -> node; the grad (128 bytes) hangs off it: 1 tensor, 1 node.
    ``fixed=True`` is torch 2.6's fix (remove the hook, delete the group's intermediates and grads)."""
    x = make_input()
    hidden = stage[0](x)
    out = stage[2](torch.tanh(hidden))
    node = hidden.grad_fn
    group: dict = {"params": list(stage[0].parameters()), "intermediates": [node], "grads": None}

    def keep_grads(grad_outputs: tuple) -> None:
        group["grads"] = list(grad_outputs)

    handle = node.register_prehook(keep_grads)
    del hidden, node
    # B: input grads only; the graph is kept for W
    torch.autograd.grad(out, [x], grad_outputs=torch.ones_like(out), retain_graph=True)
    # W: weight grads from the intermediate and its stored grad
    edges = [torch.autograd.graph.GradientEdge(n, 0) for n in group["intermediates"]]
    weight_grads = torch.autograd.grad(edges, group["params"], grad_outputs=group["grads"])
    for p, g in zip(group["params"], weight_grads):
        p.grad = g if p.grad is None else p.grad + g
    if fixed:
        handle.remove()
        del group["intermediates"], group["grads"]


# -- (3) a cycle of autograd nodes and dicts only ------------------------------------------------------
def _count_call(state: dict, grad_inputs: object, grad_outputs: object) -> None:
    state["calls"] += 1


def node_cycle_leak(stage: torch.nn.Module) -> None:
    """A grad_fn hook whose state dict refers back to the grad_fn: node -> its hooks dict -> partial ->
    args -> state dict -> node. No Python tensor is in the garbage, yet the node pins the stage output
    it saved (``SinBackward0`` saves its input: 64 bytes), and through its edges the whole stage graph."""
    act = stage(make_input())
    y = act.sin()
    state = {"node": y.grad_fn, "calls": 0}
    y.grad_fn.register_hook(functools.partial(_count_call, state))


# -- (4) a live module-level list (no cycle) ---------------------------------------------------------
RETAINED: list[torch.Tensor] = []


def retaining_step(stage: torch.nn.Sequential) -> None:
    """A debugging cache that keeps the hidden activation (128 bytes) in a module-level list. Nothing is
    cyclic, so the leak checker reports 0; only the activation tracker sees it held after gc."""
    x = make_input()
    hidden = torch.tanh(stage[0](x))
    RETAINED.append(hidden)
    stage[2](hidden).sum().backward()


def clean_step(stage: torch.nn.Sequential) -> None:
    """The fixed twin of :func:`retaining_step`."""
    x = make_input()
    stage[2](torch.tanh(stage[0](x))).sum().backward()


# -- (5) pytorch/pytorch#136678's kind: a cycle through node.metadata, invisible to gc ------------------
_METADATA_KEY = "ppbackward_tests_reverse_edges"


def metadata_cycle_leak(stage: torch.nn.Module) -> None:
    """Reverse edges stored in ``node.metadata`` that refer to the node itself: the metadata dict is
    owned by the C++ node and not traversed by gc, so the cycle is never collected and never appears
    in ``gc.garbage``. The stage output saved by ``SinBackward0`` (64 bytes) stays alive for good."""
    act = stage(make_input())
    y = act.sin()
    y.grad_fn.metadata[_METADATA_KEY] = {"node": y.grad_fn}


def break_metadata_cycles() -> int:
    """Clear the cycles :func:`metadata_cycle_leak` made (found by a heap scan); returns how many."""
    broken = 0
    sin_backward = type(torch.zeros(1, requires_grad=True).sin().grad_fn)
    for obj in instances_of(sin_backward):  # safe beside other threads: Note [heap scans beside other threads]
        if _METADATA_KEY in obj.metadata:
            obj.metadata.clear()
            broken += 1
    return broken
