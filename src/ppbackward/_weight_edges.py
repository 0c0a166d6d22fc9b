"""W's engine work: the intermediates' weight edges, then one accumulating call.

Private module used by ``ppbackward.backward.stage_backward_weight``; see
Note [W computes only weight edges] below and Note [accumulation order] in ``ppbackward.backward``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

__all__: list[str] = []  # private module

# The engine entry point torch.autograd.backward ends in (torch >= 2.3); see accumulate.
_ENGINE_RUN_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)


class _Job:
    """The intermediates W must call, and what they returned. Referenced only by the ctx of one
    ``_CallIntermediates`` node for the duration of one engine call (Note [no closure cycle])."""

    __slots__ = ("calls", "results")

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self.results: list[list] = []


class _CallIntermediates(torch.autograd.Function):
    """Calls the intermediates from inside an engine call: Note [W computes only weight edges]."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, job: _Job) -> torch.Tensor:
        ctx.job = job
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        job, ctx.job = ctx.job, None
        for node, grads, _ in job.calls:
            job.results.append(_call_node(node, grads))
        return None, None


def _call_node(node, grads: tuple) -> list:
    """Run one autograd node on ``grads``; the result is aligned with ``node.next_functions``.

    C++ nodes are callable. A custom ``autograd.Function`` node is run through its ``apply``, which
    returns one entry per forward input; the entries of inputs that required grad map, in order, to
    the valid entries of ``next_functions``. Missing gradients are materialised as zeros for it, as
    the engine does by default (``ctx.set_materialize_grads``).
    """
    if not isinstance(node, BackwardCFunction):
        return list(node(*grads))
    metas = node._input_metadata  # type: ignore[attr-defined]  # not in torch's stub
    full = [
        g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
        for g, m in zip(grads, metas)
    ]
    outs = node.apply(*full)
    if not isinstance(outs, tuple):
        outs = (outs,)
    nf = node.next_functions
    result: list = [None] * len(nf)
    wanted = [i for i, needed in enumerate(node.needs_input_grad) if needed]
    valid = [j for j, (nxt, _) in enumerate(nf) if nxt is not None]
    for i, j in zip(wanted, valid):
        result[j] = outs[i] if i < len(outs) else None
    return result


def _conform(grad: torch.Tensor, node, slot: int) -> torch.Tensor:
    """Shape, dtype and device of ``grad`` as the engine would deliver it to ``node``'s ``slot``
    (its ``validate_outputs`` step): broadcast gradients summed back, dtype and device cast."""
    meta = node._input_metadata[slot]
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype or grad.device != meta.device:
        grad = grad.to(device=meta.device, dtype=meta.dtype)
    return grad


def weight_edge_grads(calls: list) -> list[list]:
    """Call each intermediate on its captured gradients, computing only its weight edges.

    Note [W computes only weight edges]: an autograd node decides which of its outputs to compute
    from the exec info of the engine call it runs in (``task_should_compute_output``): an edge whose
    next node the current call does not need is skipped. W therefore calls each intermediate from
    inside an engine call whose ``inputs`` are exactly the intermediates' edges into weight-only
    nodes. The edges back towards the stage input (the input-gradient work B already did) are
    skipped, so W does only the deferred weight work (e.g. ``grad_out^T @ input`` of a linear
    layer), never re-runs a node of the input side and never walks it. The call is an
    ``autograd.grad`` from a one-element anchor through ``_CallIntermediates``, whose backward calls
    the nodes; it accumulates nothing and registers no hook.

    Returns:
        For each call, what the node returned (aligned with its ``next_functions``), each gradient
        of a weight edge already shaped as the engine would deliver it (``_conform``).
    """
    job = _Job(calls)
    targets: list[GradientEdge] = []
    seen: set = set()
    for node, _, w_edges in calls:
        nf = node.next_functions
        for i in w_edges:
            edge = GradientEdge(*nf[i][:2])
            if edge not in seen:
                seen.add(edge)
                targets.append(edge)
    first = next(g for _, grads, _ in calls for g in grads if g is not None)
    with torch.enable_grad():
        anchor = torch.zeros((), device=first.device, requires_grad=True)
        out = _CallIntermediates.apply(anchor, job)
        torch.autograd.grad([out], [anchor, *targets], allow_unused=True)  # type: ignore[arg-type]
    for (node, _, w_edges), outs in zip(calls, job.results):
        nf = node.next_functions
        for i in w_edges:
            if outs[i] is not None:
                outs[i] = _conform(outs[i], *nf[i][:2])
    return job.results


def accumulate(roots: list, grads: list, params: list, retain_graph: bool) -> None:
    """``torch.autograd.backward(roots, grads, inputs=params)``, without its per-root Python checks.

    Every gradient here already has its root's shape, dtype and device (``_conform``, or the output
    checks of ``ppbackward._tree``), so W goes straight to the engine entry point that
    ``torch.autograd.backward`` itself ends in (about 1 ms less per 300 roots); on a torch without
    it, the public call.
    """
    if _ENGINE_RUN_BACKWARD is None:
        torch.autograd.backward(roots, grad_tensors=grads, inputs=params, retain_graph=retain_graph)
    else:
        _ENGINE_RUN_BACKWARD(tuple(roots), tuple(grads), retain_graph, False, tuple(params), True, True)
