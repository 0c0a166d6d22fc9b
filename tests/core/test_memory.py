"""Between B and W, ppbackward holds exactly the saved activations W reads (the floor); upstream
holds more. Exact bytes, measured without saved-tensor hooks (ppbackward._tools.memory)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import _backward as upstream
from torch.utils.checkpoint import checkpoint

import ppbackward as pb
from ppbackward import _saved
from ppbackward._tools.memory import alive_bytes, saved_storages, w_floor_bytes
from tests.core.helpers import clone_inputs, output_grads
from tests.core.stages import build


def _transformer():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(3)])
    return m, lambda s: [torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(s), requires_grad=True)]


def _held_between_b_and_w(impl, module, make_inputs):
    xs = clone_inputs(make_inputs(0))
    out = module(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    roots = [t.grad_fn for t in outs if isinstance(t, torch.Tensor)]
    # The caller keeps the outputs until W (torch's stage does): their storages are not the graph's.
    kept = [*module.parameters(), *(t for t in outs if isinstance(t, torch.Tensor))]
    storages = saved_storages(roots, exclude=kept)
    total = alive_bytes(storages)
    grads = output_grads(outs)
    _, groups = impl.stage_backward_input(outs, grads, xs, module.parameters())
    held = alive_bytes(storages)
    floor = w_floor_bytes(groups, exclude=kept) if impl is pb else None
    impl.stage_backward_weight(module.parameters(), groups)
    return total, held, floor


CASES: dict[str, Callable[[], Any]] = {
    "transformer": _transformer,
    **{n: functools.partial(build, n) for n in ["mlp", "shared_late", "multi_output_nodes"]},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ppbackward_holds_exactly_what_w_reads(name):
    module, make_inputs = CASES[name]()
    total, held, floor = _held_between_b_and_w(pb, module, make_inputs)
    assert held == floor, f"held {held} B, W reads {floor} B"
    assert held <= total


def test_upstream_holds_more_than_w_reads():
    module, make_inputs = _transformer()
    _, _, floor = _held_between_b_and_w(pb, module, make_inputs)
    module, make_inputs = _transformer()
    total, held, _ = _held_between_b_and_w(upstream, module, make_inputs)
    assert held == total > floor


def test_negative_control_without_release_the_check_fails(monkeypatch, graph_kept):
    monkeypatch.setattr("ppbackward.backward.release_saved_tensors", lambda nodes: 0)
    module, make_inputs = _transformer()
    total, held, floor = _held_between_b_and_w(pb, module, make_inputs)
    assert held == total > floor


def _gelu_node_run_again_after_b(expected: str) -> None:
    """B on ``lin(gelu(2x))``, then the ``GeluBackward0`` node (B-only) run again: refused with ``expected``."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    h = torch.nn.functional.gelu(x * 2)  # GeluBackward: B-only, its saved input is released
    out = lin(h)
    gelu_node = h.grad_fn
    _, groups = pb.stage_backward_input(out, torch.ones(2, 4), [x], lin.parameters())
    with pytest.raises(RuntimeError, match=expected):
        gelu_node(torch.ones(2, 4))  # type: ignore[operator,misc]  # a C++ node is callable
    pb.stage_backward_weight(lin.parameters(), groups)


def test_released_saved_tensor_fails_clearly_if_run_again(graph_kept):
    """Where B keeps the graph (W calls the intermediates again), what it released says so if run again."""
    _gelu_node_run_again_after_b("ppbackward released this saved tensor after stage_backward_input")
    assert _saved._refuse is not None


@pytest.mark.skipif(not _saved.HOOKS_VISIBLE, reason="torch < 2.13: B keeps the graph")
def test_without_a_kept_graph_a_node_run_again_fails_as_after_a_full_backward():
    """Note [weight matmuls from their saved input]: B keeps no graph, so running a node of it again fails with
    torch's own message, as after ``loss.backward()``."""
    _gelu_node_run_again_after_b("Trying to backward through the graph a second time")


def test_the_saved_tensor_reader_runs_unpack_hooks_only_when_asked():
    """Note [reading saved tensors]: ``unpack=False`` reads what is stored (a checkpoint's holder: no
    tensor, no recomputation); ``unpack=True`` runs the unpack hook, which recomputes the region."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    calls = [0]

    def region(x):
        calls[0] += 1
        return lin(x).tanh()

    x = torch.randn(2, 4, requires_grad=True)
    out = checkpoint(region, x, use_reentrant=False)
    assert calls == [1]
    assert _saved.saved_tensors(out.grad_fn, unpack=False) == []
    assert calls == [1]
    (unpacked,) = _saved.saved_tensors(out.grad_fn, unpack=True)
    assert calls == [2]  # the region ran again
    assert torch.equal(unpacked, out) and unpacked.shape == (2, 4)


@pytest.mark.skipif(not _saved._DATA_VISIBLE, reason="this torch has no SavedTensor.data: nothing reads as stored")
def test_the_saved_tensor_reader_agrees_without_hooks_and_skips_released_tensors():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    h = x * 2
    g = torch.nn.functional.gelu(h)  # GeluBackward saves h; B-only, so B releases it
    out = lin(g)
    (stored,) = _saved.saved_tensors(g.grad_fn, unpack=False)
    (unpacked,) = _saved.saved_tensors(g.grad_fn, unpack=True)
    assert stored.data_ptr() == unpacked.data_ptr() == h.data_ptr()
    _, groups = pb.stage_backward_input(out, torch.ones(2, 4), [x], lin.parameters())
    assert _saved.saved_tensors(g.grad_fn, unpack=False) == []  # the release's pack hook kept an int
    assert _saved.saved_tensors(g.grad_fn, unpack=True) == []  # its unpack hook raises: skipped
    pb.stage_backward_weight(lin.parameters(), groups)
