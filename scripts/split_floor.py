"""The split's floor: what B+W would cost on the host with no ppbackward Python at all.

B then W enter torch's autograd engine three times per microbatch-stage: B's call (the input gradient
and the cheap weight gradients of Note [cheap weight gradients in B], graph retained), W's call that
runs the deferred intermediates (Note [W computes only weight edges]) and W's accumulating call. This
times, per configuration of ``ppbackward bench --split`` (min over interleaved repeats, torch at one
thread, grads accumulating, forward untimed, gc off while timed):

* ``full``: ppbackward's ``stage_backward`` (the denominator);
* ``B engine``: ``torch.autograd.grad`` of the stage input and the cheap weights' edges with
  ``retain_graph=True``, the graph analysed beforehand, untimed: B's engine call without its capture hooks;
* ``W engine``: inside ppbackward's W, the time spent in its two engine entries (the deferred matrix
  products, the accumulation and hooks included);
* ``B``, ``W``: ppbackward's, whole.

``floor = (B engine + W engine) / full`` is what no Python-side design of B and W can go below; ``B+W``
is today's. Run it on an idle machine:

    python scripts/split_floor.py [CONFIGS] [REPEATS]      # e.g. 4x16x4,16x64x16 60
"""

from __future__ import annotations

import gc
import sys
import time

import torch
from _usage import exit_if_help

import ppbackward
import ppbackward._weight_edges as we
from ppbackward._graph import analyze, gradient_edge
from ppbackward._tools.bench.split import CONFIGS
from ppbackward._tools.harness.models import build, parse_configs


class _Engine:
    """Wraps W's two engine entries (``ppbackward._weight_edges``) and sums their time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.originals = (we.weight_edge_grads, we.accumulate)

    def _timed(self, fn):
        def call(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0

        return call

    def __enter__(self) -> _Engine:
        we.weight_edge_grads, we.accumulate = map(self._timed, self.originals)
        return self

    def __exit__(self, *exc: object) -> None:
        we.weight_edge_grads, we.accumulate = self.originals


def _one_round(stage, engine: _Engine) -> dict[str, float]:
    got: dict[str, float] = {}
    out = stage.model(stage.x)
    t0 = time.perf_counter()
    ppbackward.stage_backward((out,), (stage.grad,), [stage.x])
    got["full"] = time.perf_counter() - t0

    out = stage.model(stage.x)
    cheap = analyze([gradient_edge(out)], {gradient_edge(stage.x).node}).cheap
    edges = [leaf.edge for leaf in cheap.leaves]
    del cheap
    t0 = time.perf_counter()
    torch.autograd.grad([out], [stage.x, *edges], [stage.grad], retain_graph=True, allow_unused=True)
    got["b_engine"] = time.perf_counter() - t0
    del out, edges

    out = stage.model(stage.x)
    engine.seconds = 0.0
    t0 = time.perf_counter()
    _, groups = ppbackward.stage_backward_input((out,), (stage.grad,), [stage.x], stage.params)
    t1 = time.perf_counter()
    ppbackward.stage_backward_weight(stage.params, groups)
    got["b"], got["w"], got["w_engine"] = t1 - t0, time.perf_counter() - t1, engine.seconds
    return got


def main(argv: list[str]) -> None:
    configs = parse_configs(argv[0]) if argv else list(CONFIGS)
    repeats = int(argv[1]) if len(argv) > 1 else 40
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; min over {repeats} repeats; us per microbatch-stage")
    print(f"{'config':<10} {'full':>8} {'B engine':>9} {'W engine':>9} {'B':>8} {'W':>8} {'floor':>7} {'B+W':>7}")
    for cfg in configs:
        stage = build(cfg)
        for p in stage.params:
            p.grad = torch.zeros_like(p)
        rounds = []
        with _Engine() as engine:
            for i in range(repeats + 3):
                gc.disable()
                try:
                    got = _one_round(stage, engine)
                finally:
                    gc.enable()
                if i >= 3:  # warm-up
                    rounds.append(got)
        best = {k: 1e6 * min(r[k] for r in rounds) for k in rounds[0]}
        floor = (best["b_engine"] + best["w_engine"]) / best["full"]
        split = (best["b"] + best["w"]) / best["full"]
        print(
            f"{cfg.name:<10} {best['full']:8.0f} {best['b_engine']:9.0f} {best['w_engine']:9.0f} "
            f"{best['b']:8.0f} {best['w']:8.0f} {floor:6.2f}x {split:6.2f}x"
        )


if __name__ == "__main__":
    exit_if_help(__doc__)
    main(sys.argv[1:])
