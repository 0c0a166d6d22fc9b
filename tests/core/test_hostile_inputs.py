"""Hostile inputs on the split (issue 35): what a caller, a hook or a module conversion does to the
parameters between a microbatch's forward and its W, each against a plain full backward of the same input,
with exact values (``torch.equal``).

* a dtype or device round trip of the parameters (Note [W accumulates through the graph's AccumulateGrad
  nodes] in ``ppbackward._weight_edges``);
* a parameter frozen after its forward (the same Note);
* a tensor hook registered on a parameter during B (Note [hooks registered during B] in
  ``ppbackward.backward``, Note [W mutes B's hooks] in ``ppbackward._handoff``);
* a multi-grad hook over a stage's parameters, with W in several chunks (Note [parameters with tensor hooks
  accumulate in one call] in ``ppbackward._handoff``);
* writes into ``param_groups`` that W could not honour: refused when written, nothing consumed;
* a stage input of a ``__torch_function__`` subclass (``ppbackward._graph.gradient_edge``).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.pipelining import _backward as upstream
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import ppbackward as pb
import ppbackward._handoff as handoff
from ppbackward import _node_owner, backward
from ppbackward._compat import torch_release
from ppbackward._saved import HOOKS_VISIBLE
from tests.core.stages import KeepsInputOnCtx, Matmul

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
    want = [f"{kind} {n}" for n, _ in _stage().named_parameters() for kind in ("hook", "post")]
    if not _post_hook_runs_on_a_frozen_leaf():
        want.remove("post 1.weight")
    assert sorted(seen["split"]) == sorted(seen["full"]) == sorted(want)


def _post_hook_runs_on_a_frozen_leaf() -> bool:
    """Whether this torch's ``AccumulateGrad`` runs a post-accumulate-grad hook of a leaf frozen after its
    forward (2.13 does; 2.5.1 returns before the hook)."""
    w = torch.zeros(1, requires_grad=True)
    ran: list[int] = []
    w.register_post_accumulate_grad_hook(lambda _: ran.append(1))
    out = w * 2
    w.requires_grad_(False)
    out.backward()
    return bool(ran)


def test_torchs_w_raises_on_a_parameter_frozen_after_b():
    """The other side of the row in docs/api.md: torch's W looks the frozen parameter's node up and fails."""
    module = _stage()
    x0, g = _data()
    x = x0.clone().requires_grad_()
    _, groups = upstream.stage_backward_input([module(x)], [g], [x], module.parameters())
    module[1].weight.requires_grad_(False)
    with pytest.raises(KeyError):
        upstream.stage_backward_weight(module.parameters(), groups)


# -- defect 3: a tensor hook registered on a parameter during B ---------------------------------------------


def _halving_hook_registered_during_backward(module: nn.Sequential, calls: list) -> Callable:
    """A forward whose norm output's hook registers a x0.5 hook on the norm's weight: during the backward,
    before the norm's node runs."""

    def halve(g: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return g * 0.5

    weight = module.get_parameter("0.weight")

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = module[0](x)
        h.register_hook(lambda _g: weight.register_hook(halve) and None)
        return module[3](module[2](module[1](h)))

    return forward


@pytest.mark.parametrize("chunked", [False, True])
def test_a_hook_registered_on_a_norm_weight_during_b_runs_once(chunked, monkeypatch):
    if chunked:
        monkeypatch.setattr(handoff, "_W_CHUNK_BYTES", 1)
    x0, g = _data()
    results = []
    for split in (False, True):
        module, calls = _stage(), []
        forward = _halving_hook_registered_during_backward(module, calls)
        x = x0.clone().requires_grad_()
        out = forward(x)
        if split:
            _, groups = pb.stage_backward_input([out], [g], [x], list(module.parameters()))
            pb.stage_backward_weight(list(module.parameters()), groups)
        else:
            torch.autograd.backward([out], [g])
        assert len(calls) == 1, f"the x0.5 hook ran {len(calls)} times (split={split})"
        results.append({n: p.grad for n, p in module.named_parameters()})
    _assert_equal(results[1], results[0])


def test_a_hook_registered_on_a_norm_weight_between_b_and_w_runs_in_w():
    """Registered after B returned: W runs it, as it runs every parameter hook (the weight's gradient is
    accumulated in W); and the hook W muted for its call is back afterwards, in order."""
    plain = _full(_stage())
    module = _stage()
    x0, g = _data()
    x = x0.clone().requires_grad_()
    calls: list = []
    forward = _halving_hook_registered_during_backward(module, calls)
    _, groups = pb.stage_backward_input([forward(x)], [g], [x], list(module.parameters()))
    weight = module[0].weight
    during_b = list(weight._backward_hooks)
    weight.register_hook(lambda g: g * 4)
    pb.stage_backward_weight(list(module.parameters()), groups)
    assert len(calls) == 1  # the hook registered during B: once, in B
    assert torch.equal(weight.grad, plain["0.weight"] * 0.5 * 4)
    hooks = list(weight._backward_hooks)
    assert len(hooks) == 2 and hooks[0] == during_b[0]  # both kept, in registration order


def test_a_hook_registered_during_b_on_a_weight_w_computes_runs_in_w_as_in_torch_s_split():
    """docs/api.md: a hook on an activation registers a tensor hook on a later linear weight while the backward
    runs. A full backward has accumulated that weight already (its layer runs first backwards) and does not run the
    hook for the microbatch; the split computes that weight in W, where the hook then runs, as torch's split does."""

    def weight_grad(how: str) -> torch.Tensor:
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        x = torch.randn(3, 4, requires_grad=True)
        h = a(x)
        handles: list = []
        h.register_hook(lambda g: None if handles else handles.append(b.weight.register_hook(lambda gw: gw * 3)))
        out = b(torch.tanh(h))
        params, grad = [*a.parameters(), *b.parameters()], torch.ones(3, 4)
        if how == "full":
            out.backward(grad)
        elif how == "ppbackward":
            _, groups = pb.stage_backward_input([out], [grad], [x], params)
            pb.stage_backward_weight(params, groups)
        else:
            _, torch_groups = upstream.stage_backward_input([out], [grad], [x], iter(params))
            upstream.stage_backward_weight(iter(params), torch_groups)
        assert len(handles) == 1 and b.weight.grad is not None
        return b.weight.grad

    full = weight_grad("full")
    assert torch.equal(weight_grad("ppbackward"), full * 3)
    assert torch.equal(weight_grad("torch"), full * 3)


@pytest.mark.skipif(
    not HOOKS_VISIBLE, reason="this torch does not expose saved-tensor hooks to Python: no weight is on B's frontier"
)
def test_a_hook_registered_during_b_on_a_frontier_weight_runs_once_and_the_old_ones_keep_their_order():
    """A checkpointed region's bias (B runs the region's weight work, and captures the bias's gradient at its
    ``AccumulateGrad``: Note [frontier captures skip leaf hooks]): a hook it had before B runs once, in W; one
    registered on it during B, before anything ran (from the output's hook), runs once, in B (before the old
    one, where a full backward runs it after: the values are the same, the order of the two calls is not);
    afterwards the dict holds both in registration order."""
    x0, g = _data()
    results, calls_of = [], []
    for split in (False, True):
        torch.manual_seed(0)
        lin, norm = nn.Linear(8, 8), nn.LayerNorm(8)
        calls: list = []
        old = lin.bias.register_hook(lambda g, calls=calls: calls.append("old") or g * 3)

        def hook_during_b(_g, lin=lin, calls=calls):
            lin.bias.register_hook(lambda g: calls.append("new") or g * 0.5)

        x = x0.clone().requires_grad_()
        out = checkpoint(lambda t, lin=lin: torch.tanh(lin(t)), norm(x), use_reentrant=False)
        out.register_hook(hook_during_b)
        params = [*lin.parameters(), *norm.parameters()]
        if split:
            _, groups = pb.stage_backward_input([out], [g], [x], params)
            pb.stage_backward_weight(params, groups)
        else:
            torch.autograd.backward([out], [g])
        results.append({str(i): p.grad for i, p in enumerate(params)})
        calls_of.append(calls)
        keys = list(lin.bias._backward_hooks)
        assert len(keys) == 2 and keys[0] == old.id
    _assert_equal(results[1], results[0])
    assert calls_of[0] == ["old", "new"] and calls_of[1] == ["new", "old"]


# -- defect 4: a multi-grad hook over the stage's parameters, W in chunks ------------------------------------


def _wide_stage() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(12)])  # 12.6 MB of float32: 3 chunks of W


