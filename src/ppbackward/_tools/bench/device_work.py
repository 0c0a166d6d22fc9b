"""The device work of a backward, counted: kernels by name, FLOPs, bytes allocated.

Private module. Counting replaces timing where the question is *what* runs, not how fast: a
``TorchDispatchMode`` sees every ATen op the backward dispatches on the device it runs on (the same graph
on a GPU can dispatch other ops where a backend has its own kernels: cuDNN's batch norm, fused RMSNorm,
another attention kernel), and the FLOP formulas of ``torch.utils.flop_counter`` (its ``flop_registry``, read per op:
``FlopCounterMode`` itself tracks modules with backward hooks that checkpointing's recomputation
refuses) add up the FLOPs of the matrix products, convolutions and attention among them. Both are
deterministic for a given graph, so tests assert them exactly.

What counts as a kernel: every op that is not a view (``OpOverload.is_view``: ``view``, ``t``,
``detach``, ``expand``, ...), which only make tensor metadata. Allocation-only ops (``zeros``,
``new_empty_strided``) count: they are the extra work a split can add. Bytes allocated are the bytes of
the unique storages of a non-view op's outputs that are no input's storage (an in-place op's output is its
input), counted by the one storage accountant, ``ppbackward.leaks._storage``.

The three backwards of one microbatch are compared on fresh graphs of one stage, in one regime:
``"first"`` (every ``.grad`` empty, the first microbatch of a step) or ``"accumulating"`` (every
``.grad`` already holds a gradient). Each implementation runs once uncounted first, so one-time work
(torch's lazy initialisation, ppbackward's per-process probes and W's anchor, Note [W's anchor runs no
kernel]) is not counted.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ppbackward import _graph
from ppbackward._plan import forget_plans
from ppbackward.leaks._storage import storage_nbytes, unique_storages

__all__ = ["REGIMES", "DeviceWork", "bench_work", "cheap_gradients_deferred", "count", "stage_work"]

REGIMES = ("first", "accumulating")


@contextlib.contextmanager
def cheap_gradients_deferred() -> Iterator[None]:
    """Within the block, B computes no weight gradient and W computes them all, as before Note [cheap
    weight gradients in B] (``ppbackward._graph``): the bench's and the tests' reference for what that
    Note saves (its negative control). A measurement switch, so it lives here with the tools, not in the
    core. Not thread-safe: for measurements in one thread only."""
    saved = _graph.CHEAP_EDGES.copy(), _graph.REDUCED_EDGES.copy()
    _graph.CHEAP_EDGES.clear()
    _graph.REDUCED_EDGES.clear()
    forget_plans()  # made with the tables (Note [one plan per graph structure] in ppbackward._plan)
    try:
        yield
    finally:
        _graph.CHEAP_EDGES.update(saved[0])
        _graph.REDUCED_EDGES.update(saved[1])
        forget_plans()


class DeviceWork(NamedTuple):
    """What one backward dispatched.

    Attributes:
        kernels: compute ops by overload packet name (``"mm"``, ``"native_layer_norm_backward"``), views
            and other metadata ops excluded.
        flops: FLOPs by ``torch.utils.flop_counter``'s formulas (matrix products, convolutions, attention).
        allocated_bytes: bytes of the new tensors those ops returned.
    """

    kernels: Counter[str]
    flops: int
    allocated_bytes: int

    @property
    def n_kernels(self) -> int:
        return sum(self.kernels.values())

    def extra_over(self, other: DeviceWork) -> dict[str, int]:
        """Kernels by name that ``self`` ran more (positive) or fewer (negative) times than ``other``."""
        names = set(self.kernels) | set(other.kernels)
        diff = {name: self.kernels[name] - other.kernels[name] for name in sorted(names)}
        return {name: n for name, n in diff.items() if n}


class _Counter(TorchDispatchMode):
    """Counts non-view ops and the bytes of the new tensors they return (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.flops = 0
        self.allocated = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        packet = func.overloadpacket
        self.kernels[packet.__name__] += 1
        flops = flop_registry.get(packet)
        if flops is not None:
            self.flops += flops(*args, **(kwargs or {}), out_val=out)
        inputs = unique_storages(_tensors((args, kwargs)))
        made = unique_storages(_tensors(out))
        self.allocated += sum(storage_nbytes(st) for key, st in made.items() if key not in inputs)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts."""
    found, todo = [], [tree]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
    return found


def count(fn: Callable[[], Any]) -> DeviceWork:
    """Run ``fn()`` and count what it dispatched."""
    counter = _Counter()
    with counter:
        fn()
    return DeviceWork(counter.kernels, counter.flops, counter.allocated)


def _full(outs: list, grads: list | None, inputs: list, weights: list) -> None:
    torch.autograd.backward(outs, grads)


def _split(module: Any) -> Callable[..., None]:
    def run(outs: list, grads: list | None, inputs: list, weights: list) -> None:
        _, groups = module.stage_backward_input(outs, grads, inputs, weights)
        module.stage_backward_weight(weights, groups)

    return run


def stage_work(
    model: torch.nn.Module,
    make_inputs: Callable[[], list],
    make_grads: Callable[[Any], tuple[list, list | None]],
    regime: str,
    impls: dict[str, Any] | None = None,
) -> dict[str, DeviceWork]:
    """The device work of one microbatch's backward of ``model`` under each implementation.

    Args:
        model: the stage; its parameters are the weights.
        make_inputs: returns fresh stage inputs (a list; tensors requiring grad where the stage input does).
        make_grads: the stage's output -> ``(outputs, grads)``: the tensors to backpropagate and their
            gradients (a list), or ``([loss], None)`` for a loss.
        regime: ``"first"`` (every ``.grad`` ``None``) or ``"accumulating"`` (every ``.grad`` zeros).
        impls: name -> a module with ``stage_backward_input``/``stage_backward_weight`` (the split), or
            ``None`` for the full backward. Default: ``full``, ``ppbackward``.

    Returns:
        name -> :class:`DeviceWork` of B+W (or of the full backward), counted on a fresh graph after
        one uncounted run.

    Raises:
        ValueError: an unknown ``regime``.
    """
    if regime not in REGIMES:
        raise ValueError(f"regime: {regime!r} is not one of {REGIMES}")
    if impls is None:
        import ppbackward

        impls = {"full": None, "ppbackward": ppbackward}
    weights = [p for p in model.parameters() if p.requires_grad]
    result = {}
    for name, module in impls.items():
        run = _full if module is None else _split(module)
        work = None
        for _ in range(2):  # the first run is not counted
            for p in weights:
                p.grad = None if regime == "first" else torch.zeros_like(p)
            inputs = make_inputs()
            outs, grads = make_grads(model(*inputs))
            work = count(functools.partial(run, outs, grads, inputs, weights))
            del outs, grads
        assert work is not None
        result[name] = work
    for p in weights:
        p.grad = None
    return result


def bench_work(stage: Any) -> dict[str, Any]:
    """The bench's device-work figures for one configuration (``ppbackward._tools.harness.models.Stage``).

    Returns:
        ``{"regimes": {regime: {impl: {"kernels", "flops", "allocated_bytes"}}}, "held_bytes",
        "held_deferred_bytes", "floor_bytes"}`` for ``impl`` in ``full`` (plain autograd), ``upstream``
        (torch's B+W) and ``ppbackward`` (B+W); the bytes of saved activations held between B and W by
        ppbackward, by ppbackward with the cheap weight gradients deferred to W as before (Note [cheap
        weight gradients in B]), and what W reads (the deferred matmuls' inputs). JSON-ready.
    """
    import ppbackward
    from ppbackward._tools.bench import impls as _impls
    from ppbackward._tools.bench import memory as _memory

    upstream = _impls.UpstreamSplit()
    impls = {"full": None, "upstream": upstream, "ppbackward": ppbackward}

    def fresh_input() -> list:
        return [stage.x.detach().requires_grad_()]

    def with_grad(out: torch.Tensor) -> tuple[list, list]:
        return [out], [stage.grad]

    regimes = {}
    for regime in REGIMES:
        work = stage_work(stage.model, fresh_input, with_grad, regime, impls)
        regimes[regime] = {
            name: {"kernels": dict(w.kernels), "flops": w.flops, "allocated_bytes": w.allocated_bytes}
            for name, w in work.items()
        }
    held = _memory.measure_split("ppbackward", stage)
    with cheap_gradients_deferred():
        before = _memory.measure_split("ppbackward", stage)
    return {
        "regimes": regimes,
        "held_bytes": held["held_bytes"],
        "floor_bytes": held["floor_bytes"],
        "held_deferred_bytes": before["held_bytes"],
    }
