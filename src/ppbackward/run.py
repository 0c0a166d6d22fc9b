"""Zero-code launcher: install ppbackward, then run a script or module as ``__main__``.

::

    python -m ppbackward.run SCRIPT ARGS...          # as `python SCRIPT ARGS...`
    python -m ppbackward.run -m MODULE ARGS...       # as `python -m MODULE ARGS...`
    python -m ppbackward.run --merge-bw -m MODULE ARGS...   # install(merge_bw=True)
    torchrun --nproc-per-node 8 -m ppbackward.run -m torchtitan.train --module llama3 ...

:func:`main` calls :func:`ppbackward.install` and then runs the target the way the interpreter itself
would: ``sys.argv`` is ``[SCRIPT, ARGS...]`` (``[full path of MODULE's file,
ARGS...]`` for ``-m``), ``sys.path[0]`` is the script's folder (the current directory for ``-m``), the
target's ``SystemExit`` code is the exit code, and an exception goes to ``sys.excepthook`` (the target's
own, where it set one) with the target's traceback (this module's and runpy's frames left out) and exit
code 1; a module or ``__main__`` that runpy cannot find is the interpreter's one line and exit code 1, and a
leading ``--`` ends the launcher's options as it ends the interpreter's. Everything after SCRIPT or MODULE is
passed through untouched, options that look like ``ppbackward.run``'s own included. ``--merge-bw``
(before SCRIPT or ``-m``; the launcher's one option) installs with ``merge_bw=True``: each B of a
zero-bubble schedule directly followed by its own W runs as one full backward (Note [merged B and W] in
``ppbackward._merge``). Under torchrun
every rank runs this module, so every rank installs ppbackward before the target starts.

A refusal -- the installed torch outside ``ppbackward.SUPPORTED_TORCH``, a ``stage.py`` whose contract
ppbackward does not know, or ``--merge-bw`` on a torch without the schedule lowering it wraps
(:class:`ppbackward.UnsupportedTorchError`) -- is one line on stderr and exit code 3 before the target
runs; a usage error, or a ``PPBACKWARD_ALLOW_UNTESTED_TORCH`` value other than 0 or 1 on a newer torch, is one line
and exit code 2. The target's module stays ``sys.modules["__main__"]`` after its body ends, as under the interpreter
(Note [the target stays __main__]).

Note [run shows the install]: :func:`ppbackward.install` logs one ``INFO`` record on the ``ppbackward``
logger, on rank 0 (Note [install says so] in ``ppbackward._install``), which logging shows nowhere until
the program configures it, and the target has not run yet when the launcher installs. So while it installs,
the launcher gives that logger a handler on stderr (the bare message) and the ``INFO`` level, unless the
root logger or that logger already has a handler (then the configuration in place decides), and takes
both away again before the target starts: the target's own logging set-up (torchtitan's ``init_logger``,
``logging.basicConfig``) finds logging as it would without the launcher. Under torchrun every rank
installs and rank 0 alone prints the line.

Launchers that start their own worker processes (not through ``python -m ppbackward.run``) get no
ppbackward in those workers: there is deliberately no environment switch that installs it at interpreter
start-up (see ``docs/torchtitan.md``, "Launchers that start their own workers"); such a worker calls
``ppbackward.install()`` in its entry point instead.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.machinery
import importlib.util
import io
import logging
import marshal
import os
import pkgutil
import runpy
import sys
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["main"]

USAGE = "usage: python -m ppbackward.run [--merge-bw] ([--] SCRIPT | -m MODULE) [ARGS...]"
HELP = (
    f"{USAGE}\n\n"
    "Install ppbackward (ppbackward.install()), then run SCRIPT, or MODULE with -m, as __main__ with ARGS, as\n"
    "python would; under torchrun every rank does, and rank 0 says so in one line on stderr. Exit code: the\n"
    "target's; 2 usage error; 3 ppbackward refuses this torch (one line, nothing ran).\n\n"
    "  --merge-bw  install(merge_bw=True): in zero-bubble schedules the target builds, each B directly followed\n"
    "              by its own W runs as one full backward (docs/api.md, docs/performance.md)"
)
EXIT_USAGE = 2
EXIT_REFUSED = 3


def _parse(argv: list[str]) -> tuple[str, str, list[str]] | str:
    """``(kind, target, args)`` with kind ``"script"`` or ``"module"``, or a usage error message."""
    if not argv:
        return "no target given"
    first = argv[0]
    if first in ("-h", "--help"):
        return ""
    if first == "--":  # the end of options, as the interpreter takes it: what follows is SCRIPT
        if len(argv) < 2:
            return "-- needs a script after it"
        return "script", argv[1], argv[2:]
    if first == "-m":
        if len(argv) < 2:
            return "-m needs a module name"
        return "module", argv[1], argv[2:]
    if first.startswith("-m") and len(first) > 2:  # -mMODULE, as the interpreter accepts it
        return "module", first[2:], argv[1:]
    if first.startswith("-"):
        return f"unknown option {first!r} (options of the target go after SCRIPT or -m MODULE)"
    return "script", first, argv[1:]


@contextlib.contextmanager
def _install_shown() -> Iterator[None]:
    """The ``ppbackward`` logger on stderr at ``INFO`` for the block, where nothing is configured
    (Note [run shows the install])."""
    logger = logging.getLogger("ppbackward")
    if logging.getLogger().handlers or logger.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _install(merge_bw: bool) -> tuple[int, str] | None:
    """Install ppbackward (its log line shown: Note [run shows the install]); ``None`` once installed, else the
    exit code and the one-line reason: :data:`EXIT_REFUSED` for a torch ppbackward refuses, :data:`EXIT_USAGE`
    for a ``PPBACKWARD_ALLOW_UNTESTED_TORCH`` value that is neither 0 nor 1 (read on a newer torch only)."""
    from ppbackward import UnsupportedTorchError, install

    try:
        with _install_shown():
            install(merge_bw=merge_bw)
    except UnsupportedTorchError as exc:
        return EXIT_REFUSED, str(exc).splitlines()[0]
    except ValueError as exc:  # install's one ValueError: the opt-in's value (Note [untested newer torch])
        return EXIT_USAGE, str(exc).splitlines()[0]
    return None


def main(argv: list[str] | None = None) -> int:
    """Install ppbackward and run the target of ``argv`` (default ``sys.argv[1:]``) as ``__main__``.

    Returns:
        The exit code: the target's (``0`` when it returns normally, its ``SystemExit`` code otherwise),
        ``2`` for a usage error, ``3`` when ppbackward refuses the installed torch (nothing ran then).

    An exception raised by the target goes to ``sys.excepthook`` (its traceback from the target's first
    frame) and gives ``1``; ``KeyboardInterrupt`` and other ``BaseException``\\ s besides ``SystemExit`` propagate.
    The target's module replaces ``sys.modules["__main__"]`` for good, the caller's own when called in process
    (Note [the target stays __main__]).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    merge_bw = bool(argv) and argv[0] == "--merge-bw"
    parsed = _parse(argv[1:] if merge_bw else argv)
    if isinstance(parsed, str):
        if not parsed:
            print(HELP)
            return 0
        print(f"ppbackward.run: {parsed}\n{USAGE}", file=sys.stderr)
        return EXIT_USAGE
    kind, target, args = parsed
    if kind == "script" and not os.path.exists(target):
        print(f"ppbackward.run: can't open file {target!r}: no such file", file=sys.stderr)
        return EXIT_USAGE
    refused = _install(merge_bw)
    if refused is not None:
        print(f"ppbackward.run: not running {target}: {refused[1]}", file=sys.stderr)
        return refused[0]
    try:
        _run(kind, target, args)
    except SystemExit as exc:
        return _exit_code(exc)
    except Exception as exc:  # the interpreter's report: the target's frames, exit code 1
        tb = _target_traceback(exc)
        if tb is None and isinstance(exc, ImportError):  # runpy found nothing to run: the interpreter's line
            print(f"{sys.executable}: {exc}", file=sys.stderr)
            return 1
        _report(exc, tb)
        return 1
    finally:
        _script_ended()
    return 0