@pytest.mark.parametrize("mode", ["all", "any"])
def test_a_multi_grad_hook_over_the_stage_fires_once_as_in_a_full_backward(mode):
    gen = torch.Generator().manual_seed(2)
    x0, g = torch.randn(4, 512, generator=gen), torch.randn(4, 512, generator=gen)
    fired: dict[bool, list] = {}
    grads: dict[bool, list] = {}
    for split in (False, True):
        module = _wide_stage()
        params = list(module.parameters())
        seen = fired[split] = []
        if mode == "all":
            handle = register_multi_grad_hook(
                params, lambda gs, seen=seen: seen.append([None if t is None else t.clone() for t in gs])
            )
        else:
            handle = register_multi_grad_hook(params, lambda t, seen=seen: seen.append(t.clone()), mode="any")
        x = x0.clone().requires_grad_()
        out = module(x)
        if split:
            _, groups = pb.stage_backward_input([out], [g], [x], params)
            assert len(list(handoff._runs(groups._groups, handoff._W_CHUNK_BYTES))) == 3
            pb.stage_backward_weight(params, groups)
        else:
            torch.autograd.backward([out], [g])
        handle.remove()
        grads[split] = [p.grad for p in params]
    assert len(fired[False]) == len(fired[True]) == 1
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    if mode == "all":
        assert all(a is not None and torch.equal(a, b) for a, b in zip(fired[True][0], fired[False][0]))


