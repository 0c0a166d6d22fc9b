"""``python -m ppbackward._tools.bench``: same as ``ppbackward bench``; an entry point, the one module of
this package that calls the command line (Note [tooling layers] in ``ppbackward._tools.bench``)."""

from ppbackward._tools.cli.bench import main

raise SystemExit(main())
