"""torch.compile'd regions split into B and W (Note [compiled regions split in two] in ppbackward._compiled):
with ppbackward installed, B runs each region's input-gradient graph and W its weight-gradient graph.
Counted with the ``aot_eager`` backend (aten ops through a ``TorchDispatchMode``): B dispatches only
input-gradient matmuls, W only weight-gradient ones, B + W exactly the compiled full backward's ops; grads
bitwise equal to the compiled full backward's. Without the split (a region compiled before ``install``)
the region runs whole in B, exactly as before: the negative control of the counts."""

from __future__ import annotations

import collections
import functools
import warnings
import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import ppbackward as pb
from ppbackward import _compiled, _weight_edges, stage_backward, stage_backward_input, stage_backward_weight
from ppbackward._tools.bench.device_work import REGIMES, stage_work

pytestmark = pytest.mark.skipif(not _compiled.support().ok, reason=f"no split here: {_compiled.support().why}")

BATCH, D = 3, 8
MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


class Block(nn.Module):
    """``x + b(relu(a(x)))``: ``a.weight``'s gradient needs the gradient flowing into ``b``'s input, an
    intermediate of the input gradient's computation (a live-in of the weight half)."""

    def __init__(self, d: int = D, graph_break: bool = False, sac: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)
        self.graph_break = graph_break
        self.sac = sac

    def forward(self, x):
        if self.sac:  # selective activation checkpointing inside the region: the matmuls saved, the rest recomputed
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            return checkpoint(self._forward, x, use_reentrant=False, context_fn=context)
        return self._forward(x)

    def _forward(self, x):
        h = torch.relu(self.a(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.b(h)


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Stage(nn.Module):
    def __init__(self, n_blocks: int = 2, graph_break: bool = False, sac: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(graph_break=graph_break, sac=sac) for _ in range(n_blocks)])
        # no bias: an eager bias's gradient, which B computes (Note [cheap weight gradients in B]), is copied
        # into an empty .grad by W (docs/performance.md, "Device work"), a cost of the eager path, not of this
        self.head = nn.Linear(D, D, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SharedHead(nn.Module):
    """An eager head that also reads a weight a compiled block uses."""

    def __init__(self, head: nn.Module, weight: nn.Parameter) -> None:
        super().__init__()
        self.head = head
        self.shared = [weight]  # not registered twice

    def forward(self, h):
        return self.head(h) + (h @ self.shared[0]).sum(-1, keepdim=True)


def _compiled_stage(spelling: str, backend: str = "aot_eager", dynamic: bool | None = None, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    stage = Stage(**kwargs)
    if spelling == "child":  # torch.compile(block) as a child: an OptimizedModule
        stage.blocks = nn.ModuleList(
            [torch.compile(b, backend=backend, dynamic=dynamic) for b in stage.blocks]  # type: ignore[misc]
        )
    elif spelling == "method":  # block.compile()
        for b in stage.blocks:
            b.compile(backend=backend)
    elif spelling == "forward":  # block.forward = torch.compile(block.forward)
        for b in stage.blocks:
            b.forward = torch.compile(b.forward, backend=backend)
    elif spelling == "stage":  # the whole stage one region
        return torch.compile(stage, backend=backend)  # type: ignore[return-value]
    return stage


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.setattr(_compiled, "_logged", set())  # each test sees the fallback lines it causes
    pb.uninstall()
    torch._dynamo.reset()
    yield
    pb.uninstall()
    torch._dynamo.reset()


class Ops(TorchDispatchMode):
    """The aten ops dispatched, with the shape of each one's first output."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.ops.append((str(func), tuple(first.shape) if isinstance(first, torch.Tensor) else ()))
        return out

    def matmuls(self) -> list[tuple]:
        return [shape for name, shape in self.ops if name in MATMULS]

    def counts(self) -> collections.Counter:
        return collections.Counter(name for name, _ in self.ops)


def _inputs(n: int = 3, batch: int = BATCH) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(batch, D) for _ in range(n)]


def _full(stage: nn.Module, xs: list[torch.Tensor]) -> tuple[list, list]:
    """The compiled full backward's grads over ``xs``, accumulating (params' and inputs')."""
    params = list(stage.parameters())
    for p in params:
        p.grad = None
    input_grads = []
    for x0 in xs:
        x = x0.clone().requires_grad_()
        stage(x).sum().backward()
        input_grads.append(x.grad)
    return [p.grad.clone() if p.grad is not None else None for p in params], input_grads


def _reference_then_cleared(stage: nn.Module, x0: torch.Tensor) -> tuple[list, list]:
    """The compiled full backward's parameter grads for ``x0``, and the parameters, their ``.grad`` cleared."""
    want, _ = _full(stage, [x0])
    params = list(stage.parameters())
    for p in params:
        p.grad = None
    return want, params


SPLIT: list[int] = []  # per microbatch of the last _split: how many compiled regions B split


def _split(stage: nn.Module, xs: list[torch.Tensor]) -> tuple[list, list]:
    """B and W over ``xs`` in a zero-bubble order (B1 B2 W1 B3 W2 W3 for three), grads accumulating."""
    SPLIT.clear()
    params = [p for p in stage.parameters() if p.requires_grad]
    for p in stage.parameters():
        p.grad = None
    pending: list = []
    input_grads = []
    for i, x0 in enumerate(xs):
        x = x0.clone().requires_grad_()
        (g,), groups = stage_backward_input([stage(x).sum()], None, [x], params)
        input_grads.append(g)
        SPLIT.append(sum(len(group.regions) for group in groups))
        pending.append(groups)
        if i >= 1:
            stage_backward_weight(params, pending.pop(0))
    for groups in pending:
        stage_backward_weight(params, groups)
    return [p.grad.clone() if p.grad is not None else None for p in stage.parameters()], input_grads


def _assert_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), (i, (a - b).abs().max())


@pytest.mark.parametrize("spelling", ["child", "method", "forward", "stage"])
def test_b_and_w_of_compiled_blocks_equal_the_compiled_full_backward_bitwise(spelling):
    with pb.installed():
        stage = _compiled_stage(spelling)
        xs = _inputs()
        want, want_x = _full(stage, xs)
        got, got_x = _split(stage, xs)
    assert [1 if spelling == "stage" else 2] * len(xs) == SPLIT, SPLIT
    _assert_equal(got, want)
    _assert_equal(got_x, want_x)


def _one_microbatch_ops(stage: nn.Module, x0: torch.Tensor) -> tuple[Ops, Ops]:
    params = list(stage.parameters())
    x = x0.clone().requires_grad_()
    loss = stage(x).sum()
    with Ops() as b:
        _, groups = stage_backward_input([loss], None, [x], params)
    with Ops() as w:
        stage_backward_weight(params, groups)
    return b, w


def _full_ops(stage: nn.Module, x0: torch.Tensor) -> Ops:
    x = x0.clone().requires_grad_()
    loss = stage(x).sum()
    with Ops() as full:
        loss.backward()
    return full


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("spelling", ["child", "stage"])
def test_b_runs_only_input_gradient_matmuls_and_w_the_weight_ones(spelling, regime):
    with pb.installed():
        stage = _compiled_stage(spelling)
        (x0,) = _inputs(1)
        _full(stage, [x0])  # compiles the regions
        params = list(stage.parameters())
        weight_shapes = {tuple(p.shape) for p in params if p.dim() == 2}
        for p in params:
            p.grad = torch.zeros_like(p) if regime == "accumulating" else None
        b, w = _one_microbatch_ops(stage, x0)
        work = stage_work(stage, lambda: [x0.clone().requires_grad_()], lambda out: ([out.sum()], None), regime)
    # 2 blocks x 2 linears + the head: one input-gradient and one weight-gradient matmul each
    assert len(b.matmuls()) == 5 and all(shape[0] == BATCH for shape in b.matmuls()), b.matmuls()
    assert len(w.matmuls()) == 5 and all(shape in weight_shapes for shape in w.matmuls()), w.matmuls()
    assert work["ppbackward"] == work["full"], work["ppbackward"].extra_over(work["full"])


def test_a_region_compiled_before_install_runs_whole_in_b_exactly(caplog):
    """The negative control of the counts above: no split, every matmul in B, grads still exact; said once
    on the ppbackward logger."""
    stage = _compiled_stage("child")
    (x0,) = _inputs(1)
    want, _ = _full(stage, [x0])  # compiled (forward and backward) before install
    with pb.installed():
        for p in stage.parameters():
            p.grad = None
        b, w = _one_microbatch_ops(stage, x0)
        got = [p.grad for p in stage.parameters()]
    assert len(b.matmuls()) == 9 and len(w.matmuls()) == 1  # the eager head's weight matmul alone in W
    _assert_equal(got, want)
    assert "compiled before ppbackward.install()" in caplog.text


def test_a_full_backward_runs_the_whole_compiled_graph():
    with pb.installed():
        stage = _compiled_stage("child")
        (x0,) = _inputs(1)
        _full(stage, [x0])
        plain = _full_ops(stage, x0)
        x = x0.clone().requires_grad_()
        out = stage(x).sum()
        with Ops() as ours:
            stage_backward(out, None, [x])
    assert ours.counts() == plain.counts()


def test_b_holds_only_what_the_weight_half_reads_and_w_lets_it_go():
    with pb.installed():
        stage = _compiled_stage("child")
        (x0,) = _inputs(1)
        _full(stage, [x0])
        params = list(stage.parameters())
        x = x0.clone().requires_grad_()
        loss = stage(x).sum()
        regions = []
        node = loss.grad_fn
        seen = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            if _compiled.is_region(n):
                regions.append(n)
            stack.extend(f for f, _ in n.next_functions)
        saved = sum(t.numel() for n in regions for t in n.saved_tensors)
        _, groups = stage_backward_input([loss], None, [x], params)
        held = [t for g in groups for r in g.regions for t, _ in r.pending.versions]
        refs = [weakref.ref(t) for t in held]
        # per block: the incoming gradient, the block's input, the relu output and the gradient into b's
        # input: (3x8 + 3x8 + 3x32 + 3x32) x 2; the other saved tensors (the weights, the relu mask) went
        assert sum(t.numel() for t in held) == 2 * (24 + 24 + 96 + 96) < saved + 2 * (24 + 96)
        del held
        stage_backward_weight(params, groups)
    assert all(ref() is None or ref() is x for ref in refs)


def test_w_never_called_frees_what_b_held_with_the_param_groups_and_the_next_step_is_exact():
    with pb.installed():
        stage = _compiled_stage("child")
        (x0,) = _inputs(1)
        _full(stage, [x0])
        x = x0.clone().requires_grad_()
        _, groups = stage_backward_input([stage(x).sum()], None, [x], list(stage.parameters()))
        refs = [weakref.ref(t) for g in groups for r in g.regions for t, _ in r.pending.versions]
        assert refs
        del groups
        assert all(ref() is None or ref() is x for ref in refs)
        # the next step, on the same compiled regions, is exact
        want, _ = _full(stage, [x0])
        got, _ = _split(stage, [x0])
    _assert_equal(got, want)


@pytest.mark.parametrize(
    "case",
    ["graph-break", "new-shape", "dynamic", "no-parameters", "frozen", "called-twice", "compiled-and-eager", "sac"],
)
def test_hostile_compiled_stages_are_exact(case):
    with pb.installed():
        stage = _compiled_stage(  # a graph break: two regions per block
            "child", graph_break=case == "graph-break", sac=case == "sac", dynamic=True if case == "dynamic" else None
        )
        xs = _inputs()
        if case in ("new-shape", "dynamic"):  # a recompile between microbatches; sizes as symbols
            torch.manual_seed(2)
            xs[1] = torch.randn(BATCH + 2, D)
        elif case == "no-parameters":  # a compiled region without weights between the blocks
            act = torch.compile(lambda t: torch.tanh(t) * 2, backend="aot_eager")
            forward = stage.forward
            stage.forward = lambda x: forward(act(x))
        elif case == "frozen":
            stage.blocks[0].a.weight.requires_grad_(False)
        elif case == "called-twice":  # one region applied twice: shared weights
            stage.blocks[1] = stage.blocks[0]
        elif case == "compiled-and-eager":  # a weight used inside a region and by an eager op
            stage.head = SharedHead(stage.head, stage.blocks[0].b.weight)
        want, want_x = _full(stage, xs)
        got, got_x = _split(stage, xs)
    # every block's region split (two per block across a graph break; one region twice where shared)
    assert [4 if case == "graph-break" else 2] * len(xs) == SPLIT, SPLIT
    _assert_equal(got_x, want_x)
    _assert_equal(got, want)


@pytest.mark.slow
def test_inductor_halves_equal_the_compiled_full_backward():
    with pb.installed():
        stage = _compiled_stage("child", backend="inductor")
        xs = _inputs()
        want, want_x = _full(stage, xs)
        got, got_x = _split(stage, xs)
    for a, b in zip(got + got_x, want + want_x):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_weight_half_takes_every_size_input_first(monkeypatch):
    """Note [weight halves bind every size]: with sizes as symbols, every size placeholder of the backward graph
    is among the weight half's inputs, first, in the order ``held`` gives them (the fast, compiler-free check of
    what the inductor test below needs; without the note's line the weight half takes only what it reads)."""
    cuts = []
    split = _compiled.split_backward_graph

    def spy(gm, outputs):
        cut = split(gm, outputs)
        cuts.append((gm, cut))
        return cut

    monkeypatch.setattr(_compiled, "split_backward_graph", spy)
    with pb.installed():
        stage = _compiled_stage("child", dynamic=True)
        torch.manual_seed(2)
        xs = [torch.randn(BATCH, 2, D), torch.randn(BATCH + 2, 5, D)]
        want, want_x = _full(stage, xs)
        got, got_x = _split(stage, xs)
    assert SPLIT == [2, 2] and cuts
    _assert_equal(got_x, want_x)
    _assert_equal(got, want)
    for gm, cut in cuts:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        sizes = [i for i, n in enumerate(placeholders) if isinstance(n.meta.get("val"), torch.SymInt)]
        assert sizes, "no symbolic size: the case does not test the note"
        assert list(cut.held[: len(sizes)]) == sizes
        inputs = [n for n in cut.weight_graph.graph.nodes if n.op == "placeholder"]
        assert len(inputs) == len(cut.held) + cut.n_live
        for k, i in enumerate(cut.held):  # each weight-half input is the placeholder held names, as B passes it
            assert inputs[k].meta.get("val") is placeholders[i].meta.get("val")

@pytest.mark.slow
def test_inductor_recompile_for_a_new_shape_still_splits_every_region():
    """Two sizes changing recompile each block with both as symbols; a view in the weight half carried only
    their product (``s0*s1``), inductor could not bind each symbol (``expected [s0, s1] to have been
    codegen-ed``, or ``KeyError: 'args'`` through its FX graph cache), and every region ran whole in B (logged,
    exact, no W work). The weight half now takes every size placeholder (Note [weight halves bind every size])."""
    with pb.installed():
        stage = _compiled_stage("child", backend="inductor")
        torch.manual_seed(2)  # two sizes change: both become symbols
        xs = [torch.randn(BATCH, 2, D), torch.randn(BATCH + 2, 5, D), torch.randn(BATCH + 4, 3, D)]
        _full(stage, xs)  # compiles every shape first: both passes then run the same (dynamic) graphs
        want, want_x = _full(stage, xs)
        got, got_x = _split(stage, xs)
    assert SPLIT == [2, 2, 2], SPLIT
    for a, b in zip(got + got_x, want + want_x):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- found by review: each of these failed (or was silently wrong) before its fix -------------------------


def test_a_hook_changing_what_a_weight_half_reads_in_place_during_b_is_refused():
    """``region(x) + u`` with a hook on ``u`` zeroing its gradient in place: that gradient is the one the
    region's weight half reads (autograd's contract forbids the hook; a full backward computed the weight
    gradient before it ran). B refuses, naming the region, instead of W computing zeros."""
    with pb.installed():
        torch.manual_seed(0)
        lin = nn.Linear(D, D, bias=False)
        region = torch.compile(lambda t: lin(t), backend="aot_eager")
        x = torch.randn(BATCH, D, requires_grad=True)
        u = x * 3  # made first: its node runs after the region's
        u.register_hook(lambda g: g.mul_(0))
        out = region(x) + u
        with pytest.raises(pb.StageBackwardError, match="compiled region CompiledFunctionBackward"):
            stage_backward_input([out], [torch.randn(BATCH, D)], [x], [lin.weight])
    assert lin.weight.grad is None


def test_a_weight_used_before_inside_and_after_a_region_accumulates_bitwise():
    """Three gradients into one AccumulateGrad (two eager ops, the region between): W keeps a full
    backward's order (Note [accumulation order]), so the region's gradient is a root tagged with its
    sequence number, not handed over after the others."""
    with pb.installed():
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(16, 16))
        region = torch.compile(lambda h, w: torch.tanh(h @ w), backend="aot_eager")
        stage = _Fn(lambda x: torch.cos(region(torch.sin(x @ p), p) @ p), [p])
        xs = [torch.randn(8, 16) for _ in range(4)]
        want, _ = _full_of(stage, xs)
        got, _ = _split_of(stage, xs)
    assert SPLIT == [1] * 4
    _assert_equal(got, want)


def test_a_region_on_tensor_subclasses_runs_whole_in_b_exactly(caplog):
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    with pb.installed():
        torch.manual_seed(0)
        lin = nn.Linear(D, D, bias=False)
        w = lin.weight.detach()
        lin.weight = nn.Parameter(two_tensor.TwoTensor(w.clone(), w.clone() * 2))
        f = torch.compile(lambda x: torch.relu(lin(x)), backend="aot_eager")
        x0 = torch.randn(BATCH, D)
        stage = _Fn(f, [lin.weight], make_input=lambda: two_tensor.TwoTensor(x0.clone(), x0.clone()))
        want, want_x = _full_of(stage, [x0])
        got, got_x = _split_of(stage, [x0])
    assert SPLIT == [0]
    assert "tensor subclasses" in caplog.text
    for a, b in zip(got + got_x, want + want_x):
        assert torch.equal(a.a, b.a) and torch.equal(a.b, b.b)


def test_gradients_written_for_a_compiled_region_are_refused_when_written():
    with pb.installed():
        stage = _compiled_stage("stage")
        (x0,) = _inputs(1)
        _full(stage, [x0])
        x = x0.clone().requires_grad_()
        params = list(stage.parameters())
        for p in params:
            p.grad = None
        _, groups = stage_backward_input([stage(x).sum()], None, [x], params)
        (node,) = groups[0]["intermediates"]
        refused = r"\['grads'\]\[0\]: only None can be written for CompiledFunctionBackward, a torch.compile'd"
        with pytest.raises(ValueError, match=refused):
            groups[0]["grads"] = [tuple(torch.ones(m.shape) for m in node._input_metadata)]
        # a tensor where a tuple is due gets the same answer, not a request for a tuple (newcomer walkthrough)
        with pytest.raises(ValueError, match=refused):
            groups[0]["grads"] = [torch.ones(node._input_metadata[0].shape)]
        stage_backward_weight(params, groups)  # what B computed, untouched by the refused write
        got = [p.grad.clone() for p in params]
        want, _ = _full(stage, [x0])
    _assert_equal(got, want)


def test_anomaly_mode_names_the_region_whose_weight_half_returned_nan():
    with pb.installed():
        torch.manual_seed(0)
        lin = nn.Linear(D, D, bias=False)
        region = torch.compile(lambda t: lin(t), backend="aot_eager")
        x0 = torch.randn(BATCH, D)
        x0[0, 0] = float("nan")  # NaN in the weight gradient (x^T g) only
        x = x0.clone().requires_grad_()
        out = region(x * 1).sum()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # before detect_anomaly(): it warns when entered
            with torch.autograd.detect_anomaly():
                _, groups = stage_backward_input([out], None, [x], [lin.weight])
                with pytest.raises(RuntimeError, match="Function 'CompiledFunctionBackward' returned nan"):
                    stage_backward_weight([lin.weight], groups)


def test_a_backend_reused_for_many_regions_compiles_each_backward_once(monkeypatch):
    """``aot_autograd(...)`` made once and given to several ``torch.compile`` calls: the backward compiler is
    wrapped for each compile only, not once more per compile."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    calls = []
    real = _compiled._compile_backward
    monkeypatch.setattr(_compiled, "_compile_backward", lambda *a: calls.append(1) or real(*a))
    with pb.installed():
        for i in range(4):
            code: dict = {}
            exec(f"def block(x):\n    return (x.sin() * {i + 1}).sum()", code)  # a new function: a new compile
            f = torch.compile(code["block"], backend=backend)
            calls.clear()
            f(torch.randn(3, requires_grad=True)).backward()
            assert len(calls) == 1, (i, calls)
    assert backend.kwargs.get("bw_compiler") is None  # the backend object as it was made


def test_a_convolution_region_is_exact_and_w_holds_no_tuple():
    """``convolution_backward`` computes the input and weight gradients in one op: it stays whole in B (its
    weight gradient a tensor W reads), never a tuple held for W."""
    with pb.installed():
        torch.manual_seed(0)
        block = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
        f = torch.compile(block, backend="aot_eager")
        stage = _Fn(f, list(block.parameters()))
        xs = [torch.randn(2, 4, 8, 8) for _ in range(2)]
        want, want_x = _full_of(stage, xs)
        got, got_x = _split_of(stage, xs)
    assert SPLIT == [1, 1]
    _assert_equal(got, want)
    _assert_equal(got_x, want_x)


class _Fn(nn.Module):
    """A stage made of a function and the weights it reads."""

    def __init__(self, fn, weights, make_input=None) -> None:
        super().__init__()
        self.fn = fn
        self.weights = weights
        self.make_input = make_input

    def forward(self, x):
        return self.fn(x)


def _input_of(stage, x0):
    return (stage.make_input() if getattr(stage, "make_input", None) else x0.clone()).requires_grad_()


def _full_of(stage: _Fn, xs: list) -> tuple[list, list]:
    for p in stage.weights:
        p.grad = None
    input_grads = []
    for x0 in xs:
        x = _input_of(stage, x0)
        stage(x).sum().backward()
        input_grads.append(x.grad)
    return [p.grad.clone() for p in stage.weights], input_grads


def _split_of(stage: _Fn, xs: list) -> tuple[list, list]:
    SPLIT.clear()
    for p in stage.weights:
        p.grad = None
    input_grads = []
    for x0 in xs:
        x = _input_of(stage, x0)
        (g,), groups = stage_backward_input([stage(x).sum()], None, [x], stage.weights)
        SPLIT.append(sum(len(group.regions) for group in groups))
        input_grads.append(g)
        stage_backward_weight(stage.weights, groups)
    return [p.grad.clone() for p in stage.weights], input_grads


def test_a_dtype_round_trip_between_forward_and_w_leaves_the_compiled_grads_exact(monkeypatch):
    """``module.double(); module.float()`` after the forward gives each parameter a new ``AccumulateGrad``: W's
    hand-over sees its node's edges are not the graph's and hands the gradients as roots (Note [weight halves
    hand their gradients over]); every weight still accumulates, exactly."""
    with pb.installed():
        stage = _compiled_stage("child")
        (x0,) = _inputs(1)
        want, params = _reference_then_cleared(stage, x0)
        x = x0.clone().requires_grad_()
        out = stage(x).sum()
        stage.double()
        stage.float()
        _, groups = stage_backward_input([out], None, [x], params)
        assert sum(len(group.regions) for group in groups) == 2
        handed = []
        real = _weight_edges._hand_over
        monkeypatch.setattr(_weight_edges, "_hand_over", lambda *a: handed.append(real(*a)) or handed[-1])
        stage_backward_weight(params, groups)
        got = [p.grad for p in params]
    assert handed == [None]  # the hand-over declined: the node it made pointed at the new accumulators
    _assert_equal(got, want)


def _w_calls(stage: nn.Module) -> collections.Counter:
    """W's Python ``"call"`` events by function (Note [counted host cost] in ``ppbackward._tools.bench.calls``),
    one accumulating microbatch after two warm-up ones."""
    from ppbackward._tools.bench.calls import _counted

    params = list(stage.parameters())
    for x0 in _inputs(3):
        x = x0.clone().requires_grad_()
        _, groups = stage_backward_input([stage(x).sum()], None, [x], params)
        calls: collections.Counter = collections.Counter()
        _counted(functools.partial(stage_backward_weight, params, groups), calls)
    return calls


_PUBLIC_APPLY_IS_PYTHON = not isinstance(
    torch.autograd.Function.__dict__["apply"], type(torch._C._FunctionBase.__dict__["apply"])
)


@pytest.mark.parametrize("public_apply", [False, True], ids=["ours", "negative-control"])
def test_w_of_compiled_blocks_enters_no_python_frame_per_parameter_handed_over(public_apply, monkeypatch):
    """Note [weight halves hand their gradients over]: the node handing the weight halves' gradients to the
    graph's ``AccumulateGrad`` nodes is made by torch's C ``apply``; torch's Python ``Function.apply`` (torch
    2.13 and older; 2.14's is the C one already, and the counted control skips there) enters a frame per
    argument. Counted: two blocks hand over 8 parameters, and no function of W runs 8 times but the weight
    halves' own aten ops (``aot_eager`` runs the graph op by op); with the public ``apply`` one does."""
    if public_apply:
        if not _PUBLIC_APPLY_IS_PYTHON:
            pytest.skip("this torch's Function.apply is the C one: no frame per argument to count")
        monkeypatch.setattr(_weight_edges, "_WEIGHT_HALF_APPLY", _weight_edges._WeightHalf.apply)
    with pb.installed():
        stage = _compiled_stage("child")
        n_leaves = sum(1 for _ in stage.blocks.parameters())
        calls = _w_calls(stage)
    assert n_leaves == 8
    most = max(n for where, n in calls.items() if not where.startswith("_ops.py:"))
    if public_apply:
        assert most >= n_leaves, calls.most_common(3)
    else:
        assert most < n_leaves, calls.most_common(3)


class _EinsumBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(D, D))
        self.l1 = nn.Linear(D, D)
        self.l2 = nn.Linear(D, D)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(torch.einsum("si,io->so", x, self.a))))


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "negative-control"])
def test_b_and_w_under_autocast_after_a_forward_outside_it_equal_the_full_backward(recorded, monkeypatch):
    """Note [weight halves run under the input half's autocast]: the forward in float32, the backward under
    ``torch.autocast("cpu", bfloat16)`` (``aot_eager`` runs aten ops, which autocast casts): the weight half runs
    in W under the autocast state the input half saw in B, so B + W equal the compiled full backward under the
    same autocast bitwise. Without the recorded state (negative control) the weight half ran with autocast off:
    a dtype error in the einsum's weight gradient (hostile review)."""
    if not recorded:
        monkeypatch.setattr(_compiled, "_autocast_now", lambda: ())
    torch.manual_seed(0)
    with pb.installed():
        blocks = [_EinsumBlock() for _ in range(2)]
        blocks[1].load_state_dict(blocks[0].state_dict())
        ref, mod = (torch.compile(b, backend="aot_eager") for b in blocks)
        x0, grad = torch.randn(3, D), torch.randn(3, D)
        out = ref(x0.clone().requires_grad_())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.autograd.backward(out, grad)
        x = x0.clone().requires_grad_()
        out = mod(x)
        params = list(blocks[1].parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, groups = stage_backward_input((out,), (grad,), [x], params)
            assert sum(len(group.regions) for group in groups) == 1
            if not recorded:
                with pytest.raises(RuntimeError, match="expected scalar type"):
                    stage_backward_weight(params, groups)
                return
            stage_backward_weight(params, groups)
    _assert_equal([p.grad for p in params], [p.grad for p in blocks[0].parameters()])


@pytest.mark.parametrize("earlier", ["b-view", "b-gradient-edge", "full-backward"])
def test_a_second_backward_through_a_compiled_stage_is_refused_by_b_and_touches_no_grad(earlier):
    """Hostile review: outputs B cannot detach (a view, a ``GradientEdge``) of a wholly compiled stage, backpropagated
    a second time, or after a full backward, gave autograd's bare "backward through the graph a second time".
    B's own error now, autograd's chained (Note [a graph freed under a compiled region]); no ``.grad`` touched,
    and the earlier microbatch's W still exact."""
    with pb.installed():
        stage = _compiled_stage("stage")
        (x0,) = _inputs(1)
        want, params = _reference_then_cleared(stage, x0)
        x = x0.clone().requires_grad_()
        out = stage(x)
        root = torch.autograd.graph.get_gradient_edge(out) if earlier == "b-gradient-edge" else out.view(-1)
        grad = torch.ones_like(out) if earlier == "b-gradient-edge" else torch.ones(out.numel())
        groups = None
        if earlier == "full-backward":
            torch.autograd.backward(root, grad)
        else:
            _, groups = stage_backward_input([root], [grad], [x], params)
        before = [None if p.grad is None else p.grad.clone() for p in params]
        with pytest.raises(pb.StageBackwardError, match=r"already backpropagated .*\(CompiledFunctionBackward") as info:
            stage_backward_input([root], [grad], [x], params)
        assert "autograd stopped B at CompiledFunctionBackward" in str(info.value)
        assert "backward through the graph a second time" in str(info.value.__cause__)
        _assert_equal([p.grad for p in params], before)  # the refused B accumulated nothing
        if groups is not None:
            stage_backward_weight(params, groups)
    _assert_equal([p.grad for p in params], want)


def _scaled_region_grads(emulate: bool) -> list[tuple[Any, Any]]:
    """(split, whole) of each gradient of ``tanh((x @ w) * g + c) @ w.t()`` in bfloat16, inductor, one
    microbatch each way (a hostile tester's region)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    torch.manual_seed(0)
    g, c = nn.Parameter(torch.randn(8, dtype=torch.bfloat16)), nn.Parameter(torch.randn(1, 8, dtype=torch.bfloat16))
    w = nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16) / 3)
    params = [g, c, w]
    with inductor_config.patch(emulate_precision_casts=emulate), pb.installed():
        f = torch.compile(lambda x: torch.tanh((x @ w) * g + c) @ w.t(), backend="inductor")
        x0, gy = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
        x = x0.clone().requires_grad_()
        f(x).backward(gy)
        whole = [*[p.grad for p in params], x.grad]
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        (dx,), groups = stage_backward_input((f(x),), (gy,), [x], params)
        stage_backward_weight(params, groups)
    torch._dynamo.reset()
    return list(zip([*[p.grad for p in params], dx], whole))


@pytest.mark.slow
def test_inductor_halves_in_bfloat16_round_a_value_the_whole_graph_kept_in_float32():
    """Documented (how-it-works.md, "Known limits"): inductor compiles each half on its
    own, so a value the whole backward keeps in float32 inside one fused kernel (``(x @ w) * g`` before the
    reductions for ``g`` and ``c``) crosses the cut stored in bfloat16; those two gradients may differ from the
    compiled full backward by one bfloat16 ulp of their scale, the others are equal. With inductor's
    ``emulate_precision_casts`` the whole graph rounds there too, and the halves equal it bit for bit."""
    pairs = _scaled_region_grads(emulate=False)
    for got, want in pairs:
        ulp = torch.finfo(torch.bfloat16).eps * float(want.abs().max())
        assert float((got.float() - want.float()).abs().max()) <= ulp
    assert torch.equal(*pairs[2]) and torch.equal(*pairs[3])  # w's gradient and the input's
    for got, want in _scaled_region_grads(emulate=True):
        assert torch.equal(got, want)
