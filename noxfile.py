"""ppbackward's test sessions: ``nox --list`` names them, ``nox --parallel 2 --allow-parallel`` runs every default
one two at a time (what ``.ci/run`` runs; plain ``nox`` runs them one after another).

Arguments after ``--`` go to pytest (``nox -s tests -- -m "not slow"``, ``nox -s torch-2.15 -- tests/core -x``).

* ``lint``, ``tests``, ``release`` (and ``docs``): a fresh venv of their own under ``.nox/`` with the pinned torch
  (2.13.0; a CPU wheel where the index has one: this project's machines take it from local disk), nothing else from
  the network than the install; ``release`` puts torch in the venv it installs the built wheel into, and runs
  tests/docs there.
* ``torch-2.15``, ``torchtitan``, ``torch-2.5.1`` (and ``compat``): torch from the package registry, CUDA builds of
  several GB. Their packages live in a venv shared by every clone, ``~/.cache/ppbackward-nox/torch-VERSION``
  (``PPB_NOX_CACHE`` moves it), built on first use (a few minutes), then reused: each run only checks it with
  ``pip install`` (seconds when nothing is missing). ``torch-2.15`` and ``torchtitan`` share one (torch 2.15.0 and
  torchtitan 0.3.0). The session's own venv, under ``.nox/``, sees those packages through a ``.pth`` file and
  holds this checkout, installed editable without dependencies: the checkout under test is what runs, and two
  clones never install into the shared venv at once (a lock file guards its build).

Where pip's global configuration pins torch with a constraints file (this project's machines cap it at 2.14.1), the
shared venvs ask for an exact release and lift that pin for their own pip commands only (``PIP_CONSTRAINT=/dev/null``);
elsewhere that changes nothing.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox itself depends on tomli there
    import tomli as tomllib

nox.needs_version = ">=2026.10.20"  # session(default=...); --parallel and --allow-parallel (.ci/run)
nox.options.error_on_external_run = True

ROOT = Path(__file__).resolve().parent
PINNED_TORCH = "2.13.0"  # CI's torch (a CPU wheel on this project's machines)
NEWEST_TORCH = "2.15.0"
OLDEST_TORCH = "2.5.1"
TORCHTITAN = "0.3.0"  # needs torch >= 2.14
# `PPB_TORCHTITAN_TORCH=2.14.1 nox -s torchtitan` trains torchtitan on another torch (docs/torchtitan.md)
TITAN_TORCH = os.environ.get("PPB_TORCHTITAN_TORCH", NEWEST_TORCH)
CACHE = Path(os.environ.get("PPB_NOX_CACHE", Path.home() / ".cache" / "ppbackward-nox"))
# what the tests session leaves to others: tests/docs runs in release (on the wheel), tests/torchtitan in torchtitan
OTHER_SESSIONS = ("--ignore=tests/docs", "--ignore=tests/torchtitan")
PURELIB = "import sysconfig; print(sysconfig.get_path('purelib'))"
# run in a venv with the torch release and the folder ppbackward must come from (a checkout's src/, the wheel's
# venv): says what runs, asserts it
WHICH = """
import sys, torch, ppbackward
from pathlib import Path
where = Path(ppbackward.__file__).resolve().parent
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, ppbackward from {where}")
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert where.is_relative_to(sys.argv[2]), where
"""


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project: dict = tomllib.load(f)["project"]
    return project


def _pytest(session: nox.Session, *args: str) -> None:
    """``python -m pytest ARGS``; any exit code but 0 fails the session, 5 (no test collected) included."""
    session.run("python", "-m", "pytest", *args)


def _install_pinned(session: nox.Session, extras: str) -> None:
    session.install(f"torch=={PINNED_TORCH}", "-e", f".[{extras}]")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _python_of(venv: Path) -> str | None:
    """``major.minor`` of the venv's interpreter, or None when it has none that runs."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    try:
        done = subprocess.run([str(python), "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _shared_venv(session: nox.Session, torch_version: str, *extra: str) -> None:
    """Put torch ``torch_version``, ppbackward's dependencies and test extra, and ``extra`` in the shared venv
    ``CACHE/torch-VERSION`` (built once, reused after), make them visible to the session's venv, and install
    this checkout there, editable. The building commands are ``session.run_install``'s, as ``session.install``
    is: ``nox -s SESSION --install-only`` builds the shared venv ahead of a run (``session.run`` is skipped
    there), and ``-R`` (``--no-install`` on a reused session venv) installs nothing."""
    torch_req = f"torch=={torch_version}"
    project = _project()
    others = [r for r in project["dependencies"] + project["optional-dependencies"]["test"]
              if not re.match(r"torch\b", r)]
    requirements = [torch_req, *extra, *others]
    venv = CACHE / f"torch-{torch_version}"
    wanted_python = "{}.{}".format(*sys.version_info[:2])
    pip_env = {"PIP_CONSTRAINT": "/dev/null", "PIP_NO_CACHE_DIR": "1"}  # an exact release; no 5 GB pip cache
    with _locked(CACHE / f"torch-{torch_version}.lock"):
        if _python_of(venv) != wanted_python:
            session.log(f"building {venv} (python {wanted_python}, {torch_req}; several GB, a few minutes)")
            session.run_install(sys.executable, "-m", "venv", "--clear", str(venv), external=True)
        else:
            session.log(f"reusing {venv}")
        # pip leaves what is already there alone: seconds when the venv holds everything
        session.run_install(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *requirements,
                            env=pip_env, external=True)
    if _python_of(venv) != wanted_python:  # -R skipped the build
        session.error(f"{venv} has no python {wanted_python}: run the session without -R/--no-install to build it")
    own = session.run_install("python", "-c", PURELIB, silent=True, log=False)
    if isinstance(own, str):  # else -R: the session venv is reused as it is, its .pth file in place
        shared = subprocess.run([str(venv / "bin" / "python"), "-c", PURELIB], capture_output=True, text=True,
                                check=True).stdout.strip()
        # site.addsitedir also runs the shared venv's own .pth files; the session's packages come first on sys.path
        (Path(own.strip()) / "ppbackward-shared-venv.pth").write_text(f"import site; site.addsitedir({shared!r})\n")
    session.install("--no-deps", "-e", ".")
    session.run("python", "-c", WHICH, torch_version, str(ROOT / "src"))


@nox.session
def lint(session: nox.Session) -> None:
    """The gate: ruff check src tests noxfile.py; mypy (src, tests, noxfile.py), on the pinned torch."""
    _install_pinned(session, "test,dev")
    session.run("ruff", "check", "src", "tests", "noxfile.py")
    session.run("mypy")


def _suite(session: nox.Session) -> None:
    _install_pinned(session, "test")
    _pytest(session, *OTHER_SESSIONS, *session.posargs)


@nox.session(tags=["torch"])
def tests(session: nox.Session) -> None:
    """The suite on the pinned torch 2.13.0 (CPU), but tests/docs (in release) and tests/torchtitan (its own)."""
    _suite(session)


@nox.session(name="torch-2.13", default=False)
def torch_2_13(session: nox.Session) -> None:
    """The same as tests (torch 2.13.0 is the pinned release), under the name of its torch."""
    _suite(session)


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """tests/docs on the checkout, editable (the quick loop; CI runs them in release, on the built wheel).

    README.md and docs/*.md links, every python block run, the figures, on the pinned torch."""
    _install_pinned(session, "test")
    _pytest(session, "tests/docs", *session.posargs)


@nox.session
def release(session: nox.Session) -> None:
    """Build and twine-check the wheel and sdist, install the wheel in a fresh venv, run tests/docs there.

    The wheel goes into a venv of its own with torch and its test extra; ``ppbackward --version`` there must
    name pyproject.toml's version; tests/docs then runs with that venv: the README's and docs' code against
    what a user installs from the wheel (one venv with torch instead of two: CI's time is its CPU work)."""
    version = _project()["version"]
    dist = ROOT / "dist"
    for old in dist.glob("ppbackward-*"):
        old.unlink()
    session.install("build", "twine")
    session.run("python", "-m", "build", "--outdir", str(dist), str(ROOT))
    wheel, sdist = dist / f"ppbackward-{version}-py3-none-any.whl", dist / f"ppbackward-{version}.tar.gz"
    built = sorted(p.name for p in dist.glob("ppbackward-*"))
    if built != sorted([wheel.name, sdist.name]):
        session.error(f"python -m build made {built}, not {wheel.name} and {sdist.name}")
    session.run("twine", "check", "--strict", str(wheel), str(sdist))
    # a venv of its own, away from the checkout: what a user gets from the file
    where = Path(session.create_tmp()).resolve()
    venv = where / "wheel-venv"
    shutil.rmtree(venv, ignore_errors=True)
    session.run(sys.executable, "-m", "venv", str(venv), external=True)
    session.run(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"torch=={PINNED_TORCH}",
                f"ppbackward[test] @ {wheel.as_uri()}", external=True)
    session.chdir(where)
    said = session.run(str(venv / "bin" / "ppbackward"), "--version", silent=True, external=True, stderr=None)
    assert isinstance(said, str)
    session.log(f"ppbackward --version: {said.strip()}")
    if not said.startswith(f"ppbackward {version} (torch {PINNED_TORCH}"):
        session.error(f"ppbackward --version said {said.strip()!r}, not version {version} on torch {PINNED_TORCH}")
    # where tests/docs runs: the repo root goes on sys.path (python -m, pytest's rootdir: tests/__init__.py), and it
    # holds no ppbackward package (that is under src/), so the wheel's is imported, as WHICH asserts from there
    session.chdir(ROOT)
    session.run(str(venv / "bin" / "python"), "-c", WHICH, PINNED_TORCH, str(venv), external=True)
    session.run(str(venv / "bin" / "python"), "-m", "pytest", "tests/docs", *session.posargs, external=True)


@nox.session(name="torch-2.15", tags=["torch"])
def torch_2_15(session: nox.Session) -> None:
    """torch 2.15.0 (the newest supported): tests/core tests/compat, then the quick torchrun matrix."""
    _shared_venv(session, NEWEST_TORCH, f"torchtitan=={TORCHTITAN}")
    if session.posargs:
        _pytest(session, *session.posargs)
        return
    _pytest(session, "tests/core", "tests/compat")
    # one launch of each kind; the slow launches (world size 4, static metadata, DDP/FSDP2, torch's own backward,
    # hang, gloo P2P) run with `nox -s torch-2.15 -- tests/multiproc`
    _pytest(session, "tests/multiproc", "-m", "not slow")


@nox.session
def torchtitan(session: nox.Session) -> None:
    """torchtitan 0.3.0 trained on torch 2.15.0 with torch's and ppbackward's backward: tests/torchtitan."""
    _shared_venv(session, TITAN_TORCH, f"torchtitan=={TORCHTITAN}")
    _pytest(session, "tests/torchtitan", *session.posargs)


# What torch 2.5 cannot do skips there with its reason (docs/compatibility.md, "torch 2.5.1: what it cannot do")
@nox.session(name="torch-2.5.1", tags=["torch"])
def torch_2_5_1(session: nox.Session) -> None:
    """torch 2.5.1 (the oldest supported): tests/core tests/compat tests/leaks, then tests/multiproc."""
    _shared_venv(session, OLDEST_TORCH)
    if session.posargs:
        _pytest(session, *session.posargs)
        return
    _pytest(session, "tests/core", "tests/compat", "tests/leaks")
    _pytest(session, "tests/multiproc")


@nox.session(default=False)
def compat(session: nox.Session) -> None:
    """Any torch release: nox -s compat -- VERSION [pytest args] (default: tests/core tests/compat)."""
    if not session.posargs or not re.fullmatch(r"\d+\.\d+\.\d+", session.posargs[0]):
        session.error("usage: nox -s compat -- VERSION [PYTEST ARGS...]   e.g. nox -s compat -- 2.8.0")
    version, *args = session.posargs
    _shared_venv(session, version)
    _pytest(session, *(args or ["tests/core", "tests/compat"]))
