"""Test-suite wide settings and fixtures. ``tests`` is a package: shared helpers are imported by their
full name (``from tests.core.stages import build``), and pytest puts the repository root on ``sys.path``."""

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import hypothesis
import pytest
import torch
import torch.distributed as dist

import ppbackward._gc_pause as _gc_pause
import ppbackward._plan
import ppbackward.leaks._gc_phase as _gc_phase  # its gc callback in place from the start (Note [each test ...])

torch.set_num_threads(1)

# Note [one plan per graph structure] (ppbackward._plan): every plan B reuses is compared with a fresh analysis,
# here and in the processes the tests launch (which read the variable at import)
os.environ["PPBACKWARD_VERIFY_PLANS"] = "1"
ppbackward._plan.VERIFY = True

# hypothesis (tests/core/test_random_stages.py, test_detached_outputs.py): wherever ``CI`` is set (any value, as
# hypothesis detects CI), each run draws the same examples, seeded from each test, so a CI verdict repeats and a
# failure there prints the blob that reproduces it; elsewhere each run draws new ones, as hypothesis does by default.
# Recent hypothesis releases load a "ci" profile of their own then; this one extends whatever is loaded.
if "CI" in os.environ:
    hypothesis.settings.register_profile("ppbackward-ci", derandomize=True, print_blob=True)
    hypothesis.settings.load_profile("ppbackward-ci")


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
# changes every test after it, which then fails (or passes vacuously) far from the cause: a CI run on 2026-12-05
# failed test_call_counts' negative control with the automatic gc switched off before it (the one way found to make
# that count fail as it did), and nothing said what had switched it off. So the state the suite's verdicts rest on
# (``_STATE``) is read before and after each test, and each test's start is compared with the last one's end (a
# fixture of wider scope, a hook or an import changes it there). What changed is put back where that is safe, and a
# ``ProcessStateChanged`` warning names the test and the state. A warning, not a failure, as CPython's test runner
# reports a changed environment unless told ``--fail-env-changed``: with the state put back, the tests after it
# start as the suite expects, and the test's own verdict stands. Reported only: ppbackward's gc pause (a B, W or
# leak tool still inside it belongs to a thread or object the test left alive), inference mode (no setter), an
# install the test undid (its options are unknown), and a profile or trace function the test replaced (a profiler
# or debugger attached to the session swaps its own; one a test added where there was none is taken out). The
# profile and trace functions are the main thread's. ``gc.callbacks`` is compared without the callbacks a library adds
# once for the process (``ppbackward.leaks._gc_phase``'s ``_on_gc``, imported here; hypothesis' own).
class ProcessStateChanged(pytest.PytestWarning):
    """A test, or what ran between two tests, changed process-wide state (Note [each test leaves the process as it
    found it])."""


def _installed() -> bool:
    import ppbackward

    return ppbackward.is_installed()


def _uninstall_added(before: object) -> bool:
    import ppbackward

    if before or not ppbackward.is_installed():
        return False
    ppbackward.uninstall()
    return True


def _callbacks() -> tuple:
    """``gc.callbacks`` but ppbackward's ``_on_gc`` and those of libraries that add one for the process on first use
    (hypothesis' gc-time accounting): the leak tools' and the tests' own."""
    return tuple(
        cb for cb in gc.callbacks
        if cb is not _gc_phase._on_gc and not getattr(cb, "__module__", "").startswith(_PROCESS_CALLBACKS_OF)
    )


_PROCESS_CALLBACKS_OF = ("hypothesis.",)


def _callbacks_put_back(before: object) -> bool:
    for cb in _callbacks():
        if cb not in before:  # type: ignore[operator]
            gc.callbacks.remove(cb)
    gc.callbacks.extend(cb for cb in before if cb not in gc.callbacks)  # type: ignore[attr-defined]
    return True


def _function_added_taken_out(setter: Callable[[Any], None]) -> Callable[[object], bool]:
    def put_back(before: object) -> bool:
        if before is not None:
            return False
        setter(None)
        return True

    return put_back


def _always(setter: Callable[[Any], object]) -> Callable[[object], bool]:
    def put_back(before: object) -> bool:
        setter(before)
        return True

    return put_back


# (what, read it, put it back: True where it did); the first five are the collector's, compared between tests too
_STATE: list[tuple[str, Callable[[], object], Callable[[object], bool] | None]] = [
    ("the automatic gc (switched on)", _gc_pause.collector_enabled, _always(_gc_pause.restore_collector)),
    ("the gc's debug flags", gc.get_debug, _always(gc.set_debug)),
    ("the gc's thresholds", gc.get_threshold, _always(lambda t: gc.set_threshold(*t))),
    ("gc.callbacks", _callbacks, _callbacks_put_back),
    ("ppbackward's gc pause (blocks inside it, all threads)", lambda: _gc_pause._depth, None),
    ("the profile function (sys.setprofile)", sys.getprofile, _function_added_taken_out(sys.setprofile)),
    ("the trace function (sys.settrace)", sys.gettrace, _function_added_taken_out(sys.settrace)),
    ("ppbackward installed into torch", _installed, _uninstall_added),
    ("torch's intra-op threads", torch.get_num_threads, _always(torch.set_num_threads)),
    ("torch's grad mode", torch.is_grad_enabled, _always(torch.set_grad_enabled)),
    ("torch's anomaly mode", torch.is_anomaly_enabled, _always(torch.set_anomaly_enabled)),
    ("torch's inference mode", torch.is_inference_mode_enabled, None),
]
_BETWEEN_TESTS = 5  # the collector's entries: no fixture or hook here changes them on purpose
_last_end: tuple[str, list[object]] | None = None  # the last test's id and its state once put back


def _read(entries: int = len(_STATE)) -> list[object]:
    return [read() for _, read, _ in _STATE[:entries]]


def _put_back_changed(before: list[object], after: list[object]) -> tuple[list[str], list[str]]:
    """Put back each entry that changed where that is safe; the lines of what was put back and what not."""
    put: list[str] = []
    kept: list[str] = []
    for (what, _, put_back), was, now in zip(_STATE, before, after):
        if now != was:
            line = f"{what}: {was!r} -> {now!r}"
            (put if put_back is not None and put_back(was) else kept).append(line)
    return put, kept


def _warn(node: pytest.Item, where: str, put: list[str], kept: list[str]) -> None:
    parts = [f"put back: {'; '.join(put)}"] if put else []
    parts += [f"reported only: {'; '.join(kept)}"] if kept else []
    node.warn(
        ProcessStateChanged(
            f"{where} changed the process for the tests after it (Note [each test leaves the process as it found "
            f"it] in tests/conftest.py). " + ". ".join(parts)
        )
    )


@pytest.fixture(autouse=True)
def _process_state_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """Note [each test leaves the process as it found it]."""
    global _last_end
    node = request.node
    if _last_end is not None:
        previous, end = _last_end
        now = _read(_BETWEEN_TESTS)
        put, kept = _put_back_changed(end[:_BETWEEN_TESTS], now)
        if put or kept:
            _warn(node, f"what ran between {previous} and {node.nodeid} (a fixture of wider scope, a hook, an import)",
                  put, kept)
    before = _read()
    yield
    put, kept = _put_back_changed(before, _read())
    if put or kept:
        _warn(node, node.nodeid, put, kept)
    _last_end = (node.nodeid, _read())
