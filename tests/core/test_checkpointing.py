"""Activation checkpointing under the B/W split (Note [hooked saved tensors run once] in ``ppbackward._saved``).

Non-reentrant and selective checkpointing (several policies), nested regions, a whole checkpointed
stage and a stage checkpointed in part: B + W give the grads of a full backward, with exactly the
recomputations of a full backward (one per region per microbatch: B's), also with two microbatches in
flight (B, B, W, W), and leave no autograd node alive. torch's own split recomputes more and refuses
selective checkpointing ("backward an extra time").
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import _backward as upstream
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import ppbackward as pb
from ppbackward._compat import torch_release
from ppbackward._saved import HOOKS_VISIBLE
from ppbackward.leaks import track_activations
from tests.core.helpers import ATOL, RTOL

pytestmark = pytest.mark.skipif(not HOOKS_VISIBLE, reason="this torch does not expose saved-tensor hooks to Python")
D = 6
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _policy(save: str):
    def policy(ctx, op, *args, **kwargs):
        if save == "all" or (save == "matmuls" and op in MATMULS):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


class Block(nn.Module):
    """Linear, tanh, Linear; counts its forward runs (the original and every recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.runs = 0

    def forward(self, h):
        self.runs += 1
        return self.l2(torch.tanh(self.l1(h)))


class Stage(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(D, D)
        self.block, self.inner = Block(), Block()
        self.scale = nn.Parameter(torch.full((D,), 0.5))  # a weight used inside the region

    def _region(self, h):
        h = h + self.block(h) * self.scale
        if self.how == "nested":
            h = h + checkpoint(self.inner, h, use_reentrant=False)
        return h

    def forward(self, x):
        if self.how == "whole":
            return checkpoint(lambda t: self._region(self.inp(t)), x, use_reentrant=False)
        h = self.inp(x)
        if self.how == "partial":  # one block checkpointed, one not
            return self.inner(checkpoint(self._region, h, use_reentrant=False))
        kwargs = {} if not self.how.startswith("sac") else {"context_fn": _policy(self.how.split("-", 1)[1])}
        return checkpoint(self._region, h, use_reentrant=False, **kwargs)


HOWS = ["plain", "sac-matmuls", "sac-nothing", "sac-all", "nested", "whole", "partial"]


def _make(how: str) -> Stage:
    torch.manual_seed(0)
    return Stage(how).double()


def _batch(k: int):
    g = torch.Generator().manual_seed(k)
    return torch.randn(4, D, generator=g, dtype=torch.float64, requires_grad=True), torch.randn(
        4, D, generator=g, dtype=torch.float64
    )


def _runs(stage: Stage) -> tuple[int, int]:
    return stage.block.runs, stage.inner.runs


@pytest.mark.parametrize("order", ["BW", "BBWW"])
@pytest.mark.parametrize("how", HOWS)
def test_split_equals_full_backward_with_one_recomputation(how, order):
    full, split = _make(how), _make(how)
    expected_dx = []
    for k in range(2):
        x, g = _batch(k)
        full(x).backward(g)
        expected_dx.append(x.grad)
    pending = []
    for k in range(2):
        x, g = _batch(k)
        (dx,), groups = pb.stage_backward_input((split(x),), (g,), [x], split.parameters())
        torch.testing.assert_close(dx, expected_dx[k], rtol=RTOL, atol=ATOL)
        pending.append(groups)
        if order == "BW":
            pb.stage_backward_weight(split.parameters(), pending.pop())
    for groups in pending:
        pb.stage_backward_weight(split.parameters(), groups)
    for (name, p), q in zip(split.named_parameters(), full.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
    assert _runs(split) == _runs(full)  # forward + exactly the full backward's recomputations


@pytest.mark.parametrize("how", HOWS)
def test_no_node_and_no_activation_outlives_w(how):
    stage = _make(how)
    x, g = _batch(0)
    gc.collect()
    gc.disable()
    try:
        with track_activations() as tracker:
            out = stage(x)
        _, groups = pb.stage_backward_input((out,), (g,), [x], stage.parameters())
        pb.stage_backward_weight(stage.parameters(), groups)
        del out, groups
        rep = tracker.report(collect=False)  # reference counting alone
    finally:
        gc.enable()
    assert rep.nodes > 0 and rep.nodes_held_after_gc == [], rep.format()
    assert rep.alive == [], rep.format()


@pytest.mark.skipif(not (2, 13) <= torch_release()[:2] <= (2, 15), reason="torch's side pinned for 2.13-2.15")
def test_torch_split_recomputes_twice_and_refuses_selective_checkpointing():
    stage = _make("plain")
    x, g = _batch(0)
    _, groups = upstream.stage_backward_input((stage(x),), (g,), [x], stage.parameters())
    upstream.stage_backward_weight(stage.parameters(), groups)
    full = _make("plain")
    x, g = _batch(0)
    full(x).backward(g)
    assert _runs(stage)[0] > _runs(full)[0] == 2  # W's engine calls recompute the region again
    sac = _make("sac-matmuls")
    x, g = _batch(0)
    _, groups = upstream.stage_backward_input((sac(x),), (g,), [x], sac.parameters())
    with pytest.raises(RuntimeError, match="backward an extra time"):
        upstream.stage_backward_weight(sac.parameters(), groups)


def test_b_does_the_weight_work_of_a_checkpointed_region_and_w_only_accumulates():
    """What moves: the region's weight grads are computed in B (its recomputation happens there); W
    accumulates them through AccumulateGrad, so hooks still fire in W, never in B."""
    stage = _make("plain")
    fired: list[str] = []
    for name, p in stage.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=name: fired.append(n))
    x, g = _batch(0)
    _, groups = pb.stage_backward_input((stage(x),), (g,), [x], stage.parameters())
    assert fired == [] and all(p.grad is None for p in stage.parameters())
    # W calls only the intermediate outside the region (``inp``); the region's weight work is done
    calls = [call.node.name() for group in groups for call in group.calls]
    assert calls == ["AddmmBackward0"]
    pb.stage_backward_weight(stage.parameters(), groups)
    assert sorted(fired) == sorted(n for n, _ in stage.named_parameters() if not n.startswith("inner"))
