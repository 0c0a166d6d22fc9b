"""The leak tools' heap scans beside other threads (Note [heap scans beside other threads] in
``ppbackward.leaks._heap``).

CPython tracks a tuple before its items are set; a scan that holds it while its builder resumes makes the
builder fail with ``SystemError: ... bad argument to internal function``. Each race test runs a naive scan
first, as the negative control that must make the builder fail, in a child process of its own (Note [the naive
control in a child process] in ``tests/leaks/naive_scan.py``: here it would break the suite's other threads too),
then ppbackward's scans, here, which must not. Interleaving is forced by events and the smallest switch
interval, not by time: the main thread scans only after the builder finished another tuple.
"""

from __future__ import annotations

import ast
import gc
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ppbackward.leaks import track_activations
from ppbackward.leaks._heap import instances_of, referrers_of
from tests.leaks.heap_race import POPULATION, Marker, scan_beside_builder


@pytest.fixture(scope="module", autouse=True)
def _heap_frozen():
    """The scans' reference counts are about the whole heap: nothing frozen (Note [frozen heap] in
    tests/conftest.py); the race tests freeze for themselves (Note [a race needs a long scan])."""
    yield


# Note [a race needs a long scan]: a naive scan breaks the builder when the interpreter switches to it while the scan's
# list is alive, so what the race needs is a scan long enough for switches (the smallest switch interval), not the
# whole heap; each scan of ours, though, costs a pass over the whole heap (referrers_of one more per tuple it keeps),
# and in the suite's heap (300k-600k objects by then) the test took 30-90 s, and its run time followed what ran before
# it. So the race tests freeze the heap (the `heap_frozen` fixture) and scan a population of their own of a known size,
# heap_race.POPULATION, as the naive control's child does over the same number of objects.


@pytest.fixture
def population(heap_frozen):
    """POPULATION objects for the scans to pass over, the heap before the test frozen (Note [a race needs a long
    scan])."""
    return [[i] for i in range(POPULATION)]


# Scans of ppbackward's that must leave the builder unharmed: ten times as many as the naive scan took to break it, at
# least this many. In its child (a fresh interpreter, the same population size) it broke within 1-9 scans in 11 tries
# on Python 3.11 (2026-12-04), as within 1-8 in the suite's heap when it ran in-process: a scan of ours as hazardous as
# the naive one would survive with a chance of about e^-10, the two processes' conditions taken as alike.
_SCANS = 20
_ROOT = Path(__file__).resolve().parents[2]


def _naive_control(name: str) -> dict[str, Any]:
    """The naive scan ``name`` beside a builder, in a child process (Note [the naive control in a child process] in
    ``tests/leaks/naive_scan.py``): ``{"error": "SystemError" or None, "message", "scans", "population"}``."""
    done = subprocess.run(  # timeout: a hang guard under pytest's own 300 s, so that the child's stderr shows
        [sys.executable, "-m", "tests.leaks.naive_scan", name], cwd=_ROOT, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    ("naive", "ours"),
    [("get_objects", lambda: instances_of(Marker)), ("get_referrers", lambda: referrers_of(Marker))],
    ids=["get_objects", "get_referrers"],
)
def test_a_scan_beside_a_thread_building_tuples_leaves_that_thread_unharmed(naive, ours, population):
    keep = [Marker() for _ in range(3)]
    control = _naive_control(naive)
    assert control["error"] == "SystemError", f"the negative control: a naive scan breaks the builder ({control})"
    assert "bad argument to internal function" in control["message"]
    assert control["population"] == POPULATION
    times = max(_SCANS, 10 * control["scans"])
    builder = scan_beside_builder(ours, times)
    assert builder.error is None
    assert builder.scans == times and builder.built >= times
    assert len(instances_of(Marker)) == len(keep) == 3


def test_the_tracker_report_and_its_holder_chains_beside_a_thread_building_tuples():
    """``report()`` scans for the block's live tensors and searches what holds them: the two scans
    that broke the suite's background thread (issue 39)."""
    w = torch.randn(4, requires_grad=True)
    kept: list[torch.Tensor] = []
    with track_activations() as tracker:
        kept.append((w * 2).exp().sum())

    def report() -> None:
        rep = tracker.report()
        assert len(rep.held_by) == 1

    builder = scan_beside_builder(report, 8)
    assert builder.error is None and builder.built >= 8


