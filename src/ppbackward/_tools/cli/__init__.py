"""Private: the command line, ``ppbackward check`` (the main job) and ``ppbackward bench``.

The whole CLI lives in this package: :func:`main` dispatches; ``check`` (the check command: its options,
validation, launches and verdict), ``cells`` (the check's table cells), ``bench`` (the bench command's
options and run) and ``paths`` (output paths checked before anything runs). ``ppbackward.__main__`` and the
console script call :func:`main`.
"""

from __future__ import annotations

import sys

__all__ = ["main"]

_USAGE = """usage: ppbackward {check,bench} [options] | --version

  check   run every pipeline schedule of the installed torch under torchrun, with torch's own stage
          backward and with ppbackward; print leaks, activation lifetime, grads and hooks per schedule
  bench   time and memory of the split backward, upstream vs ppbackward (one process)

'ppbackward COMMAND --help' describes each command's options."""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command; returns the exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        print(_USAGE, file=sys.stderr)  # a usage error, like argparse's: stderr, exit code 2
        return 2
    if args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    if args[0] == "--version":
        import torch

        import ppbackward

        print(f"ppbackward {ppbackward.__version__} (torch {torch.__version__})")
        return 0
    command, rest = args[0], args[1:]
    if command == "check":
        from ppbackward._tools.cli.check import main as check_main

        return check_main(rest)
    if command == "bench":
        from ppbackward._tools.cli.bench import main as bench_main

        return bench_main(rest)
    print(f"ppbackward: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
    return 2

