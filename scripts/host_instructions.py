"""Instructions per microbatch of the full backward and of B+W, counted by valgrind's callgrind: a host cost that
does not move with the machine's load (issue 36; Note [counted host cost] counts Python calls, this counts
everything the CPU executes for them, the engine's C++ and the interpreter's C included).

    python scripts/host_instructions.py [--compile BACKEND] [--before COMMIT] [CONFIG] [MICROBATCHES]
    e.g. python scripts/host_instructions.py --before HEAD 4x16x4 20

Each figure is the difference of two runs of this script's child under ``valgrind --tool=callgrind`` on the
bench stage (``bench --split``'s, ``CONFIG`` default 4x16x4), both after the same five warm-up microbatches
(the full backward, or B then W): ``MICROBATCHES`` forwards each followed by that backward (grads accumulating)
against as many forwards alone, so that importing torch, building the stage, B's first plans and (with
``--compile``: every layer compiled, ppbackward installed) compiling the regions and their halves cancel
out. The checkout's ``src/ppbackward`` is copied first (the children import it minutes later); ``--before
COMMIT`` counts that commit's B+W too, exported the way ``scripts/side_by_side.py`` does. Each child takes a
few minutes under valgrind (the interpreter's start and torch's import run about 50 times slower); two run at
a time. The heap after the warm-up is frozen (``gc.freeze()``: the young collections still run, over what the
microbatches make). Eager counts are repeatable to about 0.5 % (hash randomization, addresses); instructions
are not time (a cache miss costs more than an add), but a change that leaves them unchanged did not make the
host cost smaller. With ``--compile`` they are not repeatable to that (the compiled full backward counted
4.24 M and 4.59 M in two runs of the same code; benchmarks/RESULTS.md, "Instructions, not seconds"): time the
compiled stage instead.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve()


def _child(module: str, config: str, mode: str, n: int, backend: str | None) -> None:
    """Under valgrind: five warm-up microbatches, then ``n`` with backward ``mode`` and ``20 - n`` forwards alone."""
    import gc
    import importlib

    import torch

    from ppbackward._tools.harness.models import Config
    from ppbackward._tools.harness.models import build as build_stage

    torch.set_num_threads(1)
    backward = importlib.import_module(f"{module}.backward")
    if backend is not None:
        from ppbackward._tools.harness.schedule_bench import compile_layers

        importlib.import_module(module).install()
        stage = build_stage(Config(*map(int, config.split("x"))))
        compile_layers(stage.model, backend)
    else:
        stage = build_stage(Config(*map(int, config.split("x"))))
    params, x, grad = stage.params, stage.x, stage.grad

    def one(with_backward: bool) -> None:
        out = stage.model(x)
        if not with_backward:
            return
        if mode == "full":
            torch.autograd.backward((out,), (grad,))
        else:
            _, groups = backward.stage_backward_input([out], [grad], [x], iter(params))
            backward.stage_backward_weight(iter(params), groups)

    for _ in range(5):
        one(True)
    # the heap so far (torch, the stage, the compiled code) out of the collector's sight: a full collection
    # over it, which the counted microbatches might start or not, would swamp the difference
    gc.collect()
    gc.freeze()
    for i in range(20):
        one(i < n)


def _count(path: str, module: str, config: str, mode: str, n: int, backend: str | None) -> int:
    """Instructions callgrind counted for one child (``path``: prepended to ``PYTHONPATH``, for ``module``)."""
    args = [sys.executable, str(HERE), "--child", module, config, mode, str(n), backend or "-"]
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *args],
        capture_output=True, text=True, env=env,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or found is None:
        raise RuntimeError(f"callgrind run failed ({' '.join(args)}):\n{done.stderr[-3000:]}")
    return int(found.group(1))


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        module, config, mode, n, backend = argv[1:6]
        _child(module, config, mode, int(n), None if backend == "-" else backend)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is needed (Debian: apt-get install valgrind)")
    backend = before = None
    while argv[:1] and argv[0].startswith("--"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--compile":
            backend = value
        elif flag == "--before":
            before = value
        else:
            raise SystemExit(f"unknown option {flag}")
    config = argv[0] if argv else "4x16x4"
    n = int(argv[1]) if len(argv) > 1 else 20
    with tempfile.TemporaryDirectory() as tmp:
        # each counted beside its own baseline: the same warm-up (B's first microbatches plan, and compile the
        # compiled regions' halves) and as many forwards alone
        now = pathlib.Path(tmp) / "now"
        shutil.copytree(HERE.parent.parent / "src" / "ppbackward", now / "ppbackward")
        runs = {"full backward": (str(now), "ppbackward", "full"), "B+W": (str(now), "ppbackward", "split")}
        if before is not None:
            sys.path.insert(0, str(HERE.parent))
            from side_by_side import _export  # the one export of another commit (renamed ppbackward_before)

            _export(before, pathlib.Path(tmp))
            runs[f"B+W at {before}"] = (tmp, "ppbackward_before", "split")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two children at a time (two cores)
            futures = {(name, k): pool.submit(_count, path, module, config, mode, k, backend)
                       for name, (path, module, mode) in runs.items() for k in (n, 0)}
            per = {name: (futures[name, n].result() - futures[name, 0].result()) / n for name in runs}
    what = f"{config}" + (f", every layer compiled ({backend})" if backend else "")
    print(f"{what}: instructions per microbatch (callgrind; {n} microbatches less as many forwards)")
    full = per["full backward"]
    for name, count in per.items():
        print(f"  {name:<20} {count / 1e6:8.3f} M  {count / full:.3f}x the full backward")


if __name__ == "__main__":
    main(sys.argv[1:])
