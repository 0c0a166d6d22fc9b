"""Write ``report.json``, the input of ``tests/bench/test_report_golden.py``.

Run from the repository root: ``PYTHONPATH=src python tests/bench/golden/make_fixture.py`` (about a
minute on 2 cores). The configurations, the allocator counts, the device work, the memory figures, the
scaling sweep and the profile are measured (``ppbackward bench``, one or two repeats; timings are
noise, which does not matter here: the test checks the text made from fixed numbers, not the numbers);
the schedule step is made up, in the worker's format (``ppbackward._tools.harness.schedule_bench``), as
a torchrun launch would cost minutes. No targets: the test evaluates them (its expected records are
in ``targets.json``).

Rerun only to change the fixture; then rerun the test module as a script to rewrite the expected
text (``python tests/bench/test_report_golden.py --write``) with the code whose output is the
reference, and review the diff.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _bench(args: list[str]) -> dict[str, Any]:
    from ppbackward._tools.cli.bench import main

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.json"
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main([*args, "--json", str(path)])
        if rc != 0:
            raise SystemExit(f"ppbackward bench {' '.join(args)}: exit code {rc}")
        report: dict[str, Any] = json.loads(path.read_text())
    report["meta"]["argv"] = args  # without the temporary --json path
    return report


def _schedule() -> dict[str, Any]:
    """A schedule step result in the worker's format, numbers made up (two ranks, every variant)."""
    variants = [
        "Interleaved1F1B/upstream", "Interleaved1F1B/ppbackward",
        "InterleavedZeroBubble/upstream", "InterleavedZeroBubble/ppbackward", "InterleavedZeroBubble/merged",
        "ZBVZeroBubble/upstream", "ZBVZeroBubble/ppbackward", "ZBVZeroBubble/merged",
    ]
    step = dict(zip(variants, (40.125, 39.5, 36.25, 33.0, 34.75, 35.5, 31.875, 37.0)))
    memory = {}
    parts = {}
    for i, name in enumerate(variants):
        memory[name] = {
            "rss_peak_bytes": None if name.endswith("merged") else (300 + 7 * i) * 2**20 + 12345,
            "rss_growth_bytes": None if name.endswith("merged") else (i % 3) * 2**20 + 4321,
            "saved_peak_bytes": (8 + i) * 2**19 + 999,
        }
        split = not name.startswith("Interleaved1F1B")
        parts[name] = [
            {"F": 10.0 + r + i / 8, "full": 0.0 if split else 12.0 + r, "B": 6.5 + r if split else 0.0,
             "W": 5.25 + r / 2 if split else 0.0, "wait": 3.0 + 2 * r, "other": 1.125,
             "step": step[name] - (0.0 if r == 0 else 0.5)}
            for r in range(2)
        ]
    return {
        "ranks": 2, "stages": 4, "layers_per_stage": 4, "d_model": 128, "seq": 16, "microbatches": 8,
        "microbatch_size": 2, "repeats": 8, "variants": variants, "step_ms": step,
        "ratio_to_1f1b": {k: t / step["Interleaved1F1B/upstream"] for k, t in step.items()},
        "memory": memory, "parts_ms": parts, "grads_match": True, "compile": "", "regions": {},
    }


def main() -> int:
    quick = _bench(["--quick", "--repeats", "2"])
    big = _bench(["--configs", "16x64x16,16x256x16", "--repeats", "1", "--budget", "1", "--no-scaling",
                  "--profile-config", "1x64x16"])
    report = {
        "meta": quick["meta"],
        "configs": quick["configs"] + big["configs"],
        "analysis_scaling": quick["analysis_scaling"],
        "profile": big["profile"],
        "schedule": _schedule(),
    }
    (HERE / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {HERE / 'report.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
