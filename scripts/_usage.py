"""``-h`` / ``--help`` for the measurement scripts in this folder: print the calling script's docstring (what it
measures, its arguments, how to read its output) and exit 0 before it measures anything. Each script calls
:func:`exit_if_help` at its start (after its imports); ``python scripts/NAME.py --help``. Imported as ``_usage``,
which needs this folder first on ``sys.path``, as ``python scripts/NAME.py`` puts it (not under ``python -P``).
``host_instructions.py`` has argparse's own ``--help``."""

from __future__ import annotations

import sys


def exit_if_help(doc: str | None) -> None:
    """Exit 0 after printing ``doc`` if the command line asks for help (``-h`` or ``--help`` anywhere)."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        print((doc or "").strip())
        raise SystemExit(0)
