"""B+W with the automatic gc paused (ppbackward) against B+W with the pause patched out, and the full
backward, in one process, interleaved, the gc on as in training, grads accumulating.

docs/performance.md, "The automatic gc inside B and W" (Note [no collection inside B and W] in
``ppbackward/_gc_pause.py``). Per configuration: the minimum over ROUNDS of the mean F+B+W (F+full) time
of N microbatches, and the collections started per microbatch (all generations, and full ones).

    python scripts/gc_pause_ab.py [N ROUNDS] 4x128x16 4x256x16 16x64x16 16x256x16
"""
import contextlib
import gc
import sys
import time

import torch
from _usage import exit_if_help

import ppbackward.backward as bw
from ppbackward._tools.harness.models import build, parse_configs

torch.set_num_threads(1)
PAUSED = bw.automatic_gc_paused
started = {"all": 0, "full": 0}


def _count(phase, info):
    if phase == "start":
        started["all"] += 1
        started["full"] += info["generation"] == 2


def main(argv):
    n, rounds = (int(argv[0]), int(argv[1])) if argv and argv[0].isdigit() else (100, 4)
    configs = parse_configs(",".join(a for a in argv if not a.isdigit()) or "4x128x16,4x256x16,16x64x16")
    gc.callbacks.append(_count)
    for cfg in configs:
        st = build(cfg)

        def split():
            out = st.model(st.x)
            groups = bw.stage_backward_input([out], [st.grad], [st.x], st.params)[1]
            del out
            bw.stage_backward_weight(st.params, groups)

        def full():
            bw.stage_backward(st.model(st.x), st.grad, [st.x])

        best, seen = {}, {}
        names = ["unpaused", "paused", "full"]
        for r in range(rounds):
            for name in names[r % 3:] + names[: r % 3]:  # the order rotates by one per round
                bw.automatic_gc_paused = contextlib.nullcontext if name == "unpaused" else PAUSED
                fn = full if name == "full" else split
                fn(), fn()
                started.update(all=0, full=0)
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t0) / n * 1e3)
                for k in started:
                    seen[name, k] = seen.get((name, k), 0) + started[k] / (n * rounds)
        bw.automatic_gc_paused = PAUSED
        print(f"{cfg.layers}x{cfg.d_model}x{cfg.seq}: F+B+W ms unpaused {best['unpaused']:.2f}, paused "
              f"{best['paused']:.2f} ({best['paused'] / best['unpaused']:.3f}x), F+full {best['full']:.2f}; "
              "collections per microbatch (full ones) unpaused "
              f"{seen['unpaused', 'all']:.2f} ({seen['unpaused', 'full']:.3f}), paused {seen['paused', 'all']:.2f} "
              f"({seen['paused', 'full']:.3f}), full backward {seen['full', 'all']:.2f} ({seen['full', 'full']:.3f})")


if __name__ == "__main__":
    exit_if_help(__doc__)
    main(sys.argv[1:])