def test_torchs_w_fails_on_a_multi_grad_hook_over_the_parameters():
    """The other side of the row in docs/api.md: torch's W captures each parameter's gradient in an
    ``autograd.grad`` call, where the hook's ``_will_engine_execute_node`` refuses a leaf."""
    module = _wide_stage()
    register_multi_grad_hook(list(module.parameters()), lambda grads: None)
    x = torch.randn(4, 512, requires_grad=True)
    _, groups = upstream.stage_backward_input([module(x)], [torch.randn(4, 512)], [x], module.parameters())
    with pytest.raises(RuntimeError, match="A leaf node was passed to _will_engine_execute_node"):
        upstream.stage_backward_weight(module.parameters(), groups)


def test_w_stays_in_chunks_where_no_parameter_has_a_tensor_hook(monkeypatch):
    """The join is only where tensor hooks are: post-accumulate-grad hooks (DDP, optimizer-in-backward) group
    nothing by engine call, and the chunks stay (Note [W in chunks])."""
    chunks: list[int] = []
    real = handoff._weight_work
    monkeypatch.setattr(handoff, "_weight_work", lambda groups: chunks.append(len(groups)) or real(groups))
    module = _wide_stage()
    fired: list = []
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(fired.append)
    x = torch.randn(4, 512, requires_grad=True)
    _, groups = pb.stage_backward_input([module(x)], [torch.randn(4, 512)], [x], list(module.parameters()))
    pb.stage_backward_weight(list(module.parameters()), groups)
    assert chunks == [4, 4, 4] and len(fired) == 24
    chunks.clear()
    module[5].weight.register_hook(lambda g: g)  # one hooked parameter: nothing to join
    _, groups = pb.stage_backward_input([module(x)], [torch.randn(4, 512)], [x], list(module.parameters()))
    pb.stage_backward_weight(list(module.parameters()), groups)
    assert chunks == [4, 4, 4]
    chunks.clear()
    module[1].weight.register_hook(lambda g: g)  # the second and third chunk (groups: last layer first): joined
    _, groups = pb.stage_backward_input([module(x)], [torch.randn(4, 512)], [x], list(module.parameters()))
    pb.stage_backward_weight(list(module.parameters()), groups)
    assert chunks == [4, 8]