def test_a_tuple_under_construction_is_never_handed_out():
    """Deterministic, one thread: the scan runs inside ``tuple(generator)`` while the tuple holds the
    marker; keeping what the scan returned past the tuple's next resize must not break it."""
    marker = Marker()
    kept: list[list[Any]] = []

    def items(scan: Callable[[Any], list[Any]]) -> Iterator[Any]:
        yield marker
        kept.append(scan(marker))  # kept until after the tuple grows (20 more items) and is cut back
        yield from range(20)

    with pytest.raises(SystemError, match="bad argument to internal function"):
        tuple(items(gc.get_referrers))  # the negative control
    kept.clear()
    built = tuple(items(referrers_of))
    assert len(built) == 21 and not any(type(r) is tuple for r in kept[0])


def test_referrers_keep_tuples_something_holds_and_instances_are_exact():
    marker = Marker()
    holder = {"pair": (marker, 1)}  # a tuple whose one holder is a dict: kept
    assert [r for r in referrers_of(marker) if type(r) is tuple] == [holder["pair"]]
    before = len(instances_of(Marker))
    more = [Marker(), Marker()]
    assert len(instances_of(Marker)) == before + len(more)
    del more
    assert len(instances_of(Marker)) == before


@pytest.mark.parametrize("cls", [object, tuple, torch.autograd.graph.Node])
def test_instances_of_refuses_classes_it_cannot_scan_safely(cls):
    with pytest.raises(TypeError, match="instances_of"):
        instances_of(cls)


def test_a_chain_to_a_local_variable_says_so():
    """A tensor held by a list local to a running function: on Python 3.13+ the chain ends at that
    function's frame; before, nothing the gc sees holds the list, and the chain's last line says so."""
    w = torch.randn(4, requires_grad=True)
    local_list: list[torch.Tensor] = []
    with track_activations() as tracker:
        local_list.append((w * 2).exp().sum())
    (chain,) = tracker.report().held_by
    lines = chain.splitlines()
    assert lines[1] == "  <- [1] list (len 1) via [0]"
    if sys.version_info >= (3, 13):
        assert "frame of test_a_chain_to_a_local_variable_says_so" in lines[2]
        assert "via .f_locals['local_list']" in lines[2]
    else:
        assert lines[2] == (
            "  (nothing the gc sees refers to [1]: C code holds it (an autograd node's hooks or saved tensors, an "
            "extension), or a local variable of a running function (those are searched on Python 3.13+))"
        )
    local_list.clear()
    assert tracker.report().held_by == []  # the report itself kept nothing alive


