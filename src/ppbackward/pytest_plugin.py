"""pytest plugin: fail a test that leaks tensors or autograd nodes into reference cycles, or whose saved
activations outlive it.

Registered through the ``pytest11`` entry point ``ppbackward`` (see ``pyproject.toml``), so it is
active wherever ppbackward is installed. Public names: the markers ``no_tensor_leaks`` and
``no_activations_held`` and the fixture ``tensor_leak_check``; see ``docs/leak-hunting.md``. Everything else
here is private. torch and ``ppbackward.leaks`` are imported only when a test asks for a check (the package
imports nothing on its own: Note [lazy package] in ``ppbackward``), so the plugin costs nothing to test suites
that do not use it (tests/core/test_lazy_import.py).

``no_tensor_leaks`` and the fixture wrap only the test *call* (not fixture setup or teardown) in
:func:`ppbackward.leaks.check_tensor_leaks` with ``strict=False``, then fail the test with the
report when a tensor or an autograd node leaked. ``no_activations_held`` wraps the call in
:func:`ppbackward.leaks.track_activations` and fails the test with the tracker's report when an activation
saved during the call, an autograd node made in it, or what a pack hook returned for one, is alive after it
and a full collection (held by a live reference: a module global, a cache, a fixture's object; a cycle is
freed by the collection, and is ``no_tensor_leaks``' finding). With both, the tracker is outside the checker
and a test failing both shows both reports. A test that already failed keeps its own failure.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Generator
from typing import Any

import pytest

__all__: list[str] = []  # the public surface is the markers and the fixture

_MARKER = "no_tensor_leaks"
_CHECKER = pytest.StashKey[Any]()
_CALLED = pytest.StashKey[bool]()  # the test's call began: the checker was entered or left out
_ALLOWED = ("warmup", "max_chains", "max_depth", "output_dir")
_HELD_MARKER = "no_activations_held"
_HELD_ALLOWED = ("include_parameters", "include_leaves")


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker, so ``--strict-markers`` accepts it."""
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(warmup=None, max_chains=3, max_depth=20, output_dir=None): fail the test when its "
        "call leaves tensors or autograd nodes in reference cycles (ppbackward.leaks.check_tensor_leaks)",
    )
    config.addinivalue_line(
        "markers",
        f"{_HELD_MARKER}(include_parameters=False, include_leaves=False): fail the test when an activation "
        "saved during its call is still alive after it (ppbackward.leaks.track_activations)",
    )


