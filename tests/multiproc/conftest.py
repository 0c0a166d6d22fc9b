"""``tests/multiproc``: every pipeline schedule under torchrun (gloo, CPU), leak-free, lifetime-checked and exact.

Layers, cheapest first (torch 2.13.0, 2 CPU cores). Launches marked ``slow`` in ``multiproc_specs.py``
are left out by ``pytest -m "not slow"``, which keeps one launch of each kind (``ws2``, ``training-ws2``,
``leaky-cycle``); CI runs everything.

1. ``test_harness_units.py`` — no process group, no subprocess (seconds): the schedule matrix covers
   every ``Schedule*`` class of the installed torch with a placement rule; placements put every stage
   on exactly one rank; the model zoo and its reference are deterministic; each probe and the failure
   formatter catch what they must (perturbed grads, left-over caches, missing verdicts).
2. ``test_matrix.py`` — the matrix: every schedule × model (``mlp``, ``transformer``, ``tuple``,
   ``ckpt``) with ``ppbackward.install()`` active, 2 measured steps each, in **one torchrun launch per
   configuration**: world size 2 and 4 (slow) with torch's dynamic shape inference, and world size 2
   with static stage metadata (slow). One pytest test per (configuration, case) reads the per-rank JSON
   verdicts of that launch; the launch runs once, in the background from collection on (Note
   [launches prefetched]).
3. ``test_training.py`` — the training models (LoRA, compiled, bf16, custom Function, selective AC) on 2
   ranks, and pipeline × DDP / FSDP2 on 4 ranks (slow); ``test_training_upstream.py`` (slow) pins which
   cells torch's own backward fails there, and why.
4. ``test_upstream.py`` (slow) — the same worker with torch's own backward, world size 2: every rank
   reports every case (what ``ppbackward check`` relies on); full-backward schedules pass, so the
   harness agrees with torch itself; torch's zero-bubble failures are reported, not asserted.
5. ``test_negative_controls.py`` — ``leaky_backward.py`` swapped in: the suite reports a
   reference-cycle leak as *garbage* with its exact count of tensors and autograd nodes, and (slow) a
   live-reference leak and a node held by a C++ cycle as *lifetime* with exact counts.
6. ``test_hang.py`` (slow) — a rank blocked in ``dist.recv``: the launcher dumps every rank's stack and
   kills the launch once it makes no progress for its timeout; the failure shows each rank's log.
7. ``test_gloo_p2p.py`` — two bare gloo launches (slow): the worker's workaround for torch 2.5-2.7
   schedules dropping P2P works delivers a whole batch, and the dropped-work shape hangs (negative
   control).

On torch 2.5 the same tests run the schedules 2.5 has (see ``docs/compatibility.md``, "torch 2.5.1
under torchrun"); ``test_upstream.py`` then requires torch's own full backward to fail, by its leak.

Where things run: pytest (this process) only launches ``python -m torch.distributed.run --standalone``
through :func:`ppbackward._tools.harness.launch.launch`; torchrun starts the ranks, each running
``python -m ppbackward._tools.harness.worker`` (``src/ppbackward/_tools/harness/``), which writes
``rank<r>.json`` and ``rank<r>.log`` into a temporary folder. Each launch has its own rendezvous
(``--standalone``: no fixed port).

What each case asserts, per rank and per step (see ``ppbackward._tools.harness.worker`` and ``.probes``):
garbage (``check_tensor_leaks``: 0 tensors, 0 autograd nodes), lifetime (gc disabled: every saved
activation freed once ``clear_runtime_states()`` ran and the receive buffers -- what torch's stage keeps
by design -- are released), caches (``fwd_cache``, ``backward_state`` empty; ``bwd_cache`` and
``dw_runner`` only tensor-free leftovers; ``output_chunks`` one per microbatch on the last stage, on
every stage with torch 2.5;
the schedule's losses and pending receives empty), numerics (each loss and every parameter's grad
within ``|x - ref| <= 1e-6 + 1e-5 |ref|`` of a single-process float32 reference, sum-reduced loss,
``scale_grads=False``), hooks (post-accumulate-grad hooks once per trainable parameter per microbatch).

Bounded time without depending on the machine's speed: the launcher's hang clock starts once every rank
has started and measures time without progress (Note [hang clock] in ``ppbackward._tools.harness.launch``);
the workers' gloo timeouts scale with the launch's measured start-up (Note [timeouts scale with
start-up] in the worker); ``@pytest.mark.timeout`` is a backstop only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from ppbackward._tools.harness.launch import LaunchResult, launch
from tests.multiproc.multiproc_specs import LAUNCHES, launches_of

# Note [launches prefetched]: the launches the selected tests read start at collection time, one at a time, in a
# background thread, in the order the tests will need them; a test waits for its launch's result, and starts it itself
# (in its own thread) if the background thread has not reached it yet. Most of the suite's other tests are
# single-threaded Python and torch's zero-bubble failures in the ``upstream-*`` launches leave their ranks waiting out
# per-case timeouts: overlapping the two uses the second core and the waits (about a minute off the suite's pytest
# alone on 2 idle cores; under ``.ci/run`` another nox session shares them). Running concurrently with other work
# rests on three things: the launcher's hang clock measures progress, not wall-clock time, and the workers' gloo
# timeouts scale with the start-up they measure (Note [hang clock] in ``ppbackward._tools.harness.launch``, Note
# [timeouts scale with start-up] in the worker); and no test of this process scans the heap in a way that breaks this
# thread. A loop over ``gc.get_objects()`` or ``gc.get_referrers()`` in the main thread once made this thread's
# ``tuple(...)`` calls fail with ``SystemError`` (issue 39): the leak tools and the tests scan through
# ``ppbackward.leaks._heap`` (Note [heap scans beside other threads]), ``tests/leaks/test_heap.py`` refuses a bare
# heap scan anywhere else (but its one-thread control, which keeps only the referrers of a private marker), and the
# race's negative control, a bare scan on purpose, runs in a child process (Note [the naive control in a child
# process] in ``tests/leaks/naive_scan.py``: in this process it broke this thread twice in CI).


class _Launches:
    """Each launch runs once, by whichever asks first: the background thread or a test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.results: dict[str, Future] = {}
        self.queue: list[str] = []
        self.stopped = False
        self.thread: threading.Thread | None = None

    def _claim(self, name: str) -> Future | None:
        """The future to fill when the caller must run ``name`` itself; None if someone else does."""
        with self.lock:
            if name in self.results:
                return None
            self.results[name] = future = Future[Any]()
            return future

    def _run(self, name: str, future: Future) -> None:
        spec = LAUNCHES[name]
        try:
            result = launch(  # on_case: record progress (LaunchResult.progress) as the launch runs
                spec.nproc, list(spec.args), self.root / name, timeout=spec.timeout, env=dict(spec.env),
                on_case=lambda case_id, per_rank: None,
            )
        except BaseException as e:  # the test that reads it reports the error
            future.set_exception(e)
        else:
            future.set_result(result)

    def prefetch(self, names: list[str]) -> None:
        self.queue = list(names)
        self.thread = threading.Thread(target=self._background, name="multiproc-prefetch", daemon=True)
        self.thread.start()

    def _background(self) -> None:
        for name in self.queue:
            if self.stopped:
                return
            future = self._claim(name)
            if future is not None:
                self._run(name, future)

    def get(self, name: str) -> LaunchResult:
        future = self._claim(name)
        if future is not None:
            self._run(name, future)
        return self.results[name].result()

    def stop(self) -> None:
        """Start no further launch, and wait for the one running (its own timeouts bound it), so that no
        torchrun outlives the session."""
        self.stopped = True
        if self.thread is not None:
            self.thread.join()


