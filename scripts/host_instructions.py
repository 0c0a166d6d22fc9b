"""Instructions per microbatch of the full backward and of B+W, counted by valgrind's callgrind: a host cost that
does not move with the machine's load (issue 36; Note [counted host cost] counts Python calls, this counts what
the CPU executes for them, the engine's C++ and the interpreter's C included). Figures and caveats:
benchmarks/RESULTS.md, "Instructions, not seconds".

    python scripts/host_instructions.py [--compile BACKEND] [--before COMMIT] [--rungs NAMES] [CONFIG] [MICROBATCHES]
    e.g. python scripts/host_instructions.py --before HEAD 4x16x4 20   (this working tree against its last commit)
         python scripts/host_instructions.py --rungs r2,r3p 4x16x4 20  (rungs of scripts/guarantee_ladder.py too)

Each figure is the difference of two runs of a child under ``valgrind --tool=callgrind`` on the bench stage
(``bench --split``'s, ``CONFIG`` default 4x16x4), both after the same five warm-up microbatches and with the heap
then frozen (``gc.freeze()``): ``MICROBATCHES`` forwards each followed by the backward (grads accumulating)
against as many forwards alone, divided by ``MICROBATCHES``. The full backward is ``torch.autograd.backward``
(not ppbackward's ``stage_backward``: the engine's cost alone); B+W is ppbackward's ``stage_backward_input`` then
``stage_backward_weight``; ``--rungs`` also counts the B+W of those rungs of ``scripts/guarantee_ladder.py``
(named by the first word of the rung's name: ``r0`` ... ``r3p``; eager only). The working tree's
``src/ppbackward`` is copied first (the children import it minutes later); ``--before COMMIT`` also counts that
commit's B+W, exported as ``scripts/side_by_side.py`` does. Children run two at a time, a few minutes each,
with ``PYTHONHASHSEED=0``. Use 20 microbatches or more: with 2, two counts of the same B+W differed by 6 % (the
young collections fall differently).

Raises ``SystemExit`` without valgrind or on a bad argument, ``RuntimeError`` naming the child that failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

HERE = pathlib.Path(__file__).resolve()


def _child(module: str, config: str, mode: str, backwards: int, total: int, backend: str | None) -> None:
    """Under valgrind: five warm-up microbatches, the heap frozen, then ``total`` forwards, the first
    ``backwards`` of them each followed by the backward ``mode`` (``full``, ``split``, or ``rung:NAME``: a ladder
    rung's B then W)."""
    import gc
    import importlib

    import torch

    from ppbackward._tools.harness.models import build, parse_configs

    torch.set_num_threads(1)
    backward = importlib.import_module(f"{module}.backward")
    stage = build(parse_configs(config)[0])
    if backend is not None:  # installed before the first call compiles anything
        from ppbackward._tools.harness.schedule_bench import compile_layers

        importlib.import_module(module).install()
        compile_layers(stage.model, backend)
    params, x, grad = stage.params, stage.x, stage.grad
    rung = _rung(mode[len("rung:") :]) if mode.startswith("rung:") else None

    def one(with_backward: bool) -> None:
        out = stage.model(x)
        if not with_backward:
            return
        if mode == "full":
            torch.autograd.backward((out,), (grad,))
        elif mode.startswith("rung:"):
            b, w = rung
            _, state = b((out,), (grad,), [x], params)
            w(params, state)
        else:
            _, groups = backward.stage_backward_input([out], [grad], [x], iter(params))
            backward.stage_backward_weight(iter(params), groups)

    for _ in range(5):
        one(True)
    # the heap so far (torch, the stage, compiled code) out of the collector's sight: a full collection over it,
    # which the counted microbatches might start or not, would swamp the difference
    gc.collect()
    gc.freeze()
    for i in range(total):
        one(i < backwards)


def _rung(name: str) -> tuple[Callable, Callable]:
    """The ``(B, W)`` of the ladder rung whose name starts with ``name`` (``guarantee_ladder.py``: the copy on the
    child's path, else this checkout's)."""
    if importlib.util.find_spec("guarantee_ladder") is None:
        sys.path.insert(0, str(HERE.parent))
    from guarantee_ladder import RUNGS

    found = [pair for full, pair in RUNGS.items() if full.split()[0] == name]
    if not found:
        raise SystemExit(f"--rungs: no rung {name!r}; the rungs: {', '.join(r.split()[0] for r in RUNGS)}")
    return found[0]


def _count(paths: list[str], module: str, config: str, mode: str, backwards: int, total: int,
           backend: str | None) -> int:
    """The instructions callgrind counted for one child, ``paths`` put first on its ``PYTHONPATH``.

    Raises:
        RuntimeError: the child failed (its stderr's end in the message).
    """
    args = [sys.executable, str(HERE), "--child", module, config, mode, str(backwards), str(total), backend or "-"]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *args], capture_output=True, text=True,
        env=env,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or found is None:
        raise RuntimeError(f"callgrind run failed ({' '.join(args)}):\n{done.stderr[-3000:]}")
    return int(found.group(1))


