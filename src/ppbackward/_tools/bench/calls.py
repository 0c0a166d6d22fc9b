"""Python function calls per microbatch of the full backward, B and W: a host cost that load does not move.

Private module (issue 36). Note [counted host cost]: on shared or loaded cores a timing of B and W moves
by tens of percent between runs; the number of Python frames they enter does not. This counts the
``"call"`` events ``sys.setprofile`` reports (a Python function, method or generator frame entered or
resumed; C functions are ``"c_call"`` events and not counted) while one microbatch's full backward
(ppbackward's ``stage_backward``), B (``stage_backward_input``) and W (``stage_backward_weight``) run on a
fresh forward of a bench stage, grads accumulating, after two warm-up microbatches (imports, per-type
caches). Divided by the autograd nodes of the stage's graph it gives calls per node: the default path's
target is B + W <= 2 per node (issue 36), i.e. no Python frame per node of the graph.
"""

from __future__ import annotations

import gc
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import ppbackward._plan as _plan
import ppbackward.backward as _ours
from ppbackward._gc_pause import automatic_gc_paused
from ppbackward._tools.harness.models import Config, Stage, build

__all__ = [  # private module
    "COUNT_CONFIGS", "SLOW_PATHS", "CallCounts", "count_all", "count_calls", "count_calls_by_function",
    "count_slow_path", "format_calls", "slow_path_stage",
]


class CallCounts(NamedTuple):
    """Python ``"call"`` events of one microbatch: the full backward's, B's and W's, and the graph's nodes."""

    config: str
    nodes: int
    full: int
    b: int
    w: int

    @property
    def bw(self) -> int:
        return self.b + self.w

    def per_node(self) -> tuple[float, float, float, float]:
        """(full, B, W, B + W) calls per autograd node."""
        n = max(self.nodes, 1)
        return self.full / n, self.b / n, self.w / n, self.bw / n


def _counted(fn: Callable[[], Any], counter: Counter | None = None) -> tuple[int, Any]:
    """``fn()``'s result with the number of Python ``"call"`` events it made (per function in ``counter``)."""
    n = 0

    def prof(frame, event, _arg) -> None:
        nonlocal n
        if event == "call":
            n += 1
            if counter is not None:
                code = frame.f_code
                counter[f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}:{code.co_firstlineno}"] += 1

    # no collection inside ``fn``: one would call the gc callbacks (the leak tools' ``_on_gc``, one frame at
    # its start and one at its stop), frames that are not ``fn``'s. Counting the collector's generations from
    # 0 is not enough: ``fn`` itself allocates past the young threshold on some runs (seen in a full-suite CI
    # run: W 53 instead of 51 with a tensor hook; and on torch 2.5.1 after torch.compile ran in the process)
    gc.collect()
    # B's own path only: the test suite's check of each reused plan (Note [one plan per graph structure]) is
    # not B's work, and is off while counting
    verify, _plan.VERIFY = _plan.VERIFY, False
    with automatic_gc_paused(always=True):
        previous = sys.getprofile()
        sys.setprofile(prof)
        try:
            out = fn()
        finally:
            sys.setprofile(previous)
            _plan.VERIFY = verify
    return n - 1, out  # the profiler's own return into this frame is not an event; fn's frame is one


def graph_nodes(stage: Stage) -> int:
    """The autograd nodes of one microbatch's graph of ``stage`` (as ``bench.split.graph_nodes``)."""
    from ppbackward._graph import analyze, gradient_edge

    out = stage.model(stage.x)
    return len(analyze([gradient_edge(out)], {gradient_edge(stage.x).node}).structure.nodes)


def _accumulating(stage: Stage) -> None:
    for p in stage.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    stage.x.grad = None


def _drop_groups(groups: Any) -> None:
    """Empty torch's param-group dicts after its W: torch 2.5's B leaves cycles through the hooks it registers
    on autograd nodes (C++ holds them), which only this breaks (ppbackward's ``ParamGroups`` hold none)."""
    if isinstance(groups, list):
        for group in groups:
            if isinstance(group, dict):
                group.clear()


def count_calls(cfg: Config, b: Callable[..., Any] | None = None, w: Callable[..., Any] | None = None) -> CallCounts:
    """The Python calls of one microbatch of ``cfg``'s bench stage (Note [counted host cost]); ``b``/``w``
    replace ppbackward's B and W (e.g. torch's, for contrast)."""
    b = b or _ours.stage_backward_input
    w = w or _ours.stage_backward_weight
    stage = build(cfg)
    _accumulating(stage)
    nodes = graph_nodes(stage)
    for _ in range(2):  # warm-up: imports, per-type caches
        out = stage.model(stage.x)
        _ours.stage_backward((out,), (stage.grad,), [stage.x])
        out = stage.model(stage.x)
        _, groups = b((out,), (stage.grad,), [stage.x], iter(stage.params))
        w(iter(stage.params), groups)
        _drop_groups(groups)
        del out, groups
    out = stage.model(stage.x)
    full, _ = _counted(lambda: _ours.stage_backward((out,), (stage.grad,), [stage.x]))
    out = stage.model(stage.x)
    n_b, (_, groups) = _counted(lambda: b((out,), (stage.grad,), [stage.x], iter(stage.params)))
    n_w, _ = _counted(lambda: w(iter(stage.params), groups))
    _drop_groups(groups)
    return CallCounts(cfg.name, nodes, full, n_b, n_w)


