#!/usr/bin/env bash
# Regenerate the benchmark figures of docs/performance.md ("Pictures") and the run they come from.
#
#   scripts/bench_figures.sh            # from the repository root, ppbackward and matplotlib installed
#
# Runs `ppbackward bench --split` on the configurations below (host-bound to compute-bound; about 4
# minutes on 2 idle cores) with --plot, and writes into docs/images/bench/: split-cost.png, one
# replayed-<config>.png per configuration, split.json (the whole report) and MADE.txt (the commit,
# date, torch and load average the figures were made with, quoted under them in performance.md).
# Run it on a quiet machine: the figures are timings.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/images/bench
CONFIGS="${PPB_FIGURE_CONFIGS:-4x16x4,4x128x16,16x64x16,4x256x16,4x512x64}"
mkdir -p "$OUT"
rm -f "$OUT"/*.png
python -m ppbackward bench --split --configs "$CONFIGS" --plot "$OUT" --json "$OUT/split.json" > "$OUT/split.txt"
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
meta = json.load(open(f"{out}/split.json"))["meta"]
line = (f"made {meta['date']} at commit {meta.get('ppbackward_commit')}, torch {meta['torch']}, "
        f"{meta['cpu_count']} CPU cores, 1-min load average {meta.get('loadavg_start')} to {meta.get('loadavg_end')}")
open(f"{out}/MADE.txt", "w").write(line + "\n")
print(line)
PY
