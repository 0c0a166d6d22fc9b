#!/usr/bin/env bash
# Run a command on a busy machine: the conditions the test suite must pass under.
#
#   scripts/load.sh [--spinners N] [--importers N] COMMAND...
#   e.g.  scripts/load.sh python -m pytest
#         scripts/load.sh bash -c '. .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && python -m pytest'
#
# While COMMAND runs, this keeps N CPU spinners (default 2: busy Python loops) and N importer loops
# (default 2: each starts a fresh interpreter that imports torch, over and over, so that process start-up
# is slow too) running in the background, with $LOAD_PYTHON, else the repository's .venv/bin/python, else
# python3 (refused when it cannot import torch). On 2 cores that keeps the load average between about 4
# and 11. The load stops when COMMAND ends, or on Ctrl-C. Prints the load average before and after, and COMMAND's wall time; exits with
# COMMAND's exit code.
set -uo pipefail

spinners=2
importers=2
while [ $# -gt 0 ]; do
  case "$1" in
    --spinners) spinners="$2"; shift 2 ;;
    --importers) importers="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "usage: scripts/load.sh [--spinners N] [--importers N] COMMAND..." >&2
  exit 2
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="${LOAD_PYTHON:-}"
[ -n "$py" ] || { [ -x "$repo/.venv/bin/python" ] && py="$repo/.venv/bin/python"; }
[ -n "$py" ] || py="$(command -v python3)"
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "load.sh: $py cannot import torch; set LOAD_PYTHON to an interpreter that can" >&2
  exit 2
fi
pids=()
stop_load() {
  for pid in "${pids[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
  done
  wait "${pids[@]}" 2>/dev/null
}
trap stop_load EXIT
trap 'exit 130' INT TERM

for _ in $(seq 1 "$spinners"); do
  setsid "$py" -c 'while True: pass' &
  pids+=("$!")
done
for _ in $(seq 1 "$importers"); do
  setsid bash -c "while true; do '$py' -c 'import torch' >/dev/null 2>&1; done" &
  pids+=("$!")
done
echo "load.sh: $spinners spinner(s), $importers torch-importing loop(s) started; $(cut -d' ' -f1-3 /proc/loadavg | sed 's/^/load average /')" >&2
start=$(date +%s)
"$@"
rc=$?
echo "load.sh: command exited $rc after $(( $(date +%s) - start )) s; $(cut -d' ' -f1-3 /proc/loadavg | sed 's/^/load average /')" >&2
exit "$rc"
