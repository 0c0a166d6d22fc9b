"""B+W dispatches exactly a full backward's device work; W is only the deferred matrix products.

Counted, not timed (``ppbackward._tools.bench.device_work``: a ``TorchDispatchMode`` over every ATen op, the
FLOP formulas of ``torch.utils.flop_counter``): the kernels by name, the FLOPs and the bytes allocated of
B+W must equal those of a full backward of the same microbatch, with every ``.grad`` empty (the first
microbatch of a step) and accumulating, on every stage of the core zoo. The negative control defers the
norm and bias gradients to W again (the tables of Note [cheap weight gradients in B] emptied): the norm
backward then runs twice and the comparison must fail.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import ppbackward as pb
from ppbackward import _node_owner, _weight_edges
from ppbackward._saved import HOOKS_VISIBLE
from ppbackward._tools.bench import memory as _memory
from ppbackward._tools.bench.device_work import REGIMES, cheap_gradients_deferred, count, stage_work
from ppbackward._tools.harness.models import Config
from ppbackward._tools.harness.models import build as build_bench
from tests.core.stages import ZOO, build


def _flat_outputs(out) -> list[torch.Tensor]:
    """The stage's differentiable outputs in a fixed order (tuples, lists and dicts walked depth first)."""
    found, todo = [], [out]
    while todo:
        item = todo.pop(0)
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (tuple, list)):
            todo[:0] = list(item)
        elif isinstance(item, dict):
            todo[:0] = list(item.values())
    return found


def _with_grads(out) -> tuple[list, list]:
    outs = _flat_outputs(out)
    gen = torch.Generator().manual_seed(7)
    return outs, [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]


def _zoo_work(name: str, regime: str) -> dict:
    module, make_inputs = build(name)
    return stage_work(module, lambda: list(make_inputs(0)), _with_grads, regime)


def _assert_same_work(work: dict, what: str, regime: str = "accumulating") -> None:
    """Accumulating: exactly the full backward's kernels, FLOPs and bytes. First microbatch (``.grad``
    empty): the same but for one ``new_empty_strided`` + ``copy_`` per gradient W feeds straight into an
    empty ``.grad`` (a root of its accumulating call, which ``AccumulateGrad`` copies: docs/how-it-works.md)."""
    full, split = work["full"], work["ppbackward"]
    extra = split.extra_over(full)
    copies = extra.get("copy_", 0)
    if regime == "first":
        assert extra.get("new_empty_strided", 0) == copies >= 0, f"{what}: {extra}"
        extra = {k: n for k, n in extra.items() if k not in ("copy_", "new_empty_strided")}
    assert extra == {}, f"{what}: kernels B+W ran beyond (+) or short of (-) a full backward"
    assert split.flops == full.flops, f"{what}: FLOPs {split.flops} != {full.flops}"
    if regime == "accumulating":
        assert split.allocated_bytes == full.allocated_bytes, (
            f"{what}: bytes allocated {split.allocated_bytes} != {full.allocated_bytes}"
        )


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_split_dispatches_exactly_the_full_backwards_kernels(name, regime):
    if name == "checkpointed" and not HOOKS_VISIBLE:
        pytest.skip("this torch does not expose saved-tensor hooks to Python: W recomputes a checkpointed region too")
    _assert_same_work(_zoo_work(name, regime), f"{name} ({regime})", regime)


def test_the_first_microbatch_copies_only_the_weight_gradients_b_computed():
    """2 transformer layers: 8 biases and norm weights per layer are B's: 16 copies, nothing else."""
    work = _zoo_work("transformer", "first")
    assert work["ppbackward"].extra_over(work["full"]) == {"copy_": 16, "new_empty_strided": 16}