# -- writes into param_groups that W could not honour ---------------------------------------------------------


def _custom_stage(fn, beside_a_linear: bool):
    """``fn(x, w)`` alone (its node is the only intermediate W would call: B retains no graph and frees it) or
    followed by a linear layer (B retains the graph and releases what ``fn`` saved)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64) if fn is Matmul else torch.randn(4, dtype=torch.float64))
    lin = nn.Linear(4, 4, dtype=torch.float64)
    weights = [w, *lin.parameters()] if beside_a_linear else [w]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    h = fn.apply(x, w)
    return weights, x, lin(h) if beside_a_linear else h


def _custom_entry(groups, grad) -> tuple[str, int, list]:
    """Where the custom node's entry is (``param_groups[i]['grads'][j]``), the group's index and a write of
    ``grad`` for it (None for the others)."""
    for i, group in enumerate(groups):
        nodes = group["intermediates"]
        for j, node in enumerate(nodes):
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                return f"param_groups[{i}]['grads'][{j}]", i, [(grad,) if k == j else None for k in range(len(nodes))]
    raise AssertionError("no custom Function node among the intermediates")


@pytest.mark.parametrize("beside_a_linear", [False, True], ids=["freed-by-b", "released-by-b"])
def test_gradients_written_for_a_custom_function_whose_saved_tensors_are_gone_are_refused_when_written(
    beside_a_linear,
):
    """torch's B keeps the whole graph, so its W runs the custom Function's backward again from a written
    gradient; ppbackward's B ran it once and released what it saved (or freed the node): the write is refused,
    nothing consumed, and W then gives the gradients of a full backward."""
    g = torch.randn(3, 4, dtype=torch.float64)
    weights, x, out = _custom_stage(Matmul, beside_a_linear)
    _, groups = pb.stage_backward_input([out], [torch.ones_like(out)], [x], weights)
    where, i, write = _custom_entry(groups, g)
    with pytest.raises(pb.StageBackwardError, match=re.escape(f"{where}: MatmulBackward is a custom")):
        groups[i]["grads"] = write
    with pytest.raises(ValueError, match="Write None to keep what B computed"):
        groups[i]["grads"] = write
    assert not groups.consumed and groups[i].written is None
    pb.stage_backward_weight(weights, groups)
    ref_weights, _, ref_out = _custom_stage(Matmul, beside_a_linear)
    torch.autograd.backward([ref_out], [torch.ones_like(ref_out)])
    for got, want in zip(weights, ref_weights):
        assert torch.equal(got.grad, want.grad)


@pytest.mark.parametrize("beside_a_linear", [False, True], ids=["freed-by-b", "retained-by-b"])
def test_gradients_written_for_a_custom_function_that_saved_nothing_are_what_w_computes_from(beside_a_linear):
    """A custom Function that saved no tensor can run again after B, freed or not: the write is accepted and W
    computes from it what torch's W computes from the same write."""
    g = torch.randn(3, 4, dtype=torch.float64)
    results = []
    for impl in (pb, upstream):
        weights, x, out = _custom_stage(KeepsInputOnCtx, beside_a_linear)
        _, groups = impl.stage_backward_input([out], [torch.ones_like(out)], [x], iter(weights))
        if impl is pb:
            _, i, write = _custom_entry(groups, g)
            groups[i]["grads"] = write
        else:
            for group in groups:  # torch's dicts: the custom node's entry replaced, the others kept
                group["grads"] = [
                    (g,) if isinstance(node, torch.autograd.function.BackwardCFunction) else grads
                    for node, grads in zip(group["intermediates"], group["grads"])
                ]
        impl.stage_backward_weight(iter(weights), groups)
        results.append(weights[0].grad)
    assert results[0] is not None and torch.equal(results[0], results[1])