def _report(exc: Exception, tb: types.TracebackType | None) -> None:
    """Report the target's ``exc`` as the interpreter does: through ``sys.excepthook`` (the target's own, if it
    set one) with the target's frames only (none for a ``SyntaxError`` in the target's file, whose location
    the message gives); a hook that raises is reported, then ``exc`` by the default hook."""
    exc = exc.with_traceback(tb)  # the default hook prints the exception's own traceback
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception as hook_error:
        hook_error.__suppress_context__ = True  # the hook's own error, from the hook's frames, as python prints it
        hook_tb = hook_error.__traceback__.tb_next if hook_error.__traceback__ is not None else None
        print("Error in sys.excepthook:", file=sys.stderr)
        sys.__excepthook__(type(hook_error), hook_error.with_traceback(hook_tb), hook_tb)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)


# Note [the target stays __main__]: ``python SCRIPT`` runs the script in the process's ``__main__`` module, which
# stays in ``sys.modules`` until the interpreter shuts down and clears it. ``runpy.run_path``/``run_module`` run
# the target in a temporary module and put the previous ``__main__`` (this launcher's) back when its body ends:
# a thread or ``atexit`` handler that pickles a class of the script then fails (``attribute lookup ... on
# __main__``: an async checkpoint writer, ``torch.save`` at exit), and the target's globals, left in a cycle with
# its functions, are never cleared at shutdown, so a file it opened and never closed is never flushed (found
# empty). So the launcher makes the target's module itself, puts it in ``sys.modules["__main__"]`` for good,
# and runs the code in it with the attributes the interpreter sets. For a script: ``__file__`` the path joined
# to the current directory, not normalised (python 3.9+: after an ``os.chdir`` ``__file__`` and
# ``inspect.getsource`` still find the file, and ``link/..`` is the folder the link's target is in), no spec, a
# ``.pyc`` name run as compiled code; once the body has ended and an exception it raised has been reported,
# ``__file__`` and ``__cached__`` are deleted, as the interpreter does. For ``-m``: the module's spec, found by
# runpy's own lookup (the interpreter's errors for a missing module or a package without ``__main__``). A folder
# or zip file holding ``__main__.py``: its ``__main__`` found on the path, put first, as the interpreter does
# (``-P`` or not). The lookups are runpy's private ``_get_module_details`` and ``_get_main_module_details``, the
# same on python 3.9-3.13; where one is missing, ``runpy.run_module``/``run_path`` as before.
_made: list[types.ModuleType] = []  # the script's __main__ module, once made (0 or 1 entry)


