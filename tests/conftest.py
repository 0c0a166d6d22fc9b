"""Test-suite wide settings and fixtures. ``tests`` is a package: shared helpers are imported by their
full name (``from tests.core.stages import build``), and pytest puts the repository root on ``sys.path``."""

import contextlib
import gc
import os
import sys
from collections.abc import Iterator

import hypothesis
import pytest
import torch
import torch.distributed as dist

import ppbackward._plan

torch.set_num_threads(1)

# Note [one plan per graph structure] (ppbackward._plan): every plan B reuses is compared with a fresh analysis,
# here and in the processes the tests launch (which read the variable at import)
os.environ["PPBACKWARD_VERIFY_PLANS"] = "1"
ppbackward._plan.VERIFY = True

# hypothesis (tests/core/test_random_stages.py, test_detached_outputs.py): under CI each run draws the same examples
# (seeded from each test), so a CI verdict is repeatable and a failure there is one the next run shows again, with
# the blob that reproduces it; a local run draws new examples each time, as hypothesis does by default
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
    hypothesis.settings.load_profile("ci")


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



# Note [each test leaves the process as it found it]: a test that changes process-wide state and does not put it back
# changes every test after it, which then fails (or passes vacuously) far from the cause. A CI run on 2026-12-05
# failed test_call_counts' negative control after some earlier test had left the automatic gc switched off: no
# collection was due, and nothing said which test switched it off. So the state the suite's verdicts rest on is
# compared before and after each test, as CPython's own test runner compares its environment: what changed is put
# back and a warning names the test and the state. A warning, not a failure, as in CPython's runner: the test's own
# verdict stands, and the next test starts as the suite expects. ppbackward's gc pause (blocks inside it, all
# threads) is only reported: a B, W or leak tool still inside it belongs to a thread or object the test left alive.
def _process_state() -> dict[str, object]:
    import ppbackward
    import ppbackward._gc_pause as pause

    return {
        "the automatic gc (gc.isenabled)": gc.isenabled(),
        "ppbackward's gc pause (blocks inside it)": pause._depth,
        "the profile function (sys.setprofile)": sys.getprofile(),
        "the trace function (sys.settrace)": sys.gettrace(),
        "ppbackward installed into torch": ppbackward.is_installed(),
        "torch's intra-op threads": torch.get_num_threads(),
        "torch's grad mode": torch.is_grad_enabled(),
        "torch's anomaly mode": torch.is_anomaly_enabled(),
    }


def _put_back(before: dict[str, object]) -> None:
    import ppbackward

    (gc.enable if before["the automatic gc (gc.isenabled)"] else gc.disable)()
    sys.setprofile(before["the profile function (sys.setprofile)"])  # type: ignore[arg-type]
    sys.settrace(before["the trace function (sys.settrace)"])  # type: ignore[arg-type]
    if ppbackward.is_installed() and not before["ppbackward installed into torch"]:
        ppbackward.uninstall()
    torch.set_num_threads(before["torch's intra-op threads"])  # type: ignore[arg-type]
    torch.set_grad_enabled(before["torch's grad mode"])  # type: ignore[arg-type]
    torch.autograd.set_detect_anomaly(before["torch's anomaly mode"])  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _process_state_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """Note [each test leaves the process as it found it]."""
    before = _process_state()
    yield
    after = _process_state()
    changed = [f"{what}: {before[what]!r} -> {after[what]!r}" for what in before if after[what] != before[what]]
    if not changed:
        return
    _put_back(before)
    request.node.warn(
        pytest.PytestWarning(
            f"{request.node.nodeid} changed the process for the tests after it; put back (Note [each test leaves the "
            f"process as it found it] in tests/conftest.py): " + "; ".join(changed)
        )
    )
