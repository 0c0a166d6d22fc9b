"""One rank of the schedule benchmark: a zero-bubble schedule step, upstream vs ppbackward.

Private module, launched by :mod:`ppbackward._bench._schedule` under torchrun (gloo, CPU). Each rank
holds two stages of ``ScheduleInterleavedZeroBubble`` (stages ``rank`` and ``rank + world``), each a
stack of encoder layers. Steps alternate between torch's backward functions
(``ppbackward.uninstall()``) and ppbackward's (``ppbackward.install()``), after one warm-up step of
each; a step's time is the slowest rank's, the figure is the minimum over repeats. Rank 0 writes the
result as JSON to ``--out``. Every rank compares the gradients of the last step of each
implementation; the verdict is reduced over ranks.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

import ppbackward
from ppbackward._bench._models import build_stack

__all__: list[str] = []  # private module


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers-per-stage", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return _run(args)
    finally:
        ppbackward.uninstall()
        dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    n_stages = 2 * world
    ids = [rank, rank + world]
    mods = [build_stack(args.layers_per_stage, args.d_model, seed=100 + i) for i in ids]
    stages = [PipelineStage(m, i, n_stages, torch.device("cpu")) for m, i in zip(mods, ids)]
    sched = ScheduleInterleavedZeroBubble(
        stages, n_microbatches=args.microbatches, loss_fn=_loss, scale_grads=False
    )
    gen = torch.Generator().manual_seed(7)
    batch = args.microbatches * args.microbatch_size
    x = torch.randn(batch, args.seq, args.d_model, generator=gen)
    target = torch.randn(batch, args.seq, args.d_model, generator=gen)
    params = [q for m in mods for q in m.parameters()]

    def step(impl: str) -> float:
        (ppbackward.install if impl == "ppbackward" else ppbackward.uninstall)()
        for q in params:
            q.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        sched.step(x, target=target, losses=[])
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())

    impls = ("upstream", "ppbackward")
    for impl in impls:  # warm-up
        step(impl)
    best = {impl: float("inf") for impl in impls}
    last: dict[str, Any] = {}
    for r in range(args.repeats):
        for impl in impls if r % 2 == 0 else impls[::-1]:
            best[impl] = min(best[impl], step(impl))
            last[impl] = [q.grad.clone() if q.grad is not None else None for q in params]
    match = all(
        (a is None and b is None)
        or (a is not None and b is not None and torch.allclose(a, b, rtol=1e-4, atol=1e-5))
        for a, b in zip(last["upstream"], last["ppbackward"])
    )
    verdict = torch.tensor([1 if match else 0])
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    if rank == 0:
        result = {
            "schedule": type(sched).__name__,
            "ranks": world,
            "stages": n_stages,
            "layers_per_stage": args.layers_per_stage,
            "d_model": args.d_model,
            "seq": args.seq,
            "microbatches": args.microbatches,
            "microbatch_size": args.microbatch_size,
            "repeats": args.repeats,
            "upstream_ms": best["upstream"] * 1e3,
            "ppbackward_ms": best["ppbackward"] * 1e3,
            "ratio": best["ppbackward"] / best["upstream"],
            "grads_match": bool(verdict.item()),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