@pytest.mark.skipif(
    _node_owner.custom_nodes_need_owner(),
    reason="on this torch a custom Function node dies with its last output: torch's W then calls a freed node "
           "(a segfault on torch 2.5.1)",
)
def test_torchs_w_runs_a_custom_function_again_from_written_gradients():
    """The other side of the row in docs/api.md: torch 2.13's W succeeds on that write."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64)
    _, groups = upstream.stage_backward_input([Matmul.apply(x, w)], [g], [x], iter([w]))
    groups[0]["grads"] = [(g * 2,)]
    upstream.stage_backward_weight(iter([w]), groups)
    assert torch.equal(w.grad, x.detach().t() @ (g * 2))


def test_deleting_a_param_group_key_is_refused_saying_what_to_do():
    module = _stage()
    x0, g = _data()
    x = x0.clone().requires_grad_()
    _, groups = pb.stage_backward_input([module(x)], [g], [x], list(module.parameters()))
    for key in ("grads", "params", "intermediates"):
        with pytest.raises(pb.StageBackwardError, match=rf"del param_groups\[0\]\['{key}'\]: .*write a tuple of zeros"):
            del groups[0][key]
    with pytest.raises(TypeError):
        del groups[0]["grads"]
    assert not groups.consumed
    _assert_equal({n: p.grad for n, p in module.named_parameters()}, {n: None for n, _ in module.named_parameters()})
    pb.stage_backward_weight(list(module.parameters()), groups)
    _assert_equal({n: p.grad for n, p in module.named_parameters()}, _full(_stage()))


def _multi_hooked(covered: str) -> tuple[nn.Module, list[torch.Tensor], torch.Tensor, list]:
    torch.manual_seed(0)
    first = nn.Linear(8, 8)
    module = nn.Sequential(first, nn.Tanh(), nn.Linear(8, 8))
    x1, x2 = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    h = first(x1 * x2)
    fired: list = []
    tensors: dict[str, list[torch.Tensor]] = {
        "stage inputs": [x1, x2], "an input and a parameter": [x1, first.weight],
        "a parameter and an activation": [first.weight, h],
    }
    register_multi_grad_hook(tensors[covered], lambda grads: fired.append([g is not None for g in grads]))
    return module, [x1, x2], module[2](module[1](h)) + x2, fired


@pytest.mark.parametrize("covered", ["stage inputs", "an input and a parameter"])
def test_a_multi_grad_hook_asking_about_a_leaf_in_b_is_refused_before_b_runs(covered):
    """Note [a hook asks about a leaf in B]: ``register_multi_grad_hook`` (mode "all") over a stage input would
    ask in B's engine call whether that input's ``AccumulateGrad`` will run, which torch refuses there (torch's
    own B fails part-way with autograd's words). B refuses it before running anything, naming the input: the
    graph is intact, so the microbatch still runs its full backward (the hook fires once), and the
    workaround the message gives (mode "any") runs B and W (hostile review)."""
    module, inputs, out, fired = _multi_hooked(covered)
    with pytest.raises(pb.StageBackwardError, match=r"^input_values\[0\]: .*register_multi_grad_hook .*mode='any'"
                       r".*Nothing was run$") as info:
        pb.stage_backward_input([out], [torch.ones_like(out)], inputs, list(module.parameters()))
    assert isinstance(info.value, ValueError) and fired == []
    pb.stage_backward([out], [torch.ones_like(out)], inputs)  # the same graph, untouched
    assert fired == [[True, True]]
    module, inputs, out, fired = _multi_hooked(covered)
    with pytest.raises(RuntimeError) as raw:  # wrapped in "Failed to run stage backward input" from torch 2.6
        upstream.stage_backward_input([out], [torch.ones_like(out)], inputs, module.parameters())
    assert "A leaf node was passed to _will_engine_execute_node" in str(raw.value.__cause__ or raw.value)
    torch.manual_seed(0)
    first = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    register_multi_grad_hook([x, first.weight], lambda grad: fired.append("any"), mode="any")
    out = first(x)
    _, groups = pb.stage_backward_input([out], [torch.ones_like(out)], [x], list(first.parameters()))
    pb.stage_backward_weight(list(first.parameters()), groups)
    assert fired == ["any", "any"]  # once in B (x's gradient), once in W (the weight's): two engine calls


def test_a_multi_grad_hook_on_a_stage_input_b_does_not_reach_runs():
    """The refusal of Note [a hook asks about a leaf in B] is only where B's engine call reaches the input: an
    input the differentiated outputs do not depend on, hooked alone or with an activation, runs as in torch's
    B (the hook told that input gets no gradient), and its gradient is ``None`` (a reviewer's)."""
    for with_activation in (False, True):
        results = []
        for b in (pb.stage_backward_input, upstream.stage_backward_input):
            torch.manual_seed(0)
            first = nn.Linear(8, 8)
            x, unused = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
            h = first(x)
            fired: list = []
            register_multi_grad_hook([unused, h] if with_activation else [unused],
                                     lambda grads, fired=fired: fired.append([g is not None for g in grads]))
            out = torch.tanh(h)
            try:
                grads, _ = b([out], [torch.ones_like(out)], [x, unused], list(first.parameters()))
            except RuntimeError as e:  # torch 2.5's own B refuses an unused input
                assert b is upstream.stage_backward_input and "not have been used" in str(e.__cause__ or e)
                continue
            results.append((grads[1], fired))
        assert results[0] == (None, [[False, True]] if with_activation else [])
        assert results[1:] in ([], results[:1])


def test_a_users_own_leaf_query_in_b_is_named_when_autograd_raises_it():
    """The backstop of Note [a hook asks about a leaf in B]: a hook of the user's own (on an activation) that asks
    about a stage input's ``AccumulateGrad`` is not known before B runs; B names it when autograd raises, with
    autograd's error chained, leaves no claim or capture hook behind, and accumulates nothing."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(3, 8, requires_grad=True)
    h = module[0](x)
    accumulate = torch.autograd.graph.get_gradient_edge(x).node
    h.register_hook(lambda grad: torch._C._will_engine_execute_node(accumulate) and None)
    out = module[2](module[1](h))
    with pytest.raises(pb.StageBackwardError, match=r"^stage_backward_input: a hook asks whether a stage input's "
                       r"AccumulateGrad .*this microbatch's graph is spent$") as info:
        pb.stage_backward_input([out], [torch.ones_like(out)], [x], list(module.parameters()))
    assert "A leaf node was passed to _will_engine_execute_node" in str(info.value.__cause__)
    assert backward._IN_B == {} and all(p.grad is None for p in module.parameters())


def test_a_multi_grad_hook_over_b_and_w_fires_once_in_each():
    """The split is two engine calls: a hook grouping gradients by engine call over an activation (its gradient
    made in B) and a parameter (in W) fires in B with the activation's and in W with the parameter's, where a
    full backward fires once with both (docs/api.md, the differences)."""
    module, inputs, out, fired = _multi_hooked("a parameter and an activation")
    _, groups = pb.stage_backward_input([out], [torch.ones_like(out)], inputs, list(module.parameters()))
    assert fired == [[False, True]]
    pb.stage_backward_weight(list(module.parameters()), groups)
    assert fired == [[False, True], [True, False]]
    module, inputs, out, fired = _multi_hooked("a parameter and an activation")
    pb.stage_backward([out], [torch.ones_like(out)], inputs)
    assert fired == [[True, True]]
    module, inputs, out, fired = _multi_hooked("a parameter and an activation")  # torch's split: W fails in it
    _, torch_groups = upstream.stage_backward_input([out], [torch.ones_like(out)], inputs, module.parameters())
    assert fired == [[False, True]]
    with pytest.raises(RuntimeError, match="A leaf node was passed to _will_engine_execute_node"):
        upstream.stage_backward_weight(module.parameters(), torch_groups)


class _FunctionSubclass(torch.Tensor):
    """The ``__torch_function__`` subclass of torch's docs: every op goes through the override, ``view_as`` included
    (which wraps a leaf's view in an ``AliasBackward0`` of its own)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class _AddSum(nn.Module):
    """``(x + b).sum(0)``: no node on the input's path saves a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.b).sum(0)


class _SubclassResults(TorchFunctionMode):
    """A mode active around B that hands back a subclass for every plain tensor result (a tagging mode)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out.as_subclass(_FunctionSubclass) if type(out) is torch.Tensor else out


@pytest.mark.parametrize("stage", ["linear", "add-sum"])
@pytest.mark.parametrize("override", ["subclass input", "mode around B"])
def test_a_stage_input_of_a_torch_function_subclass_is_found_in_the_graph(stage, override):
    """``get_gradient_edge`` of a subclass leaf goes through the subclass' ``view_as`` and returns a new view's node,
    not the leaf's ``AccumulateGrad``: B took the input's path for a weight's, and W failed (a linear layer: a
    weight-only node W runs could not read its saved tensor, the microbatch's weight grads lost) or wrote the
    input's ``.grad`` (``(x + b).sum(0)``); a ``TorchFunctionMode`` active around B that returns such a subclass did the
    same to a plain input, every weight gradient lost silently (a reviewer's). Now B + W equal a plain backward and the
    input's ``.grad`` stays ``None``.
    """
    torch.manual_seed(0)
    mod = nn.Linear(4, 4) if stage == "linear" else _AddSum()
    ref = copy.deepcopy(mod)
    x = torch.randn(3, 4)
    g = torch.randn(4, 4)[: 3 if stage == "linear" else 1].reshape((3, 4) if stage == "linear" else (4,))
    x_ref = x.clone().as_subclass(_FunctionSubclass).requires_grad_()
    ref(x_ref).backward(g)
    x_mine = x.clone().requires_grad_()
    if override == "subclass input":
        x_mine = x_mine.detach().as_subclass(_FunctionSubclass).requires_grad_()
    out = mod(x_mine)
    with _SubclassResults() if override == "mode around B" else contextlib.nullcontext():
        (dx,), groups = pb.stage_backward_input((out,), (g,), [x_mine], mod.parameters())
    pb.stage_backward_weight(mod.parameters(), groups)
    assert torch.equal(dx, x_ref.grad) and x_mine.grad is None
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(mod.parameters(), ref.parameters()))
    if not (2, 13) <= torch_release()[:2] <= (2, 15):
        return  # torch's side (docs/api.md, "Direct calls") is pinned for 2.13-2.15
    theirs = copy.deepcopy(ref)
    theirs.zero_grad(set_to_none=True)
    x_theirs = x.clone().requires_grad_()
    if override == "subclass input":
        x_theirs = x_theirs.detach().as_subclass(_FunctionSubclass).requires_grad_()
    out = theirs(x_theirs)
    if override == "subclass input":  # torch's B fails: its alias output cannot be detached in place
        with pytest.raises(RuntimeError, match="Failed to run stage backward input"):
            upstream.stage_backward_input((out,), (g,), [x_theirs], theirs.parameters())
        return
    with _SubclassResults():  # torch's B runs, and W gives no weight a gradient, silently
        _, groups = upstream.stage_backward_input((out,), (g,), [x_theirs], theirs.parameters())
    upstream.stage_backward_weight(theirs.parameters(), groups)
    assert all(p.grad is None for p in theirs.parameters()) and x_theirs.grad is not None


class _RoundMatmuls(TorchFunctionMode):
    """A numerics-emulation mode around W: rounds every ``mm`` it sees to bfloat16, and records what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen.append(getattr(func, "__name__", str(func)))
        if getattr(func, "__name__", "") == "mm":
            out = out.to(torch.bfloat16).to(out.dtype)
        return out


def test_w_s_weight_matmuls_are_not_seen_by_a_callers_function_mode():
    """W computes a linear layer's weight gradients itself (Note [weight matmuls from their saved input]); a
    ``TorchFunctionMode`` around W saw those ``mm`` and rounded them, where a plain backward's formulas run in C++ and
    meet no function mode: the weight grads came out 3e-3 apart (a hostile tester's). Now W's formula runs with
    ``__torch_function__`` off and equals a plain backward under the same mode."""
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    ref = copy.deepcopy(mod)
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)
    with _RoundMatmuls():
        ref(x.detach()).backward(g)
    out = mod(x)
    _, groups = pb.stage_backward_input((out,), (g,), [x], mod.parameters())
    mode = _RoundMatmuls()
    with mode:
        pb.stage_backward_weight(mod.parameters(), groups)
    assert "mm" not in mode.seen
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(mod.parameters(), ref.parameters()))
