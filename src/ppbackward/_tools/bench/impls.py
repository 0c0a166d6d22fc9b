"""The backward variants compared by the benchmark, each timed from a fresh forward.

Private module. Every variant receives the stage and the output of a forward that was *not* timed,
and returns the seconds spent in each of its phases:

* ``plain``: ``torch.autograd.backward`` (parameter and input grads, one engine call);
* ``upstream``: ``torch.distributed.pipelining._backward`` B then W (torch's own functions, taken
  from the module at import time, so a concurrent ``ppbackward.install()`` does not change them);
* ``ppbackward``: ``ppbackward.stage_backward_input`` then ``ppbackward.stage_backward_weight``;
* ``full``: ``ppbackward.stage_backward``.

Both split implementations get what torch's ``PipelineStage`` passes them: a tuple of outputs, a
tuple of gradients, the list of inputs and an iterator over the parameters.
"""

from __future__ import annotations

import time
from typing import Any, Callable, cast

import torch
from torch.distributed.pipelining import _backward as _upstream

import ppbackward.backward as _ours
from ppbackward._tools.harness.models import Stage

__all__ = [  # private module: what other modules use
    "RUNNERS",
    "SPLIT",
    "UPSTREAM_B",
    "UPSTREAM_W",
    "VARIANTS",
    "UpstreamSplit",
    "grads_match",
    "run_b",
    "run_variant",
    "run_w",
]

# torch's functions as imported, whatever ppbackward.install() does later in this process.
UPSTREAM_B = _upstream.stage_backward_input
UPSTREAM_W = _upstream.stage_backward_weight

VARIANTS = ("plain", "upstream", "ppbackward", "full")
SPLIT: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "upstream": (UPSTREAM_B, UPSTREAM_W),
    "ppbackward": (_ours.stage_backward_input, _ours.stage_backward_weight),
}


class UpstreamSplit:
    """torch's B and W (as imported) under the names ``stage_backward_input``/``stage_backward_weight``."""

    stage_backward_input = staticmethod(UPSTREAM_B)
    stage_backward_weight = staticmethod(UPSTREAM_W)


def run_b(impl: str, stage: Stage, out: torch.Tensor) -> Any:
    """B of ``impl``; returns its ``param_groups``."""
    b, _ = SPLIT[impl]
    _, groups = b((out,), (stage.grad,), [stage.x], iter(stage.params))
    return groups


def run_w(impl: str, stage: Stage, groups: Any) -> None:
    """W of ``impl``."""
    _, w = SPLIT[impl]
    w(iter(stage.params), groups)


def _plain(stage: Stage, out: torch.Tensor, clock: Callable[[], float]) -> dict[str, float]:
    t0 = clock()
    torch.autograd.backward((out,), (stage.grad,))
    return {"total": clock() - t0}


def _full(stage: Stage, out: torch.Tensor, clock: Callable[[], float]) -> dict[str, float]:
    t0 = clock()
    _ours.stage_backward((out,), (stage.grad,), [stage.x])
    return {"total": clock() - t0}


def _split(impl: str) -> Callable[[Stage, torch.Tensor, Callable[[], float]], dict[str, float]]:
    def run(stage: Stage, out: torch.Tensor, clock: Callable[[], float]) -> dict[str, float]:
        t0 = clock()
        groups = run_b(impl, stage, out)
        t1 = clock()
        run_w(impl, stage, groups)
        t2 = clock()
        return {"b": t1 - t0, "w": t2 - t1, "total": t2 - t0}

    return run


RUNNERS = {
    "plain": _plain,
    "upstream": _split("upstream"),
    "ppbackward": _split("ppbackward"),
    "full": _full,
}


def run_variant(name: str, stage: Stage, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Forward (untimed), then the timed backward of variant ``name``."""
    out = stage.model(stage.x)
    return RUNNERS[name](stage, out, clock)


def grads_match(stage: Stage) -> dict[str, bool]:
    """Run each variant once and compare its parameter and input grads with plain autograd's."""
    from ppbackward._tools.harness.models import reset_grads

    def snapshot() -> list[torch.Tensor]:
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in stage.params]

    reset_grads(stage)
    run_variant("plain", stage)
    ref, ref_x = snapshot(), cast(torch.Tensor, stage.x.grad).clone()
    verdict = {}
    for name in VARIANTS[1:]:
        reset_grads(stage)
        out = stage.model(stage.x)
        if name == "full":
            (gx,) = _ours.stage_backward((out,), (stage.grad,), [stage.x])
        else:
            b, w = SPLIT[name]
            (gx,), groups = b((out,), (stage.grad,), [stage.x], iter(stage.params))
            w(iter(stage.params), groups)
        ok = gx is not None and torch.allclose(gx, ref_x, rtol=1e-4, atol=1e-5)
        ok = ok and all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(snapshot(), ref))
        verdict[name] = bool(ok)
    reset_grads(stage)
    return verdict
