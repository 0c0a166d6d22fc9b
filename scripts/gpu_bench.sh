#!/usr/bin/env bash
# The split's cost on a GPU (issue 22): one process runs `ppbackward bench --split` on CUDA:
# B, W and B+W against one full backward per microbatch-stage (both regimes, interleaved), torch's
# split beside ppbackward's, the bytes the CUDA allocator holds between B and W (freed by W), and the
# zero-bubble steps replayed from those costs, then the one-rank step (--one-rank-step: every stage of
# Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble on one rank in this process, torch's backward,
# ppbackward's and merged). Under 8 minutes on one GPU (estimate: at most about 90 s of timed repeats
# and warm-up per configuration, four configurations, 6 min; the one-rank step 8 variants x 9 steps of
# 2 stages x 4 layers d 128, 8 microbatches, under 30 s with process-group and CUDA start; the timeout
# below stops it at 470 s). On a machine without one: --device cpu (the test in tests/bench runs it
# so, with --quick).
#
# Usage: scripts/gpu_bench.sh [--device cuda|cpu] [--quick] [--json PATH]
set -euo pipefail
device=cuda
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --quick) extra+=(--quick); shift ;;
    --json) extra+=(--json "$2"); shift 2 ;;
    *) echo "gpu_bench.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
# $PYTHON, else the `python` on PATH when it has ppbackward (a nox session's), else the checkout's .venv
py="${PYTHON:-python}"
if ! "$py" -c 'import ppbackward' 2>/dev/null && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
if [ "$device" = cuda ]; then
  "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' \
    || { echo "gpu_bench.sh: no CUDA device (use --device cpu)" >&2; exit 3; }
  "$py" -c 'import torch; print("device:", torch.cuda.get_device_name(0))'
fi
exec timeout 470 "$py" -m ppbackward bench --split --one-rank-step --device "$device" --budget 20 "${extra[@]}"
