"""Hostile inputs on the split (issue 35): what a caller, a hook or a module conversion does to the
parameters between a microbatch's forward and its W, each against a plain full backward of the same input,
with exact values (``torch.equal``).

* a dtype or device round trip of the parameters (Note [W accumulates through the graph's AccumulateGrad
  nodes] in ``ppbackward._weight_edges``);
* a parameter frozen after its forward (the same Note);
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import _backward as upstream

import ppbackward as pb

Step = Callable[[nn.Module], object]


def _stage(seed: int = 0) -> nn.Sequential:
    """A norm (weights B computes), two linear layers (weights W computes), float32."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)


def _full(module: nn.Module, after_forward: Step | None = None) -> dict[str, torch.Tensor | None]:
    """Plain ``torch.autograd.backward`` on the same input, ``after_forward`` run between forward and backward."""
    x0, g = _data()
    x = x0.clone().requires_grad_()
    out = module(x)
    if after_forward is not None:
        after_forward(module)
    torch.autograd.backward([out], [g])
    return {n: p.grad for n, p in module.named_parameters()}


def _split(
    module: nn.Module, before_b: Step | None = None, before_w: Step | None = None
) -> dict[str, torch.Tensor | None]:
    x0, g = _data()
    x = x0.clone().requires_grad_()
    out = module(x)
    if before_b is not None:
        before_b(module)
    _, groups = pb.stage_backward_input([out], [g], [x], list(module.parameters()))
    if before_w is not None:
        before_w(module)
    pb.stage_backward_weight(list(module.parameters()), groups)
    return {n: p.grad for n, p in module.named_parameters()}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{name}: a gradient where a full backward gives none"
        else:
            assert got[name] is not None, f"{name}: no gradient where a full backward gives one"
            assert torch.equal(got[name], want[name]), f"{name}: differs from a full backward"


# -- defect 1: a dtype round trip between the forward and W ------------------------------------------------


def _round_trip(module: nn.Module) -> None:
    module.double()
    module.float()  # each parameter.data replaced twice: the parameter forgets its AccumulateGrad node


@pytest.mark.parametrize("when", ["before_b", "before_w"])
def test_a_dtype_round_trip_after_the_forward_leaves_every_weight_gradient_exact(when):
    want = _full(_stage(), _round_trip)
    assert all(g is not None for g in want.values())
    got = _split(_stage(), **{when: _round_trip})
    _assert_equal(got, want)


def test_torchs_split_loses_the_weight_gradients_of_a_round_trip():
    """What the row in docs/api.md states: torch's W raises on the forgotten node, or (round trip before B)
    silently computes nothing."""
    module = _stage()
    x0, g = _data()
    x = x0.clone().requires_grad_()
    _, groups = upstream.stage_backward_input([module(x)], [g], [x], module.parameters())
    _round_trip(module)
    with pytest.raises(KeyError):
        upstream.stage_backward_weight(module.parameters(), groups)
    module = _stage()
    x = x0.clone().requires_grad_()
    out = module(x)
    _round_trip(module)
    _, groups = upstream.stage_backward_input([out], [g], [x], module.parameters())
    upstream.stage_backward_weight(module.parameters(), groups)
    assert all(p.grad is None for p in module.parameters())


# -- defect 2: a parameter frozen after its forward ---------------------------------------------------------


@pytest.mark.parametrize("name", ["1.weight", "1.bias", "0.weight"])  # deferred to W; computed in B (2)
@pytest.mark.parametrize("when", ["before_b", "before_w"])
def test_a_parameter_frozen_after_the_forward_is_skipped_and_the_others_accumulate(name, when):
    def freeze(module: nn.Module) -> None:
        module.get_parameter(name).requires_grad_(False)

    want = _full(_stage(), freeze)
    assert want[name] is None and sum(g is not None for g in want.values()) == 5
    _assert_equal(_split(_stage(), **{when: freeze}), want)


def test_a_frozen_parameters_hooks_run_as_in_a_full_backward():
    """The frozen parameter's ``AccumulateGrad`` still runs, with its hooks, and accumulates nothing, in W as in
    a full backward; every other parameter's hooks run once."""
    seen: dict[str, list[str]] = {}
    for kind in ("full", "split"):
        module = _stage()
        calls = seen[kind] = []
        for n, p in module.named_parameters():
            p.register_hook(lambda g, n=n, calls=calls: calls.append(f"hook {n}"))
            p.register_post_accumulate_grad_hook(lambda p, n=n, calls=calls: calls.append(f"post {n}"))

        def freeze(module: nn.Module) -> None:
            module.get_parameter("1.weight").requires_grad_(False)

        grads = _full(module, freeze) if kind == "full" else _split(module, before_w=freeze)
        assert grads["1.weight"] is None
    assert sorted(seen["split"]) == sorted(seen["full"]) and len(seen["full"]) == 12