def _run(kind: str, target: str, args: list[str]) -> None:
    """Run ``target`` as ``__main__`` with ``sys.argv``/``sys.path[0]`` as the interpreter sets them (Note [the
    target stays __main__]); for a script or ``-m`` under ``-P`` or ``-I`` (python 3.11+'s ``sys.flags.safe_path``;
    ``-I`` before it) ``sys.path`` is left as it is, as the interpreter leaves it."""
    sys.argv = [target, *args]
    safe_path = getattr(sys.flags, "safe_path", bool(sys.flags.isolated))
    if kind == "module":
        if not safe_path:
            sys.path[0] = os.getcwd()  # `python -m` puts the current directory first
        details = getattr(runpy, "_get_module_details", None)
        if details is None:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
            return
        _, spec, code = details(target)  # ImportError as run_module's
        sys.argv[0] = spec.origin  # as the interpreter's -m
        _run_found(spec, code)
        return
    path = target if os.path.isabs(target) else os.path.join(os.getcwd(), target)
    if pkgutil.get_importer(target) is not None:  # a folder or zip file holding __main__.py
        main_details = getattr(runpy, "_get_main_module_details", None)
        if main_details is None:
            runpy.run_path(target, run_name="__main__")
            return
        if safe_path:  # the interpreter puts the path first whatever -P says: its __main__ is found there
            sys.path.insert(0, path)
        else:
            sys.path[0] = path
        _, spec, code = main_details()  # ImportError "can't find '__main__' module in PATH", as the interpreter's
        _run_found(spec, code)
        return
    if not safe_path:  # `python SCRIPT` puts the script's folder first (symbolic links resolved)
        sys.path[0] = os.path.dirname(os.path.realpath(target))
    with io.open_code(path) as f:
        data = f.read()
    loader: Any
    if path.endswith(".pyc"):  # compiled code, as `python FILE.pyc` runs it
        if data[:4] != importlib.util.MAGIC_NUMBER:
            raise RuntimeError("Bad magic number in .pyc file")
        code = marshal.loads(data[16:])
        loader = importlib.machinery.SourcelessFileLoader("__main__", path)
    else:
        code = compile(data, path, "exec", dont_inherit=True)
        loader = importlib.machinery.SourceFileLoader("__main__", path)
    _made.append(_new_main(__file__=path, __cached__=None, __loader__=loader, __package__=None, __spec__=None))
    exec(code, _made[0].__dict__)


def _run_found(spec: Any, code: types.CodeType) -> None:
    """Run the ``code`` of a module runpy found (``spec``) as ``__main__``, with the attributes the interpreter's
    ``-m`` gives it (Note [the target stays __main__])."""
    module = _new_main(__file__=spec.origin, __cached__=spec.cached, __loader__=spec.loader, __package__=spec.parent,
                       __spec__=spec)
    exec(code, module.__dict__)


def _new_main(**attributes: Any) -> types.ModuleType:
    """A new module with ``attributes`` set, put in ``sys.modules["__main__"]`` for good (Note [the target stays
    __main__])."""
    module = types.ModuleType("__main__")
    module.__dict__.update(attributes, __builtins__=builtins)
    sys.modules["__main__"] = module
    return module


def _script_ended() -> None:
    """Delete the script's ``__file__`` and ``__cached__`` once its body has ended and its exception, if any, has
    been reported, as the interpreter does (Note [the target stays __main__])."""
    while _made:
        module = _made.pop()
        module.__dict__.pop("__file__", None)
        module.__dict__.pop("__cached__", None)


def _target_traceback(exc: BaseException) -> types.TracebackType | None:
    """``exc``'s traceback from the target's first frame (this module's and runpy's left out), or ``None`` where
    it has none: runpy raised it before any of the target ran (no such module, no ``__main__``)."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename == "<frozen runpy>"):
        tb = tb.tb_next
    return tb


def _exit_code(exc: SystemExit) -> int:
    """The process exit code the interpreter would give ``exc`` (printing a non-int code to stderr)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
