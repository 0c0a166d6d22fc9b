#!/usr/bin/env bash
# Run ppbackward's test suites against several torch releases; one summary line per release.
#
#   scripts/compat.sh [--clean] [--quick] VERSION...      e.g.  scripts/compat.sh 2.5.1 2.13.0 2.14.1
#
# For each VERSION: reuse /opt/venvXYZ when it holds that torch (2.5.1 -> /opt/venv251, 2.13.0 ->
# /opt/venv2130 or /opt/venv213), otherwise build $PPB_COMPAT_HOME/venv-VERSION with
# `python3 -m venv` + `pip install torch==VERSION` and ppbackward's other dependencies. ppbackward
# itself runs from this checkout (PYTHONPATH=src, exported for every step and the torchrun workers),
# never installed: a venv can serve several checkouts (scripts/newest_venv.sh builds the newest
# release's, at the place this script looks for it). Then, from the repository root:
#   1. python -m pytest tests/core tests/compat    (tests that do not apply to that torch deselected,
#                                                   each named with its reason in the log)
#   2. python -m pytest tests/multiproc            (when the directory has tests)
#   3. python -m ppbackward check                  (when the command exists)
# Logs: $PPB_COMPAT_LOGS/torch-VERSION/{install,suite,multiproc,check}.log.
# --clean deletes the venvs this script built once their release has run (each is ~5 GB), except
# the newest release's, which scripts/newest_venv.sh builds and tests/newest and torchtitan share.
# --quick runs step 1 only.
# Not part of CI: the wheels are large. Exit code: 0 when every release passed every step it ran.
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${REPO}/src${PYTHONPATH:+:${PYTHONPATH}}"
HOME_DIR="${PPB_COMPAT_HOME:-${HOME}/.cache/ppbackward-compat}"
LOGS="${PPB_COMPAT_LOGS:-${HOME_DIR}/logs}"
SUITE_TIMEOUT="${PPB_COMPAT_SUITE_TIMEOUT:-1800}"
CHECK_TIMEOUT="${PPB_COMPAT_CHECK_TIMEOUT:-3600}"
PYTHON="${PPB_COMPAT_PYTHON:-python3}"
# The newest supported release: scripts/newest_venv.sh's default (PPB_NEWEST_TORCH overrides both).
NEWEST="${PPB_NEWEST_TORCH:-$(sed -nE 's/^NEWEST_TORCH="\$\{PPB_NEWEST_TORCH:-([^}]*)\}"$/\1/p' "$REPO/scripts/newest_venv.sh")}"

clean=0
quick=0
versions=()
for arg in "$@"; do
  case "$arg" in
    --clean) clean=1 ;;
    --quick) quick=1 ;;
    -h|--help) sed -n '2,/^# Not part of CI/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "compat.sh: unknown option $arg" >&2; exit 2 ;;
    *) versions+=("$arg") ;;
  esac
done
if [ "${#versions[@]}" -eq 0 ]; then
  echo "usage: scripts/compat.sh [--clean] [--quick] VERSION...   (e.g. 2.5.1 2.13.0 2.14.1)" >&2
  exit 2
fi

# The venv's torch release, without the local part (2.5.1+cu124 -> 2.5.1); empty if no torch.
torch_of() {
  "$1/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null
}

