"""Test-suite wide settings and fixtures. ``tests`` is a package: shared helpers are imported by their
full name (``from tests.core.stages import build``), and pytest puts the repository root on ``sys.path``."""

import contextlib
import gc
import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import ppbackward._plan

torch.set_num_threads(1)

# Note [one plan per graph structure] (ppbackward._plan): every plan B reuses is compared with a fresh analysis,
# here and in the processes the tests launch (which read the variable at import)
os.environ["PPBACKWARD_VERIFY_PLANS"] = "1"
ppbackward._plan.VERIFY = True


# Note [frozen heap]: a full collection visits every object the gc tracks, and by the middle of the suite that is
# most of a million (torch, dynamo, every test module): 0.1-0.2 s per gc.collect(), which the leak checks call several
# times per test (before, during and after a block, until one finds nothing). So each test module runs with the
# objects alive before it frozen (after one full collection, so that no pending garbage is frozen with them;
# gc.freeze() moves them to the permanent generation, which collections skip) and unfrozen after it. A test's verdicts
# are about the objects it creates, which the collections still visit: cyclic garbage among them is found as before,
# and a cycle through a frozen object is alive from outside as long as that object stays reachable, which the
# module's own globals and session fixtures do. What the freeze would hide: a cycle through a frozen object that a test
# drops (no test here drops an object made before its module) and a leftover of an earlier module (each module's
# checks arm themselves after their own collection anyway). gc.freeze() and gc.unfreeze() do not nest: code under
# test that calls gc.unfreeze() (the multiprocess worker's Note [gc freeze]) thaws the module, which is then only
# slower. Frozen objects are out of sight of gc.get_objects and gc.get_referrers too, so a module that searches the
# whole heap overrides this fixture with one that freezes nothing (`_heap_frozen` in tests/leaks/test_heap.py, whose
# reference counts are about the real heap; tests/multiproc/conftest.py, whose probes search for holders;
# tests/docs/conftest.py, which runs users' code as users run it). A test there that needs only a heap of a known
# size freezes for itself (`heap_frozen`: test_heap's race of issue 39, Note [a race needs a long scan]).
@contextlib.contextmanager
def _frozen() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture(scope="module", autouse=True)
def _heap_frozen():
    """Note [frozen heap]."""
    with _frozen():
        yield


@pytest.fixture
def heap_frozen():
    """The objects alive before the test frozen for the test alone (Note [frozen heap]), in a module that freezes
    nothing."""
    with _frozen():
        yield


@pytest.fixture(scope="module")
def process_group():
    """World size 1 (gloo, in-memory store): every stage of a schedule lives in this process. A group
    already initialised (by another module's fixture still alive) is used and left to its owner."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


@pytest.fixture
def graph_kept(monkeypatch):
    """B keeps the graph and W calls the intermediates again, whatever they are: the path B takes where Note
    [weight matmuls from their saved input] (ppbackward._matmul_weights) does not apply, forced on any stage."""
    monkeypatch.setattr("ppbackward.backward.take_saved_inputs", lambda *args: None)


# Note [each test leaves the collector on]: a test that switches the automatic gc off and does not switch it back
# changes every test after it: a leak check's collections still run (they are explicit), but a test that needs
# automatic collections (test_call_counts' disturbed count) then sees none, and fails far from the cause (a CI run
# did, 2026-12-05, without a trace of which test switched it off). So the collector is checked after each test, as
# CPython's own test runner checks its environment: switched off (by the test, or by a B, W or leak tool of it still
# holding ppbackward's pause on some thread), it is switched on again and a warning names the test. A warning, not a
# failure, as in CPython's runner: the test's own verdict stands, and the next test starts as the suite expects.
@pytest.fixture(autouse=True)
def _collector_left_on(request: pytest.FixtureRequest) -> Iterator[None]:
    """Note [each test leaves the collector on]."""
    was_on = gc.isenabled()
    yield
    if was_on and not gc.isenabled():
        import ppbackward._gc_pause as pause

        held = pause._depth  # B, W or leak-tool blocks inside the pause now, all threads together
        gc.enable()
        request.node.warn(
            pytest.PytestWarning(
                f"{request.node.nodeid} left the automatic gc switched off ({held} B/W/leak-tool block(s) of "
                f"ppbackward inside its pause); switched on again (Note [each test leaves the collector on])"
            )
        )
