"""Private: pipeline × data parallel for the harness: the 2-D mesh, the DDP / FSDP2 wrappers, and what
a data-parallel step must satisfy.

Note [dp x pp layout]: ``world_size = dp * pp``; global rank ``r`` sits at ``(dp_rank, pp_rank) =
divmod(r, pp)`` of the launch's 2-D ``DeviceMesh``, made once with
``init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))`` (:func:`make_mesh`). FSDP2 shards on
its ``"dp"`` dimension: DTensor caches its plans by mesh layout, so one mesh lives for the whole launch
(a mesh rebuilt per case would be equal to the old one and reuse its destroyed groups). Every case also
gets groups of its own, made with the case's timeout (gloo point-to-point ops keep the timeout their
group was made with): one pipeline group per dp rank (``d * pp .. d * pp + pp - 1``), for the
``PipelineStage``, and one data-parallel group per pipeline position (``j, pp + j, ...``), for DDP and
the replica check. Each dp rank feeds its own shard of the data: its batch is drawn from its own seed
(:func:`batch_seed`).

What a data-parallel step must satisfy, on top of the single-pipeline checks: the gradients equal the
single-process reference of the *mean* of the per-shard losses (DDP all-reduces with an average, FSDP2
reduce-scatters with one), compared on the full tensor of FSDP2's sharded gradient; and, with DDP, the
dp replicas hold identical gradients (:func:`replica_failures`): a backward that bypasses
``AccumulateGrad`` never triggers DDP's reducer and leaves them apart (pytorch/pytorch#144530).
"""

from __future__ import annotations

import dataclasses
import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppbackward._compat import torch_release

__all__ = [
    "WRAPS",
    "WRAPS_WITHOUT_DP",
    "Groups",
    "Layout",
    "batch_seed",
    "fsdp2",
    "full_grads",
    "make_groups",
    "make_mesh",
    "replica_failures",
    "wrap",
    "wrap_unavailable",
]

#: ``none``: plain stage modules; ``ddp``: ``DistributedDataParallel(process_group=dp group)``; ``fsdp``:
#: ``fully_shard(mesh=dp mesh)``; ``fsdp-keep``: the same with ``reshard_after_forward=False``;
#: ``fsdp-titan``: torchtitan's FSDP2 layout (:func:`_shard_like_torchtitan`), also without data parallelism.
WRAPS = ("none", "ddp", "fsdp", "fsdp-keep", "fsdp-titan")
#: The wraps that run without data parallelism too (``--dp 1``).
WRAPS_WITHOUT_DP = ("none", "fsdp-titan")


@dataclasses.dataclass(frozen=True)
class Layout:
    """``dp`` pipelines of ``pp`` ranks each (Note [dp x pp layout])."""

    dp: int
    pp: int

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, pp_rank)`` of global ``rank``."""
        return divmod(rank, self.pp)


@dataclasses.dataclass
class Groups:
    """One case's groups on this rank: the pipeline's, the data-parallel one (``None`` with ``dp == 1``),
    the launch's 2-D mesh (``None`` with ``dp == 1``), and the groups made for the case, to destroy after it."""

    pp: Any
    dp: Any
    mesh: Any
    made: list[Any]

    def destroy(self) -> None:
        for group in self.made:
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        self.made.clear()


def make_mesh(layout: Layout, device_type: str = "cpu") -> Any:
    """The launch's 2-D ``("dp", "pp")`` mesh (Note [dp x pp layout]), or ``None`` with ``dp == 1``."""
    if layout.dp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.dp, layout.pp), mesh_dim_names=("dp", "pp"))


# Note [case groups outlive the case before torch 2.8]: torch 2.5's ``ProcessGroup`` binding destroys the C++
# group with the GIL held, and ``~ProcessGroupGloo`` takes the lock under which a gloo worker thread destroys
# the work it just ran; when that work holds the last reference to a tensor Python had handed it (the replica
# check's ``all_gather``, a stage's P2P buffers), the worker waits for the GIL while holding the lock: the
# rank deadlocks as the case's last reference to its group goes (seen on torch 2.5.1 in ``training-dp``, one
# run in two: a rank stuck at the end of a DDP case, its main thread in ``~ProcessGroupGloo``, a worker in
# ``~AsyncAllgatherWork`` waiting for the GIL). pytorch/pytorch#154976 (June 2025, torch 2.8) releases the GIL
# in that destructor. Before 2.8 every case group is kept until the process exits, when its workers are idle.
_KEEP_GROUPS = torch_release()[:2] < (2, 8)
_KEPT_GROUPS: list[Any] = []


def make_groups(layout: Layout, backend: str, timeout: float, mesh: Any = None) -> Groups:
    """The case's groups (Note [dp x pp layout]); every rank must call it, in the same order."""
    span = timedelta(seconds=timeout)
    if layout.dp == 1:
        group = dist.new_group(backend=backend, timeout=span)
        made = [group]
        groups = Groups(pp=group, dp=None, mesh=None, made=made)
    else:
        dp, pp = layout.dp, layout.pp
        pp_group, _ = dist.new_subgroups_by_enumeration(
            [[d * pp + j for j in range(pp)] for d in range(dp)], timeout=span, backend=backend
        )
        dp_group, _ = dist.new_subgroups_by_enumeration(
            [[d * pp + j for d in range(dp)] for j in range(pp)], timeout=span, backend=backend
        )
        made = [pp_group, dp_group]
        groups = Groups(pp=pp_group, dp=dp_group, mesh=mesh, made=made)
    if _KEEP_GROUPS:  # Note [case groups outlive the case before torch 2.8]
        _KEPT_GROUPS.extend(made)
    return groups


