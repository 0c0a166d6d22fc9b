"""B reuses its analysis while a stage's graphs keep their structure (Note [one plan per graph structure] in
``ppbackward._plan``): reused only where exact, checked against a fresh analysis, holding nothing of a graph."""

from __future__ import annotations

import types
import weakref

import pytest
import torch
import torch.nn as nn

import ppbackward._plan as plan_module
from ppbackward import stage_backward_input, stage_backward_weight
from ppbackward._graph import Structure, gradient_edge, walk
from ppbackward.leaks._gc_phase import full_collect
from tests.core.helpers import output_grads
from tests.core.stages import ZOO, build, make_mul_function


@pytest.fixture
def mapped(monkeypatch):
    """The number of analyses B took from a stored plan (each one checked against a fresh analysis: the
    suite runs with ``PPBACKWARD_VERIFY_PLANS=1``)."""
    assert plan_module.VERIFY
    calls = []
    original = plan_module._mapped

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(plan_module, "_mapped", counted)
    return calls


def _microbatch(module, inputs):
    out = module(*inputs)
    _, groups = stage_backward_input(out, output_grads(out), list(inputs), module.parameters())
    stage_backward_weight(module.parameters(), groups)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_second_microbatch_reuses_the_plan_and_it_equals_a_fresh_analysis(name, mapped):
    module, make_inputs = build(name)
    _microbatch(module, make_inputs(0))
    before = len(mapped)
    _microbatch(module, make_inputs(1))  # the same structure: mapped, and compared with a fresh analysis
    assert len(mapped) == before + 1


def test_negative_control_a_wrong_plan_is_caught_by_the_check(mapped):
    module, make_inputs = build("transformer")
    _microbatch(module, make_inputs(0))
    x = make_inputs(1)
    out = module(*x)
    key = walk([gradient_edge(out)], {gradient_edge(x[0]).node}).key
    stored = plan_module._PLANS[key]
    plan_module._PLANS[key] = stored._replace(b_only=stored.b_only[1:])  # one node B runs forgotten
    try:
        with pytest.raises(AssertionError, match="differs from a fresh analysis in b_only"):
            stage_backward_input([out], [output_grads(out)], x, module.parameters())
    finally:
        plan_module._PLANS[key] = stored


def test_a_hook_added_on_a_bias_between_microbatches_is_not_missed(mapped):
    """Whether a weight has tensor hooks decides whether B computes its gradient (Note [cheap weight gradients
    in B]): a probe of the plan. With a hook added after the first microbatch the plan is not reused, and the
    hook runs once, in W, on exactly a full backward's gradient."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, dtype=torch.float64)
    _, groups = stage_backward_input([module(x)], [g], [x], module.parameters())
    stage_backward_weight(module.parameters(), groups)
    seen = []
    module[2].bias.register_hook(lambda grad: seen.append(grad.clone()) or grad * 2)
    reused = len(mapped)
    for p in module.parameters():
        p.grad = None
    _, groups = stage_backward_input([module(x)], [g], [x], module.parameters())
    assert len(mapped) == reused  # the probe changed: analysed afresh
    assert not seen  # not run in B
    stage_backward_weight(module.parameters(), groups)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], g.sum(0), rtol=0, atol=0)
    assert torch.equal(module[2].bias.grad, 2 * g.sum(0))


def test_a_plan_whose_node_type_died_is_not_replayed():
    """A custom Function's backward class can die and its ``id`` be reused by another: the plan keeps weak
    references to its graph's node types and is not replayed once one is gone."""

    fn = make_mul_function()
    w = nn.Parameter(torch.randn(3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    out = fn.apply(x, w)
    key = walk([gradient_edge(out)], {gradient_edge(x).node}).key
    node = out.grad_fn  # B detaches the output
    nexts = [node.next_functions]  # read before B: torch 2.5 refuses it on a custom Function node after
    _, groups = stage_backward_input([out], [torch.ones(2, 3, dtype=torch.float64)], [x], [w])
    stage_backward_weight([w], groups)
    plan = plan_module._PLANS[key]
    assert plan_module._replays(plan, [node], nexts)
    node_type = weakref.ref(type(node))
    del out, groups, fn, node
    full_collect()  # not gc.collect(): another thread's collection makes that return 0 unrun
    assert node_type() is None  # the class is gone
    assert not plan_module._replays(plan, [], [])


def test_plans_hold_no_graph_and_are_bounded(monkeypatch):
    """A stored plan holds ints, flags, index tuples and weak references to types, nothing of the graph it was
    made from (its nodes, activations, gradients); at most ``_LIMIT`` are kept."""
    monkeypatch.setattr(plan_module, "_PLANS", {})
    monkeypatch.setattr(plan_module, "_LIMIT", 4)
    for depth in range(1, 7):  # six structures
        torch.manual_seed(depth)
        module = nn.Sequential(*[nn.Linear(3, 3) for _ in range(depth)])
        x = torch.randn(2, 3, requires_grad=True)
        out = module(x)
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], module.parameters())
        stage_backward_weight(module.parameters(), groups)
    assert plan_module.plans_held() == 4
    allowed = (int, bool, tuple, list, dict, types.MappingProxyType, frozenset, weakref.ref, type(None))
    for key, plan in plan_module._PLANS.items():
        _only(key, allowed)
        _only(plan, allowed)


