"""Draw the pictures of docs/how-it-works.md "The leaks it avoids" with ppbackward's own leak checker.

Command (from the repository root, with ppbackward installed and graphviz's ``dot`` on PATH)::

    apt-get update && apt-get install -y graphviz     # once; any graphviz that provides `dot`
    python docs/make_figures.py                        # writes docs/images/*.dot and docs/images/*.png

``--out DIR`` writes somewhere else (the docs test uses a temporary folder).

What it does, per upstream leak kind, on the tests-only leaky variants of ``tests/leaks/leaky_variants.py``
(Linear 8->16, Tanh, Linear 16->8; batch 2; float32):

1. runs the leaky step once as warm-up, then once inside
   ``ppbackward.leaks.check_tensor_leaks(strict=False, output_dir=...)`` and keeps the checker's first
   back-reference chain: the ``.dot`` file objgraph wrote and the PNG the checker rendered with ``dot``;
2. runs the *same* step with ppbackward's functions (``stage_backward`` for the closure kind,
   ``stage_backward_input`` + ``stage_backward_weight`` for the param-group kind) inside the same checker
   and requires zero garbage objects of any type. The checker draws only what leaked, so this half
   produces no picture: its report line is printed instead.

Files written (the ``.dot`` files hold object addresses and tensor values, so they change on every run):

* ``leak-136507-closure.dot`` / ``.png`` -- pytorch/pytorch#136507's kind (``closure_leak_backward``);
* ``leak-136584-param-group.dot`` / ``.png`` -- pytorch/pytorch#136584's kind (``param_group_leak_backward``).

Exit code: 0 when both leaks were caught, both ppbackward steps left zero garbage and the PNGs were
rendered; 1 when graphviz's ``dot`` is missing (the ``.dot`` files are still written); 2 when a leak was
not caught or a ppbackward step left garbage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

import ppbackward
from ppbackward.leaks import LeakReport, check_tensor_leaks

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "leaks"))

import leaky_variants as lv  # noqa: E402  (tests-only module, found through the path above)


def ppbackward_full_step(stage: torch.nn.Module) -> None:
    """``closure_leak_backward``'s step (two outputs, two grads) through ``ppbackward.stage_backward``."""
    x = lv.make_input()
    outputs = (stage(x), stage(x) * 2)
    grads = (torch.ones_like(outputs[0]), torch.ones_like(outputs[1]))
    ppbackward.stage_backward(outputs, grads, [x])


def ppbackward_split_step(stage: torch.nn.Module) -> None:
    """``param_group_leak_backward``'s step (B, then W) through ppbackward's zero-bubble split."""
    x = lv.make_input()
    out = stage(x)
    _, param_groups = ppbackward.stage_backward_input((out,), (torch.ones_like(out),), [x], stage.parameters())
    ppbackward.stage_backward_weight(stage.parameters(), param_groups)


KINDS: list[tuple[str, str, Callable[[torch.nn.Module], None], Callable[[torch.nn.Module], None]]] = [
    ("leak-136507-closure", "pytorch/pytorch#136507", lv.closure_leak_backward, ppbackward_full_step),
    ("leak-136584-param-group", "pytorch/pytorch#136584", lv.param_group_leak_backward, ppbackward_split_step),
]


def _check(step: Callable[[torch.nn.Module], None], stage: torch.nn.Module, folder: str) -> LeakReport:
    with check_tensor_leaks(strict=False, warmup=lambda: step(stage), max_chains=1, output_dir=folder) as report:
        step(stage)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="folder for the .dot/.png files")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    have_dot = shutil.which("dot") is not None
    status = 0
    for name, issue, leaky, ours in KINDS:
        stage = lv.make_stage()
        with tempfile.TemporaryDirectory(prefix="ppbackward-figures-") as folder:
            report = _check(leaky, stage, os.path.join(folder, "leaky"))
            if report.ok or not report.dot_paths:
                print(f"{issue}: the leaky variant was NOT caught:\n{report.format()}", file=sys.stderr)
                return 2
            shutil.copyfile(report.dot_paths[0], args.out / f"{name}.dot")
            written = [f"{name}.dot"]
            if report.png_paths:
                shutil.copyfile(report.png_paths[0], args.out / f"{name}.png")
                written.append(f"{name}.png")
            clean = _check(ours, stage, os.path.join(folder, "ppbackward"))
        print(
            f"{issue} kind, leaky variant: {report.num_tensors} tensor(s) and {report.num_nodes} autograd node(s), "
            f"{report.tensor_bytes} bytes, in {report.num_garbage} garbage objects -> {', '.join(written)}"
        )
        print("  " + report.chains[0].replace("\n", "\n  "))
        print(f"{issue} kind, same step with ppbackward: {clean.format().removeprefix('ppbackward.leaks: ')}")
        if not clean.ok or clean.num_garbage:
            print(clean.format(), file=sys.stderr)
            status = 2
    if status == 0 and not have_dot:
        print("graphviz's `dot` was not found: only the .dot files were written "
              "(apt-get install -y graphviz, then rerun)", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
