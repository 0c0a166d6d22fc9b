"""Private: the multiprocess schedule harness shared by ``tests/multiproc`` and ``ppbackward check``.

Modules (none of these names is public API; they may change without notice):

* :mod:`~ppbackward._tools.harness.models` — the model zoo (tiny stage stacks and their single-process reference);
* :mod:`~ppbackward._tools.harness.schedules` — the schedule matrix of the installed torch (placement and
  microbatch rules, skip reasons);
* :mod:`~ppbackward._tools.harness.probes` — per-step measurements (garbage, activation lifetime, stage caches,
  numerics) behind one small adapter over :mod:`ppbackward.leaks`;
* :mod:`~ppbackward._tools.harness.worker` — the torchrun worker (``python -m ppbackward._tools.harness.worker``);
* :mod:`~ppbackward._tools.harness.launch` — starts torchrun in its own process group, with a timeout that kills
  the whole group, and turns per-rank JSON verdicts and logs into one readable block per failing case.
"""