def _only(obj, allowed, depth=0):
    assert isinstance(obj, allowed) and not isinstance(obj, (torch.Tensor, Structure)), type(obj)
    if isinstance(obj, weakref.ref):
        return
    if isinstance(obj, (dict, types.MappingProxyType)):
        for k, v in obj.items():
            _only(k, allowed, depth + 1)
            _only(v, allowed, depth + 1)
    elif isinstance(obj, (tuple, list, frozenset)):
        for item in obj:
            _only(item, allowed, depth + 1)


def test_negative_control_the_holding_check_sees_a_node():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(AssertionError):
        _only(((1, 2), [x.exp().grad_fn]), (int, bool, tuple, list, dict, frozenset, weakref.ref, type(None)))


def _bias_step(module_bias, x, weight, add):
    """One B and W of ``x @ weight + bias`` (``add``: an ``AddBackward0`` into the bias) or ``addmm(bias, x,
    weight)`` (the bias edge of ``AddmmBackward0``); the bias' rank decides whether the engine reduces its
    gradient (a fresh tensor B may compute) or hands it on as it is (W's)."""
    out = x.mm(weight) + module_bias if add else torch.addmm(module_bias, x, weight)
    g = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) / 7
    _, groups = stage_backward_input([out], [g], [x], [weight, module_bias])
    stage_backward_weight([weight, module_bias], groups)
    expected = g.sum(0) if module_bias.dim() == 1 else g
    assert torch.equal(module_bias.grad, expected)
    return groups


@pytest.mark.parametrize("add", [False, True], ids=["addmm_bias_rank", "add_shapes"])
def test_a_bias_of_another_rank_with_the_same_structure_is_analysed_afresh(add, mapped, monkeypatch):
    """The probes that read shapes (``Probes.ranks``: a bias' rank against addmm's output; ``Probes.fresh``: the
    shapes at an ``AddBackward0`` edge): a (4,) bias then a (3, 4) one make graphs of equal keys whose analyses
    differ (reduced by the engine: B computes it; not reduced: W's). The second is not mapped from the first's
    plan, and both are exact."""
    monkeypatch.setattr(plan_module, "_PLANS", {})
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    weight = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    _bias_step(nn.Parameter(torch.randn(4, dtype=torch.float64)), x, weight, add)
    before = len(mapped)
    _bias_step(nn.Parameter(torch.randn(3, 4, dtype=torch.float64)), x, weight, add)
    assert len(mapped) == before
    _bias_step(nn.Parameter(torch.randn(3, 4, dtype=torch.float64)), x, weight, add)
    assert len(mapped) == before + 1  # the same shapes again: reused


@pytest.mark.parametrize("add", [False, True], ids=["addmm_bias_rank", "add_shapes"])
def test_negative_control_a_plan_replayed_without_its_shape_probes_is_caught(add, mapped, monkeypatch):
    def types_only(plan, nodes, nexts):
        return all(ref() is not None for ref in plan.types)

    monkeypatch.setattr(plan_module, "_replays", types_only)
    monkeypatch.setattr(plan_module, "_PLANS", {})  # not the plans of the test before
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    weight = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    _bias_step(nn.Parameter(torch.randn(4, dtype=torch.float64)), x, weight, add)
    with pytest.raises(AssertionError, match="differs from a fresh analysis"):
        _bias_step(nn.Parameter(torch.randn(3, 4, dtype=torch.float64)), x, weight, add)


class _ManyInputs(nn.Module):
    """Three inputs and a weight side wider than the input side, numbered before it: the set of nodes that
    reach an input is iterated in an order its insertion history (the input nodes', hashed by address) changes
    between microbatches, which the analysis must not pass on (the hostile tester's case)."""

    def __init__(self, n: int = 60) -> None:
        super().__init__()
        self.scales = nn.ParameterList([nn.Parameter(torch.randn(4, dtype=torch.float64)) for _ in range(n)])
        self.lin = nn.Linear(4, 4).double()

    def forward(self, a, b, c):
        wide = torch.stack([p.exp() for p in self.scales]).sum(0)
        return self.lin(a.sin().cos() * b.sin().cos() * c.sin().cos()) + wide


def test_the_analysis_lists_nodes_in_an_order_fixed_by_the_structure(mapped):
    module = _ManyInputs()
    for seed in range(20):  # every one a checked reuse (PPBACKWARD_VERIFY_PLANS=1) after the first
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        _microbatch(module, xs)
    assert len(mapped) >= 19


def test_with_no_plan_kept_every_b_analyses_afresh(monkeypatch, mapped):
    monkeypatch.setattr(plan_module, "_PLANS", {})
    monkeypatch.setattr(plan_module, "_LIMIT", 0)
    module, make_inputs = build("mlp")
    for seed in range(3):
        _microbatch(module, make_inputs(seed))
    assert plan_module.plans_held() == 0 and not mapped