def main(argv: list[str]) -> None:
    """Count and print (see the module docstring)."""
    if argv[:1] == ["--child"]:
        module, config, mode, backwards, total, backend = argv[1:7]
        _child(module, config, mode, int(backwards), int(total), None if backend == "-" else backend)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="4x16x4", help="LAYERSxDMODELxSEQ (default 4x16x4)")
    parser.add_argument("microbatches", nargs="?", type=int, default=20, help="counted microbatches (default 20)")
    parser.add_argument("--compile", metavar="BACKEND", help="every layer compiled with BACKEND (e.g. inductor)")
    parser.add_argument("--before", metavar="COMMIT", help="also count this commit's B+W")
    parser.add_argument("--rungs", metavar="NAMES", help="also count these ladder rungs' B+W (e.g. r2,r3p)")
    opts = parser.parse_args(argv)
    rungs = list(dict.fromkeys(opts.rungs.split(","))) if opts.rungs else []
    if rungs and opts.compile:
        raise SystemExit("--rungs: the eager rungs only (not with --compile)")
    for name in rungs:
        _rung(name)  # a bad name stops here, before any valgrind run
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is needed (Debian: apt-get install valgrind)")
    if opts.microbatches < 1:
        raise SystemExit("MICROBATCHES: at least 1")
    from ppbackward._tools.harness.models import parse_configs

    try:
        configs = parse_configs(opts.config)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if len(configs) != 1:
        raise SystemExit(f"CONFIG: one configuration, got {opts.config!r}")
    config, n = configs[0].name, opts.microbatches
    with tempfile.TemporaryDirectory() as tmp:
        now = pathlib.Path(tmp) / "now"
        shutil.copytree(HERE.parent.parent / "src" / "ppbackward", now / "ppbackward")
        shutil.copy(HERE.parent / "guarantee_ladder.py", now)  # the rungs, copied with src for the same reason
        # name -> (PYTHONPATH entries, the package whose B and W run, mode); the harness is the copy's in each
        runs = {"full backward": ([str(now)], "ppbackward", "full"), "B+W": ([str(now)], "ppbackward", "split")}
        if opts.before is not None:
            sys.path.insert(0, str(HERE.parent))
            from side_by_side import _export  # the one export of another commit (renamed ppbackward_before)

            _export(opts.before, pathlib.Path(tmp))
            runs[f"B+W at {opts.before}"] = ([tmp, str(now)], "ppbackward_before", "split")
        for name in rungs:
            runs[f"rung {name} B+W"] = ([str(now)], "ppbackward", f"rung:{name}")
        pool = concurrent.futures.ThreadPoolExecutor(2)  # two children at a time (two cores)
        try:
            futures = {
                (name, k): pool.submit(_count, paths, module, config, mode, k, n, opts.compile)
                for name, (paths, module, mode) in runs.items() for k in (n, 0)
            }
            per = {name: (futures[name, n].result() - futures[name, 0].result()) / n for name in runs}
        finally:
            pool.shutdown(cancel_futures=True)
    what = config + (f", every layer compiled ({opts.compile})" if opts.compile else "")
    print(f"{what}: instructions per microbatch (callgrind; {n} microbatches less as many forwards)")
    full = per["full backward"]
    for name, count in per.items():
        label = "torch.autograd.backward" if name == "full backward" else name
        print(f"  {label:<24} {count / 1e6:8.3f} M  {count / full:.3f}x the full backward")


if __name__ == "__main__":
    main(sys.argv[1:])