def _marker_kwargs(marker: Any, name: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The keyword arguments of ``marker`` (``None``: none), or the test failed naming what is wrong."""
    if marker is None:
        return {}
    if marker.args:
        pytest.fail(f"@pytest.mark.{name} takes keyword arguments only ({', '.join(allowed)})", pytrace=False)
    unknown = sorted(set(marker.kwargs) - set(allowed))
    if unknown:
        pytest.fail(
            f"@pytest.mark.{name}: unknown argument(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}",
            pytrace=False,
        )
    return dict(marker.kwargs)


def _checker_for(item: pytest.Item, wanted: bool = False) -> Any:
    """The (not yet entered) checker of ``item``, created on first request; ``None`` if unwanted (``wanted``: the
    fixture asked for it, also by ``request.getfixturevalue``)."""
    checker = item.stash.get(_CHECKER, None)
    if checker is not None:
        return checker
    marker = item.get_closest_marker(_MARKER)
    if not wanted and marker is None and "tensor_leak_check" not in getattr(item, "fixturenames", ()):
        return None
    kwargs = _marker_kwargs(marker, _MARKER, _ALLOWED)
    from ppbackward.leaks import check_tensor_leaks

    if "output_dir" not in kwargs:  # Note [graph files under pytest's temporary folder]
        factory = getattr(item.config, "_tmp_path_factory", None)
        if factory is not None:
            digest = hashlib.sha1(item.nodeid.encode()).hexdigest()[:8]  # ids that differ only in what _ replaces
            name = re.sub(r"[^\w.-]+", "_", item.nodeid)[-100:] + "-" + digest  # the test's name, not its path
            try:
                kwargs["output_dir"] = factory.getbasetemp() / "ppbackward-leaks" / name
            except OSError:  # a --basetemp that cannot be made: the checker's own folder, made only on a leak
                pass
    try:
        checker = check_tensor_leaks(strict=False, **kwargs)
    except (TypeError, ValueError) as e:  # a marker argument of the wrong type or value
        pytest.fail(f"@pytest.mark.{_MARKER}: {e}", pytrace=False)
    item.stash[_CHECKER] = checker
    return checker


# Note [graph files under pytest's temporary folder]: without an ``output_dir``, a leaking test's graph files
# go under pytest's base temporary folder (the one ``tmp_path`` lives in: ``--basetemp``, else pytest's own,
# of which it keeps the last three sessions), in ``ppbackward-leaks/<the test's node id>-<its hash>``, created
# only when something leaked; a bare ``check_tensor_leaks`` makes a ``tempfile.mkdtemp()`` folder that nothing
# removes.
# pytest offers the folder to hooks only through ``config._tmp_path_factory`` (what its ``tmp_path_factory``
# fixture returns); without it the checker's default stands.


@pytest.fixture
def tensor_leak_check(request: pytest.FixtureRequest) -> Any:
    """Check the test's call for leaked tensors and autograd nodes, like ``@pytest.mark.no_tensor_leaks``.

    Returns:
        The :class:`ppbackward.leaks.LeakReport` of the test call; it is filled after the call
        returns (so a test body sees it empty). Arguments come from a ``no_tensor_leaks`` marker
        when the test also has one.
    """
    if request.node.stash.get(_CALLED, False):
        raise RuntimeError(
            f"{request.node.nodeid}: tensor_leak_check was requested inside the test's call (getfixturevalue): the "
            "call is checked from its start, so request it as an argument, a fixture's argument or with usefixtures"
        )
    checker = _checker_for(request.node, wanted=True)
    return checker.fresh_report()  # the same test run again (a rerun plugin): this run's report, not the last one's


# Note [an earlier failure is not this test's garbage]: pytest keeps the last failing test's exception in
# ``sys.last_type``/``last_value``/``last_traceback`` (and ``sys.last_exc``, Python 3.12+), for post-mortem
# debugging, and deletes them at the start of the next test's call, inside this wrapper's block: the
# traceback's cycles (its frames, pytest's ``ExceptionInfo`` and traceback entries) became garbage of the
# checked test, which failed for an earlier test's failure. So they are deleted here, before the checker arms
# and collects; pytest then finds nothing to delete.
def _forget_the_last_failure() -> None:
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)


def _tracker_for(item: pytest.Item) -> Any:
    """A (not yet entered) activation tracker for ``item`` if it has the ``no_activations_held`` marker."""
    marker = item.get_closest_marker(_HELD_MARKER)
    if marker is None:
        return None
    kwargs = _marker_kwargs(marker, _HELD_MARKER, _HELD_ALLOWED)
    for key, value in kwargs.items():
        if not isinstance(value, bool):
            got = type(value).__name__
            pytest.fail(f"@pytest.mark.{_HELD_MARKER}: {key} must be a bool, got {got}", pytrace=False)
    from ppbackward.leaks import track_activations

    return track_activations(**kwargs)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A new run of the test (a rerun too): its call has not begun."""
    item.stash[_CALLED] = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, None]:
    """Run the test call inside the checker and the tracker, and turn a leak or a held activation into a
    test failure."""
    tracker = _tracker_for(item)
    checker = _checker_for(item)
    item.stash[_CALLED] = True
    if checker is None and tracker is None:
        yield
        return
    _forget_the_last_failure()  # Note [an earlier failure is not this test's garbage]
    if checker is not None:
        checker.run_warmup()  # outside the tracker too: a one-time cache is no activation held either
    if tracker is not None:
        tracker.__enter__()
    try:
        report = checker.__enter__() if checker is not None else None
    except BaseException:  # a checker that cannot arm: the tracker's saved-tensor hooks must not stay installed
        if tracker is not None:
            tracker.__exit__(None, None, None)
        raise
    outcome = None
    try:
        outcome = yield
    finally:
        excinfo = outcome.excinfo if outcome is not None else None
        exc = excinfo[1] if excinfo is not None and isinstance(excinfo[1], Exception) else None
        try:
            if checker is not None:
                checker.__exit__(type(exc) if exc is not None else None, exc, None)
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
    if outcome is None or outcome.excinfo is not None:
        return
    messages = []
    if report is not None and not report.ok:
        messages.append(
            f"{item.nodeid} leaked into reference cycles (checked by ppbackward's "
            f"{_MARKER} / tensor_leak_check):\n{report.format()}"
        )
    if tracker is not None:
        # after a full collection: held by a live reference (a cycle is freed by it, the checker's finding)
        try:
            held = tracker.report()
            if held.held_after_gc or held.nodes_held_after_gc or held.packed_held_after_gc:
                messages.append(
                    f"{item.nodeid} kept activations or autograd nodes alive after its call (checked by "
                    f"ppbackward's {_HELD_MARKER}):\n{held.format()}"
                )
            del held
        except Exception as e:  # the checker's report, if any, is still shown
            messages.append(f"{item.nodeid}: ppbackward's {_HELD_MARKER} could not report: {type(e).__name__}: {e}")
    if not messages:
        return
    message = "\n\n".join(messages)
    failure = pytest.fail.Exception(message, pytrace=False)
    force = getattr(outcome, "force_exception", None)
    if force is not None:  # pluggy >= 1.1
        force(failure)
    else:  # pragma: no cover - older pluggy lets a wrapper raise
        raise failure
