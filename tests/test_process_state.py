"""The suite's own guard: each test leaves the process as it found it (Note [each test leaves the process as it
found it] in tests/conftest.py), run on a small inner session (pytester)."""

from __future__ import annotations

import gc

import pytest

import ppbackward

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module", autouse=True)
def _imports_in_place():
    """What ``install()`` and ``uninstall()`` import, imported before the inner sessions: pytester drops the modules
    an inner session imports, and torch registers its operators and cache artifacts once per process."""
    ppbackward.install()
    ppbackward.uninstall()

_GUARD = "from tests.conftest import _process_state_kept  # noqa: F401\n"
_TESTS = """
import gc
import ppbackward

def test_switches_gc_off_and_installs():
    gc.disable()
    ppbackward.install()

def test_after_it():
    assert gc.isenabled() and not ppbackward.is_installed()
"""


def _run(pytester: pytest.Pytester) -> pytest.RunResult:
    try:
        return pytester.runpytest("-p", "no:cacheprovider", "-q")
    finally:  # the negative control leaves them changed: not this test's to leave
        gc.enable()
        if ppbackward.is_installed():
            ppbackward.uninstall()


def test_a_test_that_changes_the_process_is_named_and_the_next_starts_as_expected(pytester):
    pytester.makeconftest(_GUARD)
    pytester.makepyfile(test_inner=_TESTS)
    result = _run(pytester)
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines([
        "*ProcessStateChanged: test_inner.py::test_switches_gc_off_and_installs changed the process*put back: "
        "the automatic gc (switched on): True -> False;*ppbackward installed into torch: False -> True*"
    ])


def test_a_change_between_tests_is_named_and_put_back(pytester):
    """A module fixture's teardown runs after its module's last test: the next module's first test is told."""
    pytester.makeconftest(_GUARD)
    pytester.makepyfile(
        test_a="""
import gc
import pytest

@pytest.fixture(scope="module", autouse=True)
def leaves_gc_off():
    yield
    gc.disable()

def test_a():
    pass
""",
        test_b="""
import gc

def test_b():
    assert gc.isenabled()
""",
    )
    result = _run(pytester)
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(["*what ran between test_a.py::test_a and test_b.py::test_b*True -> False*"])


def test_negative_control_without_the_guard_the_next_test_inherits_the_change(pytester):
    pytester.makepyfile(test_inner=_TESTS)
    result = _run(pytester)
    result.assert_outcomes(passed=1, failed=1)