def test_the_first_call_of_a_process_adds_only_the_owner_probe_and_ws_anchor(monkeypatch):
    """What a process's very first B+W dispatches beyond a full backward, besides the copies above: the probe
    of Note [custom Function nodes need an owner] (once per process, at ``install()`` or else the first B: a
    ``zeros``, 2 ``clone`` and a ``mul`` on one-element CPU tensors). Counted alone, it is exactly the difference;
    the counts above run once uncounted first, so they never see it. W's anchor (once per device, at its first W
    that calls an intermediate: a one-element ``zeros`` and ``ones``, Note [W's anchor runs no kernel]) is made with
    the dispatch modes set aside (Note [probes run in plain autograd]: a ``FakeTensorMode`` must not be kept), so
    a counter never sees it; it is made all the same."""
    monkeypatch.setattr(_weight_edges, "_ANCHORS", {})
    _node_owner.custom_nodes_need_owner.cache_clear()
    probe = count(_node_owner.custom_nodes_need_owner)
    anchor = count(functools.partial(_weight_edges._anchor, torch.device("cpu")))
    assert dict(probe.kernels) == {"zeros": 1, "clone": 2, "mul": 1}
    assert dict(anchor.kernels) == {} and torch.device("cpu") in _weight_edges._ANCHORS
    assert count(_node_owner.custom_nodes_need_owner).n_kernels == 0  # cached: never again in this process

    stage = build_bench(Config(2, 64, 16))

    def first_microbatch(split: bool):
        for p in stage.params:
            p.grad = None
        x = stage.x.detach().requires_grad_()
        out = stage.model(x)
        if not split:
            return count(lambda: torch.autograd.backward([out], [stage.grad]))

        def b_and_w() -> None:
            _, groups = pb.stage_backward_input([out], [stage.grad], [x], stage.params)
            pb.stage_backward_weight(stage.params, groups)

        return count(b_and_w)

    first_microbatch(False)  # torch's own one-time work, in neither count
    monkeypatch.setattr(_weight_edges, "_ANCHORS", {})
    _node_owner.custom_nodes_need_owner.cache_clear()
    extra = first_microbatch(True).extra_over(first_microbatch(False))
    # W's anchor, made here on torch < 2.13 (B keeps the graph, W calls nodes), is never counted (above)
    assert extra == {"copy_": 16, "new_empty_strided": 16, "zeros": 1, "clone": 2, "mul": 1}
    assert first_microbatch(True).extra_over(first_microbatch(False)) == {"copy_": 16, "new_empty_strided": 16}


@pytest.mark.parametrize("name", ["layer_norms", "transformer", "custom_linear", "lora"])
def test_control_norm_recomputed_in_w_fails_the_comparison(name):
    with cheap_gradients_deferred():  # the negative control: norms and biases are W's again
        work = _zoo_work(name, "accumulating")
    with pytest.raises(AssertionError, match="kernels B"):
        _assert_same_work(work, name)
    assert work["ppbackward"].extra_over(work["full"])["native_layer_norm_backward"] > 0


def _transformer_b_and_w(regime: str, impl=pb):
    """B's and W's device work, counted apart, on the bench's 2-layer transformer stage (d 64)."""
    stage = build_bench(Config(2, 64, 16))
    found = []
    for _ in range(2):  # the first is not counted (one-time work)
        for p in stage.params:
            p.grad = None if regime == "first" else torch.zeros_like(p)
        out = stage.model(stage.x)
        box: list = []
        b = count(lambda: box.append(impl.stage_backward_input([out], [stage.grad], [stage.x], stage.params)[1]))  # noqa: B023
        w = count(functools.partial(impl.stage_backward_weight, stage.params, box[0]))
        found = [b, w]
    return found


