"""torch's zero-bubble schedules on stages whose blocks are torch.compile'd (every stage in this process, gloo,
world size 1): torch refuses them on its own; with ppbackward installed they run, B and W split inside each
compiled region (Note [compiled regions split in two] in ppbackward._compiled), and the grads equal a plain
autograd reference of the same compiled blocks."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, schedules

import ppbackward as pb
from ppbackward import _compiled, backward
from tests.compat.test_compat_schedules import BATCH, N_MICROBATCHES, _data, _loss, _schedule_class

ZERO_BUBBLE = ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class StageModule(nn.Module):
    """Two blocks, each a compiled child (``torch.compile(block)``: an ``OptimizedModule``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([torch.compile(Block(), backend="aot_eager") for _ in range(2)])  # type: ignore[misc]

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _pipeline(name: str):
    torch._dynamo.reset()
    torch.manual_seed(0)
    mods = [StageModule() for _ in range(2)]
    extra: dict = {}
    if "input_args" in inspect.signature(PipelineStage.__init__).parameters:  # torch 2.5
        extra["input_args"] = (torch.randn(BATCH // N_MICROBATCHES, 4),)
    stages = [PipelineStage(m, i, 2, torch.device("cpu"), **extra) for i, m in enumerate(mods)]
    options = {"n_microbatches": N_MICROBATCHES, "loss_fn": _loss}
    if "scale_grads" in inspect.signature(_schedule_class(name).__init__).parameters:
        options["scale_grads"] = False
    return mods, lambda: _schedule_class(name)(stages, **options)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_torch_refuses_compiled_blocks_on_its_own(name, same_rank_transport):
    if not hasattr(schedules, "_check_torch_compile_compatibility"):
        pytest.skip(f"torch {torch.__version__}'s schedules do not check for compiled modules")
    _, make = _pipeline(name)
    with pytest.raises(RuntimeError, match=r"torch\.compile"):
        make()


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_installed_zero_bubble_schedules_split_compiled_blocks_exactly(name, same_rank_transport, monkeypatch):
    if not _compiled.support().ok:
        pytest.skip(_compiled.support().why)
    split = []
    real = backward._build_groups

    def counting(*args, **kwargs):  # how many regions each B split (B builds its groups once)
        groups = real(*args, **kwargs)
        split.append(sum(len(group.regions) for group in groups))
        return groups

    monkeypatch.setattr(backward, "_build_groups", counting)  # ppbackward's own name: torch's modules untouched
    x, target = _data()
    with pb.installed():
        mods, make = _pipeline(name)
        ref = copy.deepcopy(nn.Sequential(*[m.blocks for m in mods]))
        schedule = make()
        schedule.step(x, target=target)
        for m in mods:
            m.zero_grad(set_to_none=True)
        split.clear()
        schedule.step(x, target=target)
    # both blocks of every stage, every microbatch B ran (DualPipeV with 2 microbatches runs full backwards)
    assert all(n == 2 for n in split) and (split or name == "DualPipeV"), split
    for chunk, t in zip(x.tensor_split(N_MICROBATCHES), target.tensor_split(N_MICROBATCHES)):
        out = chunk
        for blocks in ref:
            for block in blocks:
                out = block(out)
        _loss(out, t).backward()
    params = [p for m in mods for p in m.parameters()]
    for got, want in zip(params, ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
