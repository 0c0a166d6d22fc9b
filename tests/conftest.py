"""Test-suite wide settings and fixtures. ``tests`` is a package: shared helpers are imported by their
full name (``from tests.core.stages import build``), and pytest puts the repository root on ``sys.path``."""

import gc
import os
from pathlib import Path

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
# objects that existed before it frozen (gc.freeze(): moved to the permanent generation, which collections skip) and
# unfrozen after it. A test's verdicts are about the objects it creates, which stay in the young generations: cyclic
# garbage among them is found as before, and a cycle through a frozen object is alive from outside (it was reachable
# before the module ran). Frozen objects are out of sight of gc.get_objects and gc.get_referrers too, so what searches
# the whole heap keeps it whole: the heap scans' own tests (tests/leaks/test_heap.py: the race of issue 39 and the
# scans' reference counts are about the real heap), the probes of the multiprocess harness, and the docs, which run
# users' code as users run it.
_WHOLE_HEAP = ("multiproc", "docs", "leaks/test_heap.py")
_TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def _heap_frozen(request):
    """Note [frozen heap]."""
    where = Path(request.path).resolve().relative_to(_TESTS).as_posix()
    if any(where == name or where.startswith(name + "/") for name in _WHOLE_HEAP):
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
