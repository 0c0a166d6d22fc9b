"""B+W with issue 21's guards on against B+W with them patched out, in one process, interleaved (min of 100).

docs/performance.md, "The cost of the guards". ``AA=1`` keeps the guards on in both variants (the noise
control); also times W's check alone (1,000 calls on the same groups).

    python scripts/guard_cost.py 4x64x16 16x64x16 16x256x16
"""
import contextlib
import gc
import os
import sys
import time

import torch
from _usage import exit_if_help

import ppbackward._handoff as pgm
import ppbackward.backward as bw
from ppbackward._tools.bench.impls import run_b, run_w
from ppbackward._tools.harness.models import Config, build, reset_grads

exit_if_help(__doc__)
torch.set_num_threads(1)
AA = bool(os.environ.get("AA"))
orig_init, orig_check, orig_claimed, orig_claim = (
    pgm.ParamGroups.__init__, pgm.ParamGroups._check_unchanged, bw._outputs_claimed, pgm.ParamGroups._claim)


def plain_init(self, groups, weight_ids, owners=(), pinned=None):
    self._groups = groups
    self._weight_ids = weight_ids
    self._owners = owners
    self._pinned = pinned or []
    self._consumed = False
    self._versions = []
    self._shapes = []


def plain_claim(self):
    self._consumed = True
    return True


def guards(on: bool) -> None:
    on = on or AA
    pgm.ParamGroups.__init__ = orig_init if on else plain_init
    pgm.ParamGroups._check_unchanged = orig_check if on else (lambda self, w: None)
    pgm.ParamGroups._claim = orig_claim if on else plain_claim
    bw._outputs_claimed = orig_claimed if on else (lambda outs: contextlib.nullcontext())


def once(stage, on: bool, accumulate: bool) -> float:
    guards(on)
    if not accumulate:
        reset_grads(stage)
    out = stage.model(stage.x)
    t0 = time.perf_counter()
    groups = run_b("ppbackward", stage, out)
    run_w("ppbackward", stage, groups)
    return time.perf_counter() - t0


for spec in sys.argv[1:]:
    layers, d, seq = map(int, spec.split("x"))
    stage = build(Config(layers, d, seq))
    n_versions = None
    for accumulate in (False, True):
        best = {True: float("inf"), False: float("inf")}
        for rep in range(100):
            gc.collect()
            gc.disable()
            for on in ((True, False) if rep % 2 else (False, True)):
                best[on] = min(best[on], once(stage, on, accumulate))
            gc.enable()
        guards(True)
        out = stage.model(stage.x)
        groups = run_b("ppbackward", stage, out)
        n_versions, n_shapes = len(groups._versions), len(groups._shapes)
        t0 = time.perf_counter()
        for _ in range(1000):
            groups._check_unchanged(stage.params)
        check = (time.perf_counter() - t0) / 1000
        run_w("ppbackward", stage, groups)
        regime = "accumulating" if accumulate else "first"
        print(f"{spec} {regime}: B+W guards on {best[True]*1e3:.3f} ms, off {best[False]*1e3:.3f} ms, "
              f"ratio {best[True]/best[False]:.3f}; W's check alone {check*1e6:.1f} us "
              f"({n_versions} captured grads, {n_shapes} params)")
