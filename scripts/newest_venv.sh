#!/usr/bin/env bash
# Build (once) and print the path of the venv that serves the newest-torch and torchtitan tests.
#
#   scripts/newest_venv.sh            prints the venv's path on stdout (progress on stderr)
#
# The venv holds the newest torch release ppbackward supports (NEWEST_TORCH below), torchtitan
# (TORCHTITAN below, which needs torch >= 2.14) and ppbackward's own dependencies and test extra.
# ppbackward itself is not installed there: callers run it from their checkout (`pip install
# --no-deps -e .` or PYTHONPATH=src), so one venv serves every clone of the repository.
# It lives at $PPB_COMPAT_HOME/venv-$NEWEST_TORCH (default ~/.cache/ppbackward-compat), the place
# scripts/compat.sh looks for that release, and is reused while it holds the right versions.
# torch 2.15 is a CUDA build from the package registry: about 5.4 GB in the venv, a few minutes to
# install. pip on these machines is capped at torch 2.14.1 by a constraints file named in pip's
# global configuration; the install here overrides that file for its own commands only
# (PIP_CONSTRAINT=/dev/null), never touching the machine's configuration.
# Exit code: 0 with the path printed; non-zero (and nothing on stdout) when the build failed.
set -uo pipefail

NEWEST_TORCH="${PPB_NEWEST_TORCH:-2.15.0}"
TORCHTITAN="${PPB_TORCHTITAN:-0.3.0}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
HOME_DIR="${PPB_COMPAT_HOME:-${HOME}/.cache/ppbackward-compat}"
VENV="${HOME_DIR}/venv-${NEWEST_TORCH}"
PYTHON="${PPB_COMPAT_PYTHON:-python3}"

# True when the venv holds exactly the wanted torch and torchtitan.
ready() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - "$NEWEST_TORCH" "$TORCHTITAN" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
import torch
ok = torch.__version__.split("+")[0] == sys.argv[1] and version("torchtitan") == sys.argv[2]
for name in ("pytest", "objgraph", "hypothesis"):
    version(name)
sys.exit(0 if ok else 1)
PY
}

# ppbackward's dependencies and test extra, torch excepted, read from pyproject.toml.
requirements() {
  "$VENV/bin/python" - "$REPO/pyproject.toml" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project["dependencies"] + project.get("optional-dependencies", {}).get("test", [])
print("\n".join(r for r in reqs if not re.match(r"torch\b", r)))
PY
}

if ! ready; then
  echo "newest_venv: building ${VENV} (torch ${NEWEST_TORCH}, torchtitan ${TORCHTITAN}; ~5.5 GB, a few minutes)" >&2
  mkdir -p "$HOME_DIR"
  rm -rf "$VENV"
  {
    "$PYTHON" -m venv "$VENV" &&
      PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q "torch==${NEWEST_TORCH}" "torchtitan==${TORCHTITAN}" &&
      PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q $(requirements) "torch==${NEWEST_TORCH}"
  } >&2 || { echo "newest_venv: building ${VENV} failed" >&2; exit 1; }
  ready || { echo "newest_venv: ${VENV} does not hold torch ${NEWEST_TORCH} and torchtitan ${TORCHTITAN}" >&2; exit 1; }
fi
echo "$VENV"