class _Holder:
    """A plain object holding the next one (each instance ``__dict__`` is folded into it: one step)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner


def test_a_chain_through_nested_objects_reaches_its_module_and_a_cut_search_says_so():
    """A hook's closure on a parameter of a module inside containers (a newcomer's ``nn.Sequential`` held by a
    module attribute): the chain reaches the module however many instance ``__dict__``s it passes, since each
    is folded into its object in the depth as in the printout; a search stopped at ``max_depth`` shows how far
    it got and says it stopped (it printed the tensor alone, with no last line)."""
    from ppbackward.leaks._chains import format_holders, holder_chain

    held = torch.randn(2)
    nested: object = [held]
    for _ in range(8):  # 8 objects, 8 dicts: 17 references, 9 steps
        nested = _Holder(nested)
    globals()["_NESTED_HOLDER"] = nested
    try:
        lines = format_holders(holder_chain(held)).splitlines()
        assert lines[-1].endswith(f"module {__name__} via ._NESTED_HOLDER") and len(lines) == 11
        lines = format_holders(holder_chain(held, max_depth=4)).splitlines()
        assert len(lines) == 6 and "_Holder object via .inner" in lines[-2]
        assert lines[-1] == (
            "  (the search stopped 4 steps from [0] without reaching a module or a running function; the chain "
            "shows how far it got)"
        )
    finally:
        del globals()["_NESTED_HOLDER"]


def test_a_chain_is_the_shortest_in_printed_steps_and_a_cut_search_says_so_where_paths_meet():
    """A reviewer's two: a holder reached through an object (its ``__dict__`` folded: one step) is found before
    a deeper path through lists (the search stays in order of printed steps), also at a ``max_depth`` that
    leaves no step to spare; and a search cut at ``max_depth`` says so where two paths meet (a tensor in two
    lists of one object), not only where every path runs on alone."""
    from ppbackward.leaks._chains import format_holders, holder_chain

    held = torch.randn(2)
    for order in ("lists first", "object first"):
        near = _Holder(held)  # held <- near: one step
        far = [[held]]  # held <- [.] <- [.]: two steps
        globals()["_NESTED_HOLDER"] = _Holder(far) if order == "lists first" else _Holder(near)
        globals()["_NESTED_HOLDER"].other = near if order == "lists first" else far
        try:
            for depth in (12, 3):
                lines = format_holders(holder_chain(held, max_depth=depth)).splitlines()
                assert len(lines) == 4 and lines[-1].endswith(f"module {__name__} via ._NESTED_HOLDER"), (order, lines)
        finally:
            del globals()["_NESTED_HOLDER"]
    del near, far  # a running function's locals are out of the search's sight before Python 3.13
    nested: object = _Holder([held])
    nested.other = [held]  # two paths from the tensor meet here
    for _ in range(6):
        nested = _Holder(nested)
    globals()["_NESTED_HOLDER"] = nested
    del nested
    try:
        lines = format_holders(holder_chain(held, max_depth=4)).splitlines()
        assert lines[-1].startswith("  (the search stopped 4 steps from [0]") and len(lines) == 6, lines
    finally:
        del globals()["_NESTED_HOLDER"]


class _SlotAndDict:
    __slots__ = ("__dict__", "a")


class _DictProperty:
    """A class whose ``__dict__`` is a property: user code the holder search must not run."""

    __slots__ = ("d",)
    reads = 0

    @property
    def __dict__(self):
        type(self).reads += 1
        raise RuntimeError("the search ran a __dict__ property")


def test_a_chain_takes_the_folded_step_met_after_a_deeper_one_and_runs_no_dict_property():
    """A re-reviewer's: an object holding the tensor in its ``__dict__`` (one step) and through a slot's list
    (two), met first through the list, is moved up to one step (the search printed the longer chain, and at
    ``max_depth=2`` said it stopped); a class's ``__dict__`` property is never called (it was, once per
    referrer checked)."""
    from ppbackward.leaks._chains import format_holders, holder_chain

    held = torch.randn(2)
    for order in ("slot first", "dict first"):
        x = _SlotAndDict()
        if order == "slot first":
            x.a = [held]
            x.b = held
        else:
            x.b = held
            x.a = [held]
        globals()["_NESTED_HOLDER"] = x
        del x
        try:
            for depth in (12, 2):
                lines = format_holders(holder_chain(held, max_depth=depth)).splitlines()
                assert lines[1:] == [
                    "  <- [1] tests.leaks.test_heap._SlotAndDict object via .b",
                    f"  <- [2] module {__name__} via ._NESTED_HOLDER",
                ], (order, depth, lines)
        finally:
            del globals()["_NESTED_HOLDER"]
    p = _DictProperty()
    p.d = {"k": held}
    globals()["_NESTED_HOLDER"] = p
    del p
    try:
        lines = format_holders(holder_chain(held)).splitlines()
        assert lines[-1] == f"  <- [3] module {__name__} via ._NESTED_HOLDER" and _DictProperty.reads == 0
    finally:
        del globals()["_NESTED_HOLDER"]


def test_a_chain_to_a_frozen_holder_says_gc_freeze_may_hide_it():
    """``gc.freeze()`` moves every object alive to a generation ``gc.get_referrers`` does not search: a tensor
    made after it but held by an object frozen before it has a holder out of sight, and the chain's last line
    names that possibility."""
    w = torch.randn(4, requires_grad=True)
    holder = Marker()
    with track_activations() as tracker:
        holder.kept = (w * 2).exp().sum()
    (chain,) = tracker.report().held_by  # the negative control: the heap whole, the holder seen
    assert "Marker object via .kept" in chain and "gc.freeze()" not in chain
    gc.freeze()  # the holder (and its __dict__) out of sight
    try:
        with track_activations() as tracker:
            holder.kept = (w * 3).exp().sum()
        (chain,) = tracker.report().held_by
        assert "Marker" not in chain
        # the count as the report read it: frozen objects that die meanwhile leave the frozen set
        last = chain.splitlines()[-1]
        assert re.search(r"; or one of the \d+ objects gc\.freeze\(\) put out of the gc's sight\)$", last), last
    finally:
        gc.unfreeze()
    del holder


def _bare_heap_scans(path: Path) -> list[str]:
    """``file:line`` of every reference to ``gc.get_objects`` / ``gc.get_referrers`` in ``path``: a call,
    a ``map(gc.get_referrers, ...)``, ``from gc import get_objects``, through any name ``gc`` is bound to."""
    scans = ("get_objects", "get_referrers")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    gc_names = {"gc"} | {
        alias.asname for node in ast.walk(tree) if isinstance(node, ast.Import)
        for alias in node.names if alias.name == "gc" and alias.asname
    }
    found = []
    for node in ast.walk(tree):
        attribute = (
            isinstance(node, ast.Attribute) and node.attr in scans
            and isinstance(node.value, ast.Name) and node.value.id in gc_names
        )
        imported = (
            isinstance(node, ast.ImportFrom) and node.module == "gc" and any(a.name in scans for a in node.names)
        )
        if attribute or imported:
            found.append(f"{path}:{getattr(node, 'lineno', '?')}")
    return found


def _imports_naive_scan(path: Path) -> bool:
    """Whether ``path`` imports ``tests.leaks.naive_scan`` (whose naive scans must run in a child process only)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
        module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
        if any("naive_scan" in n for n in [module, *names]):
            return True
    return False


