"""Private: the tooling behind the library — the schedule harness, the bench and the command line.

The library (``ppbackward``: the stage backward functions, ``install``, :mod:`ppbackward.leaks`, the pytest
plugin, ``ppbackward.run``) never imports this package; ``ppbackward.__main__`` (the console script) does.
Nothing here is public API. One naming convention: the package is private, its modules carry no leading
underscore.

* ``harness/`` — the multiprocess schedule harness shared by ``ppbackward check`` and ``tests/multiproc``;
* ``bench/`` — the measurements of ``ppbackward bench``;
* ``cli/`` — the command line (``check``, ``bench``);
* ``torchrun`` (the one module that starts torchrun processes), ``memory`` (bytes of saved activations a
  graph holds), ``text_table`` (the one table writer).
"""
