"""Bytes a zero-bubble step leaves alive when B writes the stage inputs' gradients into their ``.grad``.

torch's ``stage_backward_input`` writes each input's gradient into ``input.grad`` (and returns it);
ppbackward's leaves ``.grad`` alone (docs/api.md, Differences). This measures what that costs in torch's
own ``PipelineStage``: one ``ScheduleZBVZeroBubble`` step, 2 ranks (gloo, CPU), 2 stages per rank (V),
after a warm-up step, with

* ``torch``: torch's own backward,
* ``ppbackward``: ppbackward installed (inputs' ``.grad`` untouched),
* ``ppbackward+grad``: ppbackward installed, its B wrapped to write ``.grad`` as torch's does,

and reports, per rank, the bytes of ``.grad`` tensors of non-parameter tensors alive (found through
``gc.get_objects()``) after the step and, for the two ppbackward variants, the most seen at the start of
a W (held between a microbatch's B and its W): what the difference saves. Run it with the torch to
measure:

    torchrun --standalone --nproc-per-node 2 scripts/input_grad_bytes.py
"""

from __future__ import annotations

import gc
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from _usage import exit_if_help
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

import ppbackward
from ppbackward.leaks._heap import instances_of

D, BATCH, MICROBATCHES = 256, 32, 8


def _stage(index: int) -> nn.Module:
    torch.manual_seed(100 + index)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _input_grad_bytes(params: set[int]) -> int:
    seen, total = set(), 0
    for obj in instances_of(torch.Tensor):  # Note [heap scans beside other threads]
        if id(obj) not in params and obj.grad is not None:
            storage = obj.grad.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _step(variant: str, rank: int, world: int) -> dict[str, int]:
    params: set[int] = set()  # ids of this rank's parameters, filled once the stages exist
    if ppbackward.is_installed():
        ppbackward.uninstall()
    if variant != "torch":
        ppbackward.install()
    if variant == "ppbackward+grad":
        import torch.distributed.pipelining.stage as stage_module

        ours = stage_module.stage_backward_input

        def writes_grad(outputs, grads, inputs, weights):
            result, groups = ours(outputs, grads, inputs, weights)
            for x, g in zip(inputs, result):
                if isinstance(x, torch.Tensor) and g is not None:
                    x.grad = g if x.grad is None else x.grad + g
            return result, groups

        stage_module.stage_backward_input = writes_grad
    peak = [0]
    if variant != "torch":  # the bytes held at each W's start (between a microbatch's B and its W)
        import torch.distributed.pipelining.stage as stage_module

        w = stage_module.stage_backward_weight

        def measured_w(weights, groups, retain_graph=False):
            peak[0] = max(peak[0], _input_grad_bytes(params))
            return w(weights, groups, retain_graph)

        stage_module.stage_backward_weight = measured_w
    indices = (rank, 2 * world - 1 - rank)
    modules = [_stage(i) for i in indices]
    shape = (BATCH // MICROBATCHES, D)
    stages = [  # a receive buffer requires grad when its example does: every stage input but stage 0's
        PipelineStage(
            m, i, 2 * world, torch.device("cpu"),
            input_args=(torch.zeros(shape, requires_grad=i > 0),), output_args=(torch.zeros(shape, requires_grad=True),),
        )
        for m, i in zip(modules, indices)
    ]
    schedule = ScheduleZBVZeroBubble(stages, MICROBATCHES, loss_fn=_mse, scale_grads=False)
    params.update(id(p) for m in modules for p in m.parameters())
    for _ in range(2):
        x, target = torch.randn(BATCH, D), torch.zeros(BATCH, D)
        schedule.step(x, target=target, losses=[])
    gc.collect()
    held = _input_grad_bytes(params)
    if ppbackward.is_installed():
        ppbackward.uninstall()
    return {"after_step": held, "peak_at_w": peak[0]}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {variant: _step(variant, rank, world) for variant in ("torch", "ppbackward", "ppbackward+grad")}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print(json.dumps({"torch": torch.__version__, "per_rank": gathered, "microbatch_input_bytes":
                          BATCH // MICROBATCHES * D * 4}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_if_help(__doc__)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