def batch_seed(seed: int, step: int, dp_rank: int) -> int:
    """The seed of one step's batch on one dp rank (its own data shard)."""
    return seed * 1000 + step + 100 * dp_rank


def wrap(module: nn.Module, kind: str, groups: Groups) -> nn.Module:
    """``module`` wrapped for data parallelism as ``kind`` says (see :data:`WRAPS`).

    A module without trainable parameters (a frozen stage) is left as it is: DDP refuses it, and there
    is nothing to reduce.
    """
    if kind == "none" or not any(p.requires_grad for p in module.parameters()):
        return module
    if kind == "fsdp-titan":
        device_type = next(module.parameters()).device.type
        _shard_like_torchtitan(module, groups.mesh["dp"] if groups.mesh is not None else _single_rank_mesh(device_type))
        return module
    if groups.dp is None:
        raise ValueError(f"--wraps {kind} needs --dp 2 or more")
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=groups.dp)
    if kind in ("fsdp", "fsdp-keep"):
        fsdp2().fully_shard(module, mesh=groups.mesh["dp"], reshard_after_forward=kind == "fsdp")
        return module
    raise ValueError(f"unknown wrap {kind!r}; known: {', '.join(WRAPS)}")


def _shard_like_torchtitan(module: nn.Module, mesh: Any) -> None:
    """``fully_shard`` as torchtitan's ``apply_fsdp_to_decoder`` does under pipelining: one unit per entry
    of ``module.fsdp_units()`` (a module or a list of modules sharded together; the whole module where it
    has no such method), then the stage module itself, all with ``reshard_after_forward=False`` (its
    pipeline default; Note [torchtitan's final norm] in ``ppbackward._tools.harness.models``)."""
    fully_shard = fsdp2().fully_shard
    fsdp_units = getattr(module, "fsdp_units", None)
    units = fsdp_units() if callable(fsdp_units) else []
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)


def wrap_unavailable(kind: str, device: torch.device) -> str | None:
    """Why the wrap ``kind`` cannot run on ``device`` with the installed torch, or ``None`` (Note [what torch
    2.5 cannot run] in ``ppbackward._tools.harness.models``)."""
    if kind.startswith("fsdp") and device.type == "cpu" and torch_release()[:2] == (2, 5):
        return f"torch {torch.__version__}'s FSDP2 runs on CUDA only ('FSDP requires CUDA for streams' on CPU)"
    return None


def fsdp2() -> Any:
    """The module of FSDP2's public names (``fully_shard``, ``FSDPModule``): ``torch.distributed.fsdp`` from
    torch 2.6, ``torch.distributed._composable.fsdp`` on 2.5 (the only place 2.5 has them)."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "fully_shard"):
        return fsdp
    from torch.distributed._composable import fsdp as composable

    return composable


@functools.lru_cache(maxsize=1)
def _single_rank_mesh(device_type: str) -> Any:
    """A 1-D mesh of this rank alone (FSDP2 without data parallelism, as torchtitan runs pipelining alone),
    made once per launch (Note [dp x pp layout]); collective: every rank makes its own, together."""
    from torch.distributed.device_mesh import DeviceMesh

    group, _ = dist.new_subgroups(group_size=1)
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp",))


def full_grads(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor | None]]:
    """``(name, grad)`` with every sharded (DTensor) gradient gathered to its full tensor.

    Collective for FSDP2: every rank of a dp group calls it with the same parameters in the same order.
    """
    out = []
    for name, p in named:
        grad = p.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        out.append((name, grad))
    return out


def replica_failures(named: list[tuple[str, nn.Parameter]], dp_group: Any) -> tuple[float, list[str]]:
    """The largest difference between this rank's gradients and the other dp replicas', and failure messages
    (each one line, without the check's name: ``replicas`` failures of the worker).

    One ``all_gather`` over the dp group of every gradient flattened (a missing one as zeros, so every
    rank sends the same size); DDP replicas must be bitwise identical after the step.
    """
    parts = []
    for _, p in named:
        grad = p.grad
        parts.append(torch.zeros(p.numel()) if grad is None else grad.detach().reshape(-1).float().cpu())
    flat = torch.cat(parts) if parts else torch.zeros(0)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(dp_group))]
    dist.all_gather(gathered, flat, group=dp_group)
    worst, worst_name = 0.0, ""
    for other in gathered:
        offset = 0
        for (name, p) in named:
            size = p.numel()
            diff = float((other[offset : offset + size] - flat[offset : offset + size]).abs().max()) if size else 0.0
            if diff > worst:
                worst, worst_name = diff, name
            offset += size
    if worst > 0:
        return worst, [
            f"the dp replicas' gradients differ (max |difference| {worst:.3e}, e.g. {worst_name}): "
            "DDP did not all-reduce them"
        ]
    return 0.0, []
