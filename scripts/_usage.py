"""``-h`` / ``--help`` for the measurement scripts in this folder: print the calling script's docstring (what it
measures, its arguments, how to read its output) and exit 0, before the script imports torch or reads its
arguments. Each script calls :func:`exit_if_help` first; ``python scripts/NAME.py --help``."""

import sys


def exit_if_help(doc: str | None) -> None:
    """Exit 0 after printing ``doc`` if the command line asks for help (``-h`` or ``--help`` anywhere)."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        print((doc or "").strip())
        raise SystemExit(0)
