"""torch 2.15's released stage outputs (``release_fwd_send_outputs``), with ppbackward installed.

From 2.15 on, a non-last stage drops its reference to an output once the output's send completed
and hands the backward a ``GradientEdge`` in its place (``None`` for a released output that needs
no grad): B of a middle stage, and the full backward that stage 0 runs at W time, get edges as
roots. The runtime releases only after a cross-rank send; every stage of these tests lives in one
process (world size 1), where sends never happen, so each stage's ``forward_one_chunk`` is followed
by what the runtime does once a send completed: ``get_fwd_send_ops`` (marks the sends pending;
the ops are not run) and ``release_fwd_send_outputs``. Stage code, schedules and the backward are
torch's and ppbackward's. The torchrun matrix (tests/multiproc) runs the real cross-rank case.

Checked: what reached the installed functions (edges and ``None`` entries on a torch whose
``stage.py`` has ``roots_may_be_edges``, plain tensors before), grads equal plain autograd,
post-accumulate-grad hooks once per parameter per microbatch, and no tensor or autograd node left
in a reference cycle by a step."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining import stage as upstream_stage

import ppbackward as pb
from ppbackward import _compat

N_MICROBATCHES = 2
BATCH = 4
NAMES = ("stage_backward", "stage_backward_input", "stage_backward_weight")


class Link(nn.Module):
    """``tanh(lin(x) * w + aux)``; a non-last link also returns ``aux_out = x.detach() + 1``, an output
    that needs no grad (2.15 releases it to ``None``), which the next link adds in."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.rand(4) + 0.5)
        self.last = last

    def forward(self, x, aux=None):
        h = self.lin(x) * self.w
        y = torch.tanh(h if aux is None else h + aux)
        return y if self.last else (y, x.detach() + 1)


class Chain(nn.Module):
    """The reference: the links applied in order, as the pipeline does."""

    def __init__(self, links: list[Link]) -> None:
        super().__init__()
        self.links = nn.ModuleList(links)

    def forward(self, x):
        aux = None
        for link in self.links:
            out = link(x, aux)
            x, aux = (out, None) if link.last else out
        return x


def _loss(out, target):
    return (out - target).pow(2).sum()


def _release_after_forward(stage) -> None:
    """Follow each forward by what 2.15's runtime does once the forward's send completed."""
    forward = stage.forward_one_chunk

    def forward_then_release(fwd_chunk_id, *args, **kwargs):
        out = forward(fwd_chunk_id, *args, **kwargs)
        stage.get_fwd_send_ops(fwd_chunk_id)  # marks the sends pending; the ops are not run
        stage.release_fwd_send_outputs(fwd_chunk_id)
        return out

    stage.forward_one_chunk = forward_then_release


class Recorder:
    """Wraps the installed functions in ``stage`` and records the kinds of the roots each call got."""

    def __init__(self) -> None:
        self.roots: dict[str, list[tuple[str, ...]]] = {n: [] for n in NAMES}
        self.installed = {n: getattr(upstream_stage, n) for n in NAMES}

    def _wrap(self, name):
        inner = self.installed[name]

        def record(*args, **kwargs):
            if name != "stage_backward_weight":
                outputs = args[0]
                entries = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
                self.roots[name].append(tuple(_kind(e) for e in entries))
            return inner(*args, **kwargs)

        return record

    def __enter__(self) -> Recorder:
        for name in NAMES:
            setattr(upstream_stage, name, self._wrap(name))
        return self

    def __exit__(self, *exc) -> None:
        for name in NAMES:
            setattr(upstream_stage, name, self.installed[name])

    def kinds(self, name: str) -> set[str]:
        return {k for call in self.roots[name] for k in call}


def _kind(entry) -> str:
    if isinstance(entry, GradientEdge):
        return "edge"
    return "none" if entry is None else "tensor"


# name -> number of stages, all on this rank
SCHEDULES = {"Interleaved1F1B": 3, "InterleavedZeroBubble": 3, "ZBVZeroBubble": 2}


class Pipeline:
    def __init__(self, name: str) -> None:
        cls = getattr(schedules, f"Schedule{name}", None)
        if cls is None:
            pytest.skip(f"torch {torch.__version__} has no Schedule{name}")
        n = SCHEDULES[name]
        torch.manual_seed(0)
        self.links = [Link(last=i == n - 1) for i in range(n)]
        self.ref = copy.deepcopy(Chain(self.links))
        self.fired = 0
        self.params = [p for m in self.links for p in m.parameters()]
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._count)
        stages = [PipelineStage(m, i, n, torch.device("cpu")) for i, m in enumerate(self.links)]
        self.releases = hasattr(upstream_stage._PipelineStageBase, "release_fwd_send_outputs")
        if self.releases:
            for stage in stages:
                _release_after_forward(stage)
        options = {"n_microbatches": N_MICROBATCHES, "loss_fn": _loss}
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            options["scale_grads"] = False
        self.schedule = cls(stages, **options)

    def _count(self, _param) -> None:
        self.fired += 1

    def step(self, x, target) -> None:
        for p in self.params:
            p.grad = None
        self.fired = 0
        self.schedule.step(x, target=target)

    def reference(self, x, target) -> list[torch.Tensor | None]:
        self.ref.zero_grad(set_to_none=True)
        for chunk, t in zip(x.tensor_split(N_MICROBATCHES), target.tensor_split(N_MICROBATCHES)):
            _loss(self.ref(chunk), t).backward()
        return [p.grad for p in self.ref.parameters()]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_released_outputs_reach_ppbackward_as_edges_and_grads_stay_exact(
    name, process_group, cyclic_garbage
):
    if _compat.contract_for().adapter == "legacy":
        pytest.skip("torch 2.5's PipelineStage wants input_args and P2P between its own stages")
    pipe = Pipeline(name)
    torch.manual_seed(1)
    x, target = torch.randn(BATCH, 4), torch.randn(BATCH, 4)
    with pb.installed():
        pipe.step(x, target)  # warm-up: lazy buffers, shape inference
        with Recorder() as seen:
            found = cyclic_garbage(lambda: pipe.step(x, target))
    for got, ref in zip(pipe.params, pipe.reference(x, target)):
        torch.testing.assert_close(got.grad, ref, rtol=1e-5, atol=1e-6)
    assert pipe.fired == len(pipe.params) * N_MICROBATCHES
    assert found.tensors == 0 and found.nodes == 0, found

    edges = _compat.contract_for().shape.roots_may_be_edges
    assert pipe.releases == edges, "the stage.py probe and the stage's API disagree"
    calls = set(seen.roots["stage_backward"]) | set(seen.roots["stage_backward_input"])
    # ("tensor",): the last stage's loss. A non-last stage's (y, aux_out): both released on 2.15,
    # y to its edge and aux_out (no grad) to None; the tensors themselves before.
    assert calls == {("tensor",), ("edge", "none") if edges else ("tensor", "tensor")}, seen.roots
    if name == "InterleavedZeroBubble":  # B of the middle stage; W of stage 0 is a full backward
        assert set(seen.roots["stage_backward_input"]) >= {("edge", "none") if edges else ("tensor", "tensor")}
        assert seen.roots["stage_backward"], seen.roots
