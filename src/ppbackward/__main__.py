"""``ppbackward`` / ``python -m ppbackward``: the command line (``ppbackward._tools.cli``)."""

from __future__ import annotations

import sys

from ppbackward._tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