# Prints the venv to use for VERSION (reused or built), or nothing on failure.
venv_for() {
  local v="$1" log="$2" digits short candidate
  digits="$(echo "$v" | tr -d .)"
  short="$(echo "$v" | sed -E 's/^([0-9]+)\.([0-9]+)\.0$/\1\2/' | tr -d .)"
  for candidate in "/opt/venv${digits}" "/opt/venv${short}" "${HOME_DIR}/venv-${v}"; do
    if [ -x "${candidate}/bin/python" ] && [ "$(torch_of "$candidate")" = "$v" ]; then
      echo "$candidate"
      return 0
    fi
  done
  if [ "$v" = "$NEWEST" ]; then  # the shared venv of the newest release (with torchtitan)
    "$REPO/scripts/newest_venv.sh" 2>>"$log"
    return
  fi
  candidate="${HOME_DIR}/venv-${v}"
  mkdir -p "$HOME_DIR"
  {
    echo "building ${candidate} with torch==${v}"
    # An exact release asked for: the machine's torch cap (a constraints file in pip's global
    # configuration) is overridden for this command only, as scripts/newest_venv.sh does.
    rm -rf "$candidate" &&
      "$PYTHON" -m venv "$candidate" &&
      PIP_CONSTRAINT=/dev/null "$candidate/bin/pip" install "torch==${v}"
  } >>"$log" 2>&1 || return 1
  [ "$(torch_of "$candidate")" = "$v" ] || return 1
  echo "$candidate"
}

# ppbackward's own dependencies and test extra, torch excepted, read from pyproject.toml.
other_requirements() {
  "$1/bin/python" - "$REPO/pyproject.toml" <<'EOF'
import re, sys
try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project["dependencies"] + project.get("optional-dependencies", {}).get("test", [])
print("\n".join(r for r in reqs if not re.match(r"torch\b", r)))
EOF
}

# True when the venv has every named distribution (any version): then pip is not run on it.
has_requirements() {
  local venv="$1"
  shift
  "$venv/bin/python" - "$@" <<'EOF' 2>/dev/null
import re, sys
from importlib.metadata import version
for req in sys.argv[1:]:
    version(re.split(r"[<>=!~ \[;]", req)[0])
EOF
}

# Tests of tests/core that assert what does not hold on this torch, one "nodeid<TAB>reason" a line.
not_applicable() {
  local v="$1" adapter="$2"
  if [ "${adapter#native (}" = "$adapter" ]; then
    printf '%s\t%s\n' "tests/core/test_install.py::test_install_swaps_both_modules_and_uninstall_restores_exact_originals" \
      "asserts install() puts in ppbackward's own functions; on this torch it puts in the adapter '${adapter}' (tests/compat/test_compat_selection.py checks that instead)"
  fi
  case "$v" in
    2.5.*|2.6.*)
      for t in test_real_zero_bubble_schedule_calls_ppbackward_after_install \
               test_real_zero_bubble_schedule_calls_torch_after_uninstall \
               test_real_gpipe_schedule_full_backward; do
        printf '%s\t%s\n' "tests/core/test_install.py::$t" \
          "builds PipelineStage/schedules with the 2.7+ API (no input_args, scale_grads=False) and has stages of one rank talk through P2P, which gloo cannot do to itself before torch 2.12; tests/compat/test_compat_schedules.py runs these schedules here"
      done ;;
    2.7.*|2.8.*|2.9.*|2.10.*|2.11.*)
      for t in test_real_zero_bubble_schedule_calls_ppbackward_after_install \
               test_real_zero_bubble_schedule_calls_torch_after_uninstall; do
        printf '%s\t%s\n' "tests/core/test_install.py::$t" \
          "has two stages of one rank talk through P2P, which gloo cannot do to itself before torch 2.12 (same-rank hand-off); tests/compat/test_compat_schedules.py runs these schedules here"
      done ;;
  esac
}

# "N passed, M failed ..." from a pytest log, or the last line when there is none.
pytest_counts() {
  local line
  line="$(grep -E '^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s' "$1" | tail -1 | sed -E 's/^=+ //; s/ =+$//')"
  [ -n "$line" ] || line="$(tail -1 "$1")"
  echo "$line"
}

