"""``python -m ppbackward._tools.bench``: same as ``ppbackward bench``."""

from ppbackward._tools.bench import main

raise SystemExit(main())
