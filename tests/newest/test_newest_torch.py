"""The suite on the newest torch ppbackward supports, from a run on any other torch (CI's pinned 2.13).

``scripts/newest_venv.sh`` builds (once) and prints a venv holding that torch (2.15.0: a CUDA build
from the package registry), torchtitan and ppbackward's test dependencies, at
``~/.cache/ppbackward-compat/venv-<version>``; this checkout's ``src`` is put on its ``PYTHONPATH``
(ppbackward is not installed there, so one venv serves every clone). Two inner runs of pytest in
that venv, each asserted to pass, with the tail of its output on failure:

* ``tests/core tests/compat``;
* the torchrun matrix, ``tests/multiproc -m "not slow"``: one launch of each kind (the world-size-2
  matrix of every schedule x model, the training models, the garbage negative control) and the
  harness units; the slow launches (world size 4, static metadata, DDP/FSDP2, torch's own backward,
  hang, gloo P2P) are left to ``scripts/compat.sh 2.15.0``, to keep CI's added time near 4 minutes.

What it costs (2 CPU cores, idle; docs/compatibility.md, "The newest torch in CI"): the first run
builds the venv, about 5.5 GB on disk and a few minutes of download and install; with the venv
present, the two inner runs take about 1.5 and 2.5 minutes. Marked ``slow`` (left out by
``-m "not slow"``) and ``newest`` (``-m "not newest"`` leaves out only these).

Skipped inside the inner runs (no recursion: they do not collect tests/newest, and the variable
below says so besides) and when the running torch already is the newest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppbackward import _compat

ROOT = Path(__file__).resolve().parents[2]
INNER = "PPB_NEWEST_TORCH_INNER"  # set for the inner runs
NEWEST = _compat._CONTRACTS[-1].last  # (major, minor) of the newest supported torch
BUILD_TIMEOUT_S = 1800  # a first build downloads ~3 GB of wheels
SUITE_TIMEOUT_S = 900  # each inner run; its tests have pytest-timeout's own limit besides
TAIL_LINES = 60
SUMMARY = re.compile(r"\d+ (passed|failed|errors?|skipped|deselected)\b.* in \d")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.newest,
    pytest.mark.skipif(os.environ.get(INNER) == "1", reason="inside an inner newest-torch run"),
    pytest.mark.skipif(
        _compat.torch_release()[:2] == NEWEST,
        reason=f"torch {torch.__version__} is the newest supported release already",
    ),
]


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-TAIL_LINES:])


@pytest.fixture(scope="module")
def newest_python() -> str:
    """The newest venv's interpreter (built on first use by scripts/newest_venv.sh)."""
    try:
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "newest_venv.sh")],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"scripts/newest_venv.sh ran past {BUILD_TIMEOUT_S} s:\n{_tail(str(e.stderr or ''))}")
    if done.returncode != 0 or not done.stdout.strip():
        pytest.fail(f"scripts/newest_venv.sh failed (exit {done.returncode}):\n{_tail(done.stderr)}")
    python = Path(done.stdout.strip().splitlines()[-1]) / "bin" / "python"
    assert python.is_file(), f"scripts/newest_venv.sh printed {done.stdout!r}: no {python}"
    version = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout.strip()
    assert _compat.torch_release(version)[:2] == NEWEST, (
        f"scripts/newest_venv.sh gives torch {version}, but the newest supported torch is "
        f"{'.'.join(map(str, NEWEST))} (ppbackward._compat): keep its NEWEST_TORCH in step"
    )
    return str(python)


def _run_inner(python: str, *args: str) -> None:
    """``python -m pytest ARGS`` in the newest venv with this checkout's src; assert it passed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **{INNER: "1"})
    env.pop("PYTEST_ADDOPTS", None)
    command = [python, "-m", "pytest", *args, "-q", "-p", "no:ppbackward", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S, cwd=ROOT, env=env
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{' '.join(args)} on the newest torch ran past {SUITE_TIMEOUT_S} s:\n{_tail(out)}")
    summary = next(
        (line.strip("= ") for line in reversed(done.stdout.splitlines()) if SUMMARY.search(line)),
        "no pytest summary line",
    )
    sys.stdout.write(f"newest torch: {' '.join(args)}: {summary}\n")
    assert done.returncode == 0, (
        f"{' '.join(args)} failed on the newest torch (exit {done.returncode}): {summary}\n"
        f"{_tail(done.stdout + done.stderr)}"
    )


@pytest.mark.timeout(BUILD_TIMEOUT_S + SUITE_TIMEOUT_S + 60)
def test_core_and_compat_pass_on_the_newest_torch(newest_python):
    _run_inner(newest_python, "tests/core", "tests/compat")


@pytest.mark.timeout(BUILD_TIMEOUT_S + SUITE_TIMEOUT_S + 60)
def test_torchrun_matrix_passes_on_the_newest_torch(newest_python):
    _run_inner(newest_python, "tests/multiproc", "-m", "not slow")