_LAUNCHES: _Launches | None = None


def _skipped(item: pytest.Item) -> bool:
    """Whether a mark skips ``item`` whatever happens (a ``skip``, or a ``skipif`` whose condition is True):
    its launches are not prefetched (torch 2.5.1 skips whole launches' tests)."""
    for mark in item.iter_markers():
        if mark.name == "skip" or (mark.name == "skipif" and mark.args and mark.args[0] is True):
            return True
    return False


def pytest_collection_finish(session: pytest.Session) -> None:
    global _LAUNCHES
    needed: list[str] = []
    for item in session.items:
        if _skipped(item):
            continue
        for name in launches_of(item):
            if name not in needed:
                needed.append(name)
    if not needed or session.config.option.collectonly:
        return
    _LAUNCHES = _Launches(session.config._tmp_path_factory.mktemp("multiproc"))  # type: ignore[attr-defined]  # pytest's tmp_path plugin sets it
    _LAUNCHES.prefetch(needed)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _LAUNCHES is not None:
        _LAUNCHES.stop()


@pytest.fixture(scope="session")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], LaunchResult]:
    """``launches(name)``: the :class:`LaunchResult` of launch ``name`` of :data:`LAUNCHES`, run once
    (Note [launches prefetched])."""
    global _LAUNCHES
    if _LAUNCHES is None:  # nothing was prefetched (e.g. a test reads a launch it did not declare)
        _LAUNCHES = _Launches(tmp_path_factory.mktemp("multiproc"))
    return _LAUNCHES.get


@pytest.fixture(scope="module", autouse=True)
def _heap_frozen():
    """The harness probes search the whole heap for holders: nothing frozen (Note [frozen heap] in
    tests/conftest.py)."""
    yield
