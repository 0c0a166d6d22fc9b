"""``ppbackward`` / ``python -m ppbackward``: the command line (``ppbackward._cli``)."""

from __future__ import annotations

import sys

from ppbackward._cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