status_all=0
summaries=()
cd "$REPO" || exit 2
for v in "${versions[@]}"; do
  dir="${LOGS}/torch-${v}"
  mkdir -p "$dir"
  : >"$dir/install.log"
  built=0
  venv="$(venv_for "$v" "$dir/install.log")"
  if [ -z "$venv" ]; then
    summaries+=("torch ${v}: FAIL  could not build a venv with torch==${v} (see ${dir}/install.log)")
    status_all=1
    continue
  fi
  case "$venv" in "${HOME_DIR}/venv-${NEWEST}") ;; "${HOME_DIR}"/*) built=1 ;; esac
  py="$venv/bin/python"
  {
    mapfile -t reqs < <(other_requirements "$venv")
    if has_requirements "$venv" "${reqs[@]}"; then
      echo "requirements already present: ${reqs[*]}"
    else
      echo "\$ pip install ${reqs[*]}"
      "$venv/bin/pip" install "${reqs[@]}" || echo "compat.sh: could not install ${reqs[*]}; going on"
    fi
  } >>"$dir/install.log" 2>&1
  torch_full="$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  adapter="$("$py" -c 'from ppbackward import _compat; print(_compat.select_adapter().name)' 2>>"$dir/install.log")"
  if [ -z "$adapter" ]; then
    adapter="refused"
  fi
  verdict="PASS"

  # 1. tests/core + tests/compat
  deselect=()
  : >"$dir/not-applicable.txt"
  while IFS=$'\t' read -r nodeid reason; do
    [ -n "$nodeid" ] || continue
    deselect+=(--deselect "$nodeid")
    printf 'not applicable on torch %s: %s\n  %s\n' "$v" "$nodeid" "$reason" >>"$dir/not-applicable.txt"
  done < <(not_applicable "$v" "$adapter")
  {
    echo "\$ $py -m pytest tests/core tests/compat -q -p no:ppbackward ${deselect[*]}"
    cat "$dir/not-applicable.txt"
    timeout -k 30 "$SUITE_TIMEOUT" "$py" -m pytest tests/core tests/compat -q -p no:ppbackward "${deselect[@]}"
  } >"$dir/suite.log" 2>&1
  rc=$?
  suite="$(pytest_counts "$dir/suite.log")"
  [ "$rc" -eq 0 ] || verdict="FAIL"
  [ "$rc" -eq 124 ] && suite="timed out after ${SUITE_TIMEOUT}s"

  # 2. tests/multiproc
  if [ "$quick" -eq 1 ]; then
    multiproc="skipped (--quick)"
  elif compgen -G "tests/multiproc/test_*.py" >/dev/null; then
    timeout -k 30 "$SUITE_TIMEOUT" "$py" -m pytest tests/multiproc -q -p no:ppbackward >"$dir/multiproc.log" 2>&1
    rc=$?
    multiproc="$(pytest_counts "$dir/multiproc.log")"
    [ "$rc" -eq 124 ] && multiproc="timed out after ${SUITE_TIMEOUT}s"
    [ "$rc" -eq 0 ] || verdict="FAIL"
  else
    multiproc="skipped (no tests/multiproc/test_*.py yet)"
  fi

  # 3. ppbackward check
  if [ "$quick" -eq 1 ]; then
    check="skipped (--quick)"
  elif "$py" -c 'import ppbackward.__main__, importlib.util as u, sys; sys.exit(not (u.find_spec("ppbackward._tools.cli") or u.find_spec("ppbackward._check")))' >/dev/null 2>&1; then
    timeout -k 30 "$CHECK_TIMEOUT" "$py" -m ppbackward check >"$dir/check.log" 2>&1
    rc=$?
    check="exit ${rc}"
    [ "$rc" -eq 124 ] && check="timed out after ${CHECK_TIMEOUT}s"
    [ "$rc" -eq 0 ] || verdict="FAIL"
  else
    check="skipped (no 'ppbackward check' command yet)"
  fi

  n_na="$(grep -c '^not applicable' "$dir/not-applicable.txt")"
  summaries+=("torch ${torch_full:-$v}: ${verdict}  adapter=${adapter}  core+compat: ${suite} (${n_na} not applicable)  multiproc: ${multiproc}  check: ${check}  logs: ${dir}")
  [ "$verdict" = "PASS" ] || status_all=1
  if [ "$clean" -eq 1 ] && [ "$built" -eq 1 ]; then
    rm -rf "$venv"
  fi
done

printf '%s\n' "${summaries[@]}"
exit "$status_all"
