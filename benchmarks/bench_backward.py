#!/usr/bin/env python
"""Stage-backward benchmark (issue 6): plain autograd vs torch's and ppbackward's B+W, time and memory.

A thin script over ``ppbackward._tools.cli.bench.main`` (the same as ``ppbackward bench``); method and the
measured table are in ``docs/performance.md``. Examples::

    python benchmarks/bench_backward.py --quick
    python benchmarks/bench_backward.py --schedule --json bench.json
    python benchmarks/bench_backward.py --configs 16x64x16,16x256x16 --repeats 10
"""

import os
import sys

try:
    from ppbackward._tools.cli.bench import main
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src"))
    from ppbackward._tools.cli.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