def count_calls_by_function(cfg: Config) -> tuple[Counter, Counter]:
    """Where B's and W's Python calls go: ``{file:function: calls}`` for one microbatch of ``cfg``."""
    stage = build(cfg)
    _accumulating(stage)
    for _ in range(2):
        out = stage.model(stage.x)
        _, groups = _ours.stage_backward_input((out,), (stage.grad,), [stage.x], iter(stage.params))
        _ours.stage_backward_weight(iter(stage.params), groups)
    out = stage.model(stage.x)
    cb: Counter = Counter()
    cw: Counter = Counter()
    _, (_, groups) = _counted(
        lambda: _ours.stage_backward_input((out,), (stage.grad,), [stage.x], iter(stage.params)), cb
    )
    _counted(lambda: _ours.stage_backward_weight(iter(stage.params), groups), cw)
    return cb, cw


COUNT_CONFIGS = (Config(4, 16, 4), Config(16, 64, 16))

# Note [slow paths counted]: the graphs that take B's other paths, counted the same way. ``tensor hook``: a
# tensor hook (returning its gradient unchanged) on the output of every ``nn.Linear`` of the stage, an
# intermediate's activation: B's capture is a node pre-hook on every graph (Note [capturing intermediates]),
# so this costs only the hooks' own frames. ``saved-tensor hooks``: the forward under an identity
# ``saved_tensors_hooks`` pair: B runs W's work of the hooked nodes itself (Note [hooked saved tensors run
# once]); the pair's own unpack frames count too.
SLOW_PATHS = ("tensor hook", "saved-tensor hooks")


def _identity(x: Any) -> Any:
    return x


def _same_grad(g: torch.Tensor) -> torch.Tensor:
    return g


def _hook_output(_module: Any, _args: Any, out: torch.Tensor) -> None:
    if out.requires_grad:
        out.register_hook(_same_grad)


class _UnderSavedTensorHooks(torch.nn.Sequential):
    """A stage's model (its one child) whose forward runs under an identity ``saved_tensors_hooks`` pair (Note
    [slow paths counted])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            return self[0](x)


def slow_path_stage(cfg: Config, path: str) -> tuple[Stage, list[Any]]:
    """``cfg``'s bench stage taking one of :data:`SLOW_PATHS` (Note [slow paths counted]) on every forward,
    and the hook handles to remove when done (none for ``"saved-tensor hooks"``, whose model is wrapped).

    Raises:
        ValueError: ``path`` is not one of :data:`SLOW_PATHS`.
    """
    stage = build(cfg)
    if path == "tensor hook":
        linears = [m for m in stage.model.modules() if isinstance(m, torch.nn.Linear)]
        return stage, [m.register_forward_hook(_hook_output) for m in linears]
    if path == "saved-tensor hooks":
        return stage._replace(model=_UnderSavedTensorHooks(stage.model)), []
    raise ValueError(f"unknown slow path {path!r}; one of {SLOW_PATHS}")


def count_slow_path(cfg: Config, path: str) -> CallCounts:
    """:func:`count_calls` with one of :data:`SLOW_PATHS` in place (Note [slow paths counted])."""
    stage, handles = slow_path_stage(cfg, path)
    try:
        _accumulating(stage)
        nodes = graph_nodes(stage)
        b, w = _ours.stage_backward_input, _ours.stage_backward_weight
        for _ in range(2):
            out = stage.model(stage.x)
            _, groups = b((out,), (stage.grad,), [stage.x], iter(stage.params))
            w(iter(stage.params), groups)
        out = stage.model(stage.x)
        full, _ = _counted(lambda: _ours.stage_backward((out,), (stage.grad,), [stage.x]))
        out = stage.model(stage.x)
        n_b, (_, groups) = _counted(lambda: b((out,), (stage.grad,), [stage.x], iter(stage.params)))
        n_w, _ = _counted(lambda: w(iter(stage.params), groups))
    finally:
        for h in handles:
            h.remove()
    return CallCounts(f"{cfg.name} {path}", nodes, full, n_b, n_w)


def count_all(configs: tuple[Config, ...] = COUNT_CONFIGS) -> list[CallCounts]:
    """:func:`count_calls` of each configuration (the issue's two: 225 and 897 nodes), then the slow paths
    (:data:`SLOW_PATHS`) on the first."""
    return [count_calls(cfg) for cfg in configs] + [count_slow_path(configs[0], p) for p in SLOW_PATHS]


def format_calls(rows: list[CallCounts]) -> list[str]:
    """The ``--split`` lines: Python calls per microbatch and per autograd node, full backward, B and W."""
    if not rows:
        return []
    lines = [
        "\nPython calls per microbatch (sys.setprofile 'call' events; Note [counted host cost]), per autograd "
        "node; the default path's target: B+W <= 2 per node; the slow paths: Note [slow paths counted]"
    ]
    for r in rows:
        full, b, w, bw = r.per_node()
        lines.append(
            f"  {r.config:<26} {r.nodes:5d} nodes  full {r.full:6d} ({full:.2f}/node)  B {r.b:6d} ({b:.2f})"
            f"  W {r.w:6d} ({w:.2f})  B+W {r.bw:6d} ({bw:.2f}/node)"
        )
    return lines


if __name__ == "__main__":
    print("\n".join(format_calls(count_all())))
    if "--by-function" in sys.argv:
        cb, cw = count_calls_by_function(COUNT_CONFIGS[0])
        print("B:", sum(cb.values()))
        for k, v in cb.most_common(40):
            print(f"  {v:6d} {k}")
        print("W:", sum(cw.values()))
        for k, v in cw.most_common(25):
            print(f"  {v:6d} {k}")