def test_no_heap_scan_outside_the_safe_one(tmp_path):
    """The suite's background thread and a user's threads break on any scan that keeps its list while
    Python runs; so the project's code scans only through ``_heap``, the naive controls only in their child script
    (never imported), and this module only in its one-thread control, which keeps referrers of a private marker."""
    allowed = {_ROOT / "src/ppbackward/leaks/_heap.py", _ROOT / "tests/leaks/naive_scan.py"}
    files = [p for d in ("src", "tests", "scripts", "benchmarks") for p in sorted((_ROOT / d).rglob("*.py"))]
    assert len(files) > 100
    this = Path(__file__).resolve()
    lines = this.read_text(encoding="utf-8").splitlines()
    control = lines.index("        tuple(items(gc.get_referrers))  # the negative control")
    assert [hit for p in files if p not in allowed for hit in _bare_heap_scans(p)] == [f"{this}:{control + 1}"]
    assert [p for p in files if _imports_naive_scan(p)] == []
    planted = tmp_path / "planted.py"  # negative controls: the finder sees each spelling of a bare scan
    planted.write_text(
        "import gc\nimport gc as g\nfrom gc import get_referrers\nfor o in gc.get_objects():\n    pass\n"
        "refs = list(map(g.get_referrers, [1]))\n",
        encoding="utf-8",
    )
    assert _bare_heap_scans(planted) == [f"{planted}:3", f"{planted}:4", f"{planted}:6"]
    imports = ("from tests.leaks import naive_scan", "import tests.leaks.naive_scan", "from .naive_scan import _main")
    for spelling in imports:
        planted.write_text(spelling + "\n", encoding="utf-8")
        assert _imports_naive_scan(planted), spelling


def test_the_scans_own_references_are_measured_right_while_collections_run(monkeypatch):
    """The calibration of ``referrers_of`` with a collection at every allocation: it measures what it
    measures with the collector at rest, or refuses; it never keeps a threshold that hands out tuples."""
    from ppbackward.leaks import _heap

    monkeypatch.setattr(_heap, "_threshold", None)
    at_rest = _heap._tuple_threshold()
    previous = gc.get_threshold()
    try:
        for _ in range(2):
            monkeypatch.setattr(_heap, "_threshold", None)
            gc.set_threshold(1)
            measured = _heap._tuple_threshold()
            gc.set_threshold(*previous)
            assert measured == at_rest >= 2
    finally:
        gc.set_threshold(*previous)


def test_a_chain_that_ends_in_a_cycle_does_not_claim_nothing_holds_it():
    w = torch.randn(4, requires_grad=True)
    ring: list[Any] = []
    with track_activations() as tracker:
        ring.append((w * 2).exp().sum())
    ring.append(ring)  # the list holds itself: a referrer the search has met, not "nothing"
    (chain,) = tracker.report().held_by
    assert "nothing the gc sees refers to" not in chain
    ring.clear()
