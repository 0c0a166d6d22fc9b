"""Weight matmuls W computes from the input B took out of their node, so that B need not keep the graph.

Private module, used by ``ppbackward.backward`` (B: :func:`take_saved_inputs`) and
``ppbackward._weight_edges`` (W: :func:`weight_grads`).

Note [weight matmuls from their saved input]: a linear layer's intermediate is an ``AddmmBackward0`` (or
``MmBackward0``) node whose ``mat2`` edge leads into the weight's path (``TBackward0`` then its
``AccumulateGrad``). Its deferred work is one product, ``mm_mat2_backward(grad, mat1, ...)``, which reads
only the gradient flowing into the node (B captures it) and the ``mat1`` the node saved. Calling the node
again in W (Note [W computes only weight edges] in ``ppbackward._weight_edges``) needs its saved tensors
alive after B, so B's engine call had to keep the whole graph (``retain_graph=True``) and then release,
one saved tensor at a time, everything W does not read (Note [release unread saved tensors] in
``ppbackward._saved``): host work per node of the graph, on top of the engine's.

When every intermediate W would call is such a node, B takes each one's ``mat1`` out before its engine call
(reading the saved attribute: the same tensor, with torch's own in-place check) and runs that call
without keeping the graph; the engine then frees every saved tensor as it goes, exactly as a full
backward does, and what W reads (the taken ``mat1``\\ s and the captured gradients) is exactly what the
nodes would have kept. W computes each weight gradient with torch's own formula, the same ops in the same
order (so the same kernels and bit-identical values): ``mm_mat2_backward`` is ``grad.t().mm(mat1).t()``
where ``mat2`` was column-major (a weight transposed: every ``nn.Linear``) and ``mat1.t().mm(grad)``
otherwise, times ``alpha`` (B requires 1); for ``addmm``'s ``self`` edge, which W computes only from
written gradients (B reduced the bias itself, Note [cheap weight gradients in B]), ``grad`` times ``beta``.
The result goes into W's accumulating call as the node's output would (a root into the ``mat2`` edge, whose
``TBackward0`` and ``AccumulateGrad`` then run with their hooks), so accumulation, hooks and layout are a
full backward's.

B falls back to keeping the graph and calling the nodes in W wherever this does not hold: another node type
among the intermediates W calls (a custom Function is not called again and does not count), a weight on
``mat1``, ``alpha`` not 1, a complex dtype, a tensor subclass (DTensor), saved-tensor hooks on an
intermediate or on a node only W runs (a checkpointed region: the taking out would unpack them early), or a
torch before 2.13, whose saved tensors do not show their hooks. The taken tensor's version is recorded and
checked when W starts (Note [captured gradients are checked at W] in ``ppbackward._handoff``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

from ppbackward._errors import backpropagated_before, nan_output
from ppbackward._param_groups import Contribution, NodeCall
from ppbackward._plain import plain_autograd

__all__ = ["take_saved_inputs", "weight_contributions"]  # private module


def _matmul_types() -> tuple[type, type]:
    with plain_autograd():  # Note [probes run in plain autograd]
        a = torch.zeros(2, 2, requires_grad=True)
        return type(torch.addmm(a, a, a).grad_fn), type(torch.mm(a, a).grad_fn)


_ADDMM, _MM = _matmul_types()
# node type -> (the attribute holding mat1, the index of the mat2 edge among next_functions)
_MAT1 = {_ADDMM: ("_saved_mat1", 2), _MM: ("_saved_self", 1)}


def take_saved_inputs(
    deferred: list[Node], deferred_edges: list[tuple[int, ...]], cheap_edges: dict
) -> dict[Node, tuple[torch.Tensor, int]] | None:
    """B's half of Note [weight matmuls from their saved input]: ``{node: (mat1, its version)}`` for every
    C++ node of ``deferred``, or ``None`` where one of them is not such a matmul (B keeps the graph then).

    Args:
        deferred: the intermediates whose weight work waits for W.
        deferred_edges: each one's weight edges (indices into ``next_functions``).
        cheap_edges: node -> the weight edges B computes itself (Note [cheap weight gradients in B]).

    Raises:
        RuntimeError: torch's own, from reading a saved tensor modified in place since the forward (what B's
            engine call would raise); before anything ran.
        StageBackwardError: the graph was already backpropagated (a second B on the same outputs).
    """
    taken: dict[Node, tuple[torch.Tensor, int]] = {}
    for node, w_edges in zip(deferred, deferred_edges):  # Note [no frame per node] in ppbackward.backward
        if isinstance(node, BackwardCFunction):  # runs once, in B: not called again
            continue
        kind = type(node)
        found = _MAT1.get(kind)
        if found is None:
            return None
        attr, mat2 = found
        in_b = cheap_edges.get(node)
        if in_b is not None and mat2 in in_b:
            return None
        for j in w_edges:  # the weight edges: mat2 (deferred), and addmm's bias edge (reduced in B)
            if j != mat2 and (j != 0 or kind is not _ADDMM or in_b is None or j not in in_b):
                return None
        if kind is _ADDMM and node._saved_alpha != 1:  # type: ignore[attr-defined]
            return None
        try:
            x = getattr(node, attr)
        except RuntimeError:
            _refuse_if_freed(node, attr)
            raise
        if type(x) is not torch.Tensor or x.is_complex():
            return None
        taken[node] = (x, x._version)
    return taken


def _refuse_if_freed(node: Node, attr: str) -> None:
    """Raise naming an earlier B where ``node``'s saved input is gone (its graph was backpropagated without
    being kept: Note [B claims its outputs] in ``ppbackward.backward``); return where it is only changed."""
    if getattr(getattr(node, "_raw" + attr, None), "data", ()) is None:  # SavedTensor.data: None once freed
        raise backpropagated_before(
            "stage_backward_input or backward", f"{node.name()} holds no saved tensors any more"
        )


def weight_contributions(calls: list[NodeCall], taken: dict) -> list[Contribution]:
    """W's half of Note [weight matmuls from their saved input]: the gradient each matmul of ``calls`` sends
    along its edges, from the gradients flowing into it and the input B took out of it (``taken``: node ->
    ``(mat1, version)``), as contributions tagged with the node's sequence number (Note [accumulation order] in
    ``ppbackward._weight_edges``). Grad mode off, as the engine runs a node; under anomaly mode a NaN is raised
    as the engine does (Note [anomaly mode names W's nodes]).

    Raises:
        RuntimeError: a node produced NaN under ``torch.autograd.detect_anomaly()`` (``nan_output``).
    """
    out: list[Contribution] = []
    if not calls:
        return out
    new = tuple.__new__  # Note [no frame per node] in ppbackward.backward: the formula inline, per call
    strided = torch.strided
    # in the caller's inference mode, as the engine runs W's other nodes: under it the gradients are inference
    # tensors, as a full backward there makes them (Note [inference-tensor gradients] in ppbackward._tree)
    check_nan = torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    grad_was = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        with torch._C.DisableTorchFunction():  # the engine's formulas never meet a caller's TorchFunctionMode
            for node, grads, edges in calls:
                dy = grads[0] if grads else None
                if dy is None:
                    continue
                x = taken[node][0]
                mat2 = _MAT1[type(node)][1]
                nf, seq = node.next_functions, node._sequence_nr()
                for j in edges:
                    if j == mat2:  # mm_mat2_backward, alpha 1
                        sizes = node._saved_mat2_sym_sizes  # type: ignore[attr-defined]  # plain ints: kept after release
                        strides = node._saved_mat2_sym_strides  # type: ignore[attr-defined]
                        if (
                            len(strides) == 2
                            and strides[0] == 1
                            and strides[1] == sizes[0]
                            and dy.layout is strided
                            and x.layout is strided
                        ):
                            g = dy.t().mm(x).t()
                        else:
                            g = x.t().mm(dy)
                    else:  # addmm's self: maybe_multiply(grad, beta)
                        beta = node._saved_beta  # type: ignore[attr-defined]
                        g = dy if beta == 1 else dy * beta
                    if check_nan and torch.isnan(g).any():
                        raise nan_output(node, j)
                    out.append(new(Contribution, (new(GradientEdge, nf[j][:2]), g, seq)))
    finally:
        torch._C._set_grad_enabled(grad_was)
    return out
