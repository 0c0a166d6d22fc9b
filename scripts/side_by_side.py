"""This checkout's B+W beside another commit's, in one process, interleaved (``bench --split``'s harness).

The other commit's ``src/ppbackward`` is exported (``git archive``) into a temporary folder as the package
``ppbackward_before`` (its imports renamed), so both run on the same stages in the same rounds, each round's
order rotated (Note [interleaved repeats]); figures: min-of-N ms and ratios to ppbackward's full backward.
Used for #36 (docs/performance.md, "Python frames per node").

    python scripts/side_by_side.py COMMIT [CONFIGS] [REPEATS]
    e.g. python scripts/side_by_side.py main 4x16x4,16x64x16,4x128x16,4x256x16,4x512x64 40
"""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys
import tempfile

import torch
from _usage import exit_if_help


def _export(commit: str, into: pathlib.Path) -> None:
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    archive = subprocess.run(
        ["git", "-C", root.stdout.strip(), "archive", commit, "src/ppbackward"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    src = into / "src" / "ppbackward"
    dst = into / "ppbackward_before"
    src.rename(dst)
    for path in dst.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\bppbackward(?=[.\s])", "ppbackward_before", text))


def main(argv: list[str]) -> None:
    from ppbackward._tools.bench import split
    from ppbackward._tools.bench.calls import count_calls
    from ppbackward._tools.harness.models import parse_configs

    commit = argv[0]
    configs = parse_configs(argv[1]) if len(argv) > 1 else list(split.CONFIGS)
    repeats = int(argv[2]) if len(argv) > 2 else 40
    with tempfile.TemporaryDirectory() as tmp:
        _export(commit, pathlib.Path(tmp))
        sys.path.insert(0, tmp)
        before = importlib.import_module("ppbackward_before.backward")
        pair = (before.stage_backward_input, before.stage_backward_weight)
        load = open("/proc/loadavg").read().split()[:3]
        print(f"torch {torch.__version__}; before = {commit}; load average at start {load}", flush=True)
        for cfg in configs:
            after_calls = count_calls(cfg)
            before_calls = count_calls(cfg, *pair)
            result = split.measure([cfg], repeats, None, extra={"before": pair})
            print(split.format_split(result).split("\nHost cost")[0].split("\n", 1)[1], flush=True)
            print(
                f"  Python calls B+W: before {before_calls.bw} ({before_calls.bw / before_calls.nodes:.2f}/node), "
                f"after {after_calls.bw} ({after_calls.bw / after_calls.nodes:.2f}/node)",
                flush=True,
            )
        print(f"load average at end {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    exit_if_help(__doc__)
    main(sys.argv[1:])