@pytest.mark.parametrize("regime", REGIMES)
def test_w_runs_only_the_weight_matmuls(regime):
    b, w = _transformer_b_and_w(regime)
    # accumulating: one add_ per parameter (.grad += new); first: B's 16 bias and norm gradients are copied
    accumulation = {"copy_": 16, "new_empty_strided": 16} if regime == "first" else {"add_": 24}
    assert dict(w.kernels) == {"mm": 8, **accumulation}  # 4 linear weights per layer, 2 layers
    assert b.kernels["native_layer_norm_backward"] == 4  # once per norm, weight and bias included
    assert b.kernels["sum"] == 8  # the 8 biases, reduced in B
    # the weight GEMMs: 2 layers x 2 x 32 tokens x 64 x (192 + 64 + 256 + 256) (in_proj, out_proj, linear1, 2)
    assert w.flops == 6291456


def test_b_holds_at_most_080_of_what_deferring_norms_holds():
    """The bench's "held between B and W" (saved bytes alive after B) with norm and bias gradients in B,
    against the same with them deferred to W (the negative control): the norms' inputs are released."""
    stage = build_bench(Config(4, 64, 16))
    with cheap_gradients_deferred():
        deferred = _memory.measure_split("ppbackward", stage)
    in_b = _memory.measure_split("ppbackward", stage)
    for result in (deferred, in_b):
        assert result["held_bytes"] == result["floor_bytes"]  # B keeps exactly what W reads
    assert in_b["held_bytes"] <= 0.80 * deferred["held_bytes"], (in_b, deferred)


def _hostile_stage():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    u = x * 2
    u.register_hook(lambda g: g.mul_(0))  # breaks autograd's contract: changes its argument in place
    return lin, x, lin(x) + u  # the add hands lin and u one gradient tensor


def test_a_hook_changing_a_captured_gradient_in_place_is_refused_in_b():
    lin, x, y = _hostile_stage()
    with pytest.raises(pb.StageBackwardError, match=r"AddmmBackward0 \(input 0\).*grad_fn is MulBackward0"):
        pb.stage_backward_input([y], [torch.ones(3, 4)], [x], list(lin.parameters()))
    assert lin.weight.grad is None and lin.bias.grad is None  # nothing accumulated


def test_the_same_hook_in_a_full_backward_leaves_the_weight_gradient_intact():
    """What the refusal protects: a full backward ran ``lin``'s node before the hook changed the gradient."""
    lin, _, y = _hostile_stage()
    y.backward(torch.ones(3, 4))
    assert lin.weight.grad.abs().sum() > 0


def test_the_same_stage_with_a_hook_that_returns_a_new_tensor_is_exact_and_not_refused():
    """The refusal's control: a hook that replaces the gradient (``return g * 0``) as autograd allows."""
    results = []
    for split in (False, True):
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        x = torch.randn(3, 4, requires_grad=True)
        u = x * 2
        u.register_hook(lambda g: g * 0)
        y = lin(x) + u
        if split:
            _, groups = pb.stage_backward_input([y], [torch.ones(3, 4)], [x], list(lin.parameters()))
            pb.stage_backward_weight(list(lin.parameters()), groups)
        else:
            y.backward(torch.ones(3, 4))
        results.append((lin.weight.grad, lin.bias.grad))
    (w_full, b_full), (w_split, b_split) = results
    assert torch.equal(w_split, w_full) and torch.equal(b_split, b_full) and w_full.abs().sum() > 0


@pytest.mark.parametrize("stage", ["output_is_a_parameter", "x_plus_a_full_size_parameter"])
def test_w_never_lets_grad_share_the_callers_gradient_buffer(stage):
    """A stage output's gradient (the caller's receive buffer) reaching ``.grad`` unchanged is copied, as a full
    backward copies it: ``.grad`` never shares the caller's buffer."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(3, 4, requires_grad=True)
    out = p * 1.0 if stage == "output_is_a_parameter" else x + p
    buffer = torch.randn(3, 4)
    expected = buffer.clone()
    _, groups = pb.stage_backward_input([out], [buffer], [x], [p])
    pb.stage_backward_weight([p], groups)
    buffer.zero_()  # the caller reuses its receive buffer
    assert torch.equal(p.grad, expected)
