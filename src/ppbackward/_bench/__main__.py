"""``python -m ppbackward._bench``: same as ``ppbackward bench``."""

from ppbackward._bench import main

raise SystemExit(main())
