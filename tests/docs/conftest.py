"""``tests/docs``: the documentation's commands and code blocks, run as a user runs them."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _heap_frozen():
    """The docs run users' code as users run it, on the whole heap: nothing frozen (Note [frozen heap] in
    tests/conftest.py)."""
    yield
