"""``check_tensor_leaks``: what it counts, what it always restores, and what it never keeps alive.

Single-process, CPU, tiny tensors; the negative controls of the issue live in test_leaks_controls.py.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import threading
import weakref
from contextlib import ExitStack

import pytest
import torch

from ppbackward.leaks import LeakReport, TensorLeakError, _gc_phase, check_tensor_leaks
from tests.leaks.gc_threads import another_thread_collecting
from tests.leaks.odd_tensors import DeclinesStorageReads, UnreadableGradFn


def _make_cycle(n: int = 4) -> weakref.ref:
    """Leave one float32 tensor of ``n`` elements in a dict that refers to itself."""
    t = torch.ones(n)
    box: dict = {"t": t}
    box["self"] = box
    return weakref.ref(t.untyped_storage())


def _clean_work() -> None:
    (torch.ones(4, requires_grad=True) * 2).sum().backward()


def test_clean_block_reports_exactly_zero_and_touches_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    garbage_before = list(gc.garbage)
    with check_tensor_leaks() as report:
        _clean_work()
    assert isinstance(report, LeakReport)
    assert report.done and report.ok and not report.body_raised
    assert (report.num_tensors, report.num_nodes, report.tensor_bytes, report.num_storages) == (0, 0, 0, 0)
    assert report.num_garbage == 0 and report.garbage_types == {}
    assert report.chains == [] and report.dot_paths == [] and report.png_paths == []
    assert report.output_dir is None
    assert gc.garbage == garbage_before
    assert os.listdir(tmp_path) == []


def test_leak_is_counted_with_chain_and_graph_in_a_temp_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with check_tensor_leaks(strict=False) as report:
        _make_cycle(10)
    assert report.done and not report.ok
    assert (report.num_tensors, report.num_nodes, report.tensor_bytes, report.num_storages) == (1, 0, 40, 1)
    assert report.num_garbage == 2 and report.garbage_types == {"Tensor": 1, "dict": 1}
    assert len(report.chains) == 1
    assert report.chains[0].splitlines() == [
        "[0] Tensor float32[10] on cpu, 40 bytes",
        "  <- [1] dict with 2 key(s) ['t', 'self'] via ['t']",
        "  (reference cycle: [1] is held by [1] via ['self'])",
    ]
    assert len(report.dot_paths) == 1 and report.dot_paths[0].endswith("leak-1.dot")
    assert os.path.dirname(report.dot_paths[0]) == report.output_dir
    assert not report.output_dir.startswith(str(tmp_path))
    assert os.listdir(tmp_path) == []  # never the working directory
    with open(report.dot_paths[0], encoding="utf-8") as f:
        assert f.read().startswith("digraph ObjectGraph")
    assert report.png_paths == ([] if shutil.which("dot") is None else [report.dot_paths[0][:-4] + ".png"])
    text = report.format()
    assert "1 tensor(s) and 0 autograd node(s)" in text and "40 bytes in 1 unique storage(s)" in text
    json.dumps(report.to_dict())
    assert report.to_dict()["ok"] is False
    shutil.rmtree(report.output_dir)


def test_a_leaked_tensor_whose_grad_fn_cannot_be_read_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = torch.zeros(2).as_subclass(UnreadableGradFn)
    with pytest.raises(RuntimeError, match="undefined tensor"):
        t.grad_fn  # noqa: B018  # what the checker meets in gc.garbage
    with check_tensor_leaks(strict=False) as report:
        box: list = [t]
        box.append(box)
        del t, box
    assert (report.num_tensors, report.tensor_bytes) == (1, 8)
    assert report.chains[0].splitlines()[0] == "[0] UnreadableGradFn float32[2] on cpu, 8 bytes"
    shutil.rmtree(report.output_dir)


def test_a_subclass_declining_the_storage_reads_is_counted_by_its_own_bytes():
    """The bytes are counted with subclasses' ``__torch_function__`` off: one that returns ``NotImplemented`` for
    ``layout`` made the checker raise ``TypeError`` instead of reporting (hostile tester)."""
    t = torch.ones(3).as_subclass(DeclinesStorageReads)
    with pytest.raises(TypeError):
        t.layout  # noqa: B018  # what the checker met
    with check_tensor_leaks(strict=False) as report:
        box: dict = {"t": t * 2}
        box["self"] = box
        del box
    assert (report.num_tensors, report.tensor_bytes) == (1, 12)
    assert report.chains[0].splitlines()[0] == "[0] DeclinesStorageReads float32[3] on cpu, 12 bytes"
    shutil.rmtree(report.output_dir)


class _Holder:
    pass


class _Slotted:
    __slots__ = ("me", "out")


@pytest.mark.parametrize("cls", [_Holder, _Slotted], ids=["plain-object", "slots"])
def test_chain_names_the_attribute_of_a_plain_object(cls):
    # Python 3.11+ keeps a plain object's attributes inline (no __dict__ between object and value)
    with check_tensor_leaks(strict=False, max_chains=1) as report:
        holder = cls()
        holder.out = torch.ones(3)
        holder.me = holder
        del holder
    assert report.num_tensors == 1
    assert report.chains[0].splitlines() == [
        "[0] Tensor float32[3] on cpu, 12 bytes",
        f"  <- [1] {__name__}.{cls.__qualname__} object via .out",
        "  (reference cycle: [1] is held by [1] via .me)",
    ]
    shutil.rmtree(report.output_dir)


def test_weakref_proxies_in_the_garbage_are_neither_counted_nor_fatal():
    """A proxy answers isinstance() for its referent (and raises once that is gone): torch.compile's first
    call leaves such proxies in cyclic garbage."""

    class Box:
        pass

    with check_tensor_leaks(strict=False) as report:
        dead, alive = Box(), torch.ones(2)
        box: dict = {"dead": weakref.proxy(dead), "alive": weakref.proxy(alive)}
        box["self"] = box
        del dead, box
    assert report.done and report.ok and report.num_tensors == 0
    assert report.garbage_types.get("ProxyType") == 2
    del alive


def test_strict_raises_with_the_report():
    with pytest.raises(TensorLeakError) as info, check_tensor_leaks():
        _make_cycle()
    report = info.value.report
    assert (report.num_tensors, report.tensor_bytes) == (1, 16)
    assert str(info.value) == report.format()
    shutil.rmtree(report.output_dir)


def test_checker_frees_what_it_caught_and_a_clean_block_after_reports_zero():
    with check_tensor_leaks(strict=False, max_chains=0) as first:
        storage = _make_cycle()
    assert first.num_tensors == 1 and first.output_dir is None  # max_chains=0: no files
    assert storage() is None  # freed on exit: not kept in gc.garbage (torch's helper keeps it)
    with check_tensor_leaks() as second:
        _clean_work()
    assert second.ok and second.num_garbage == 0


def test_a_checker_entered_again_reports_on_the_new_block_only(tmp_path):
    checker = check_tensor_leaks(strict=False, output_dir=tmp_path)
    with checker as first:
        _make_cycle(4)
    with checker as second:
        _clean_work()
    assert second is not first and second.ok and second.chains == [] and second.dot_paths == []
    with checker as third:
        _make_cycle(8)
    assert third.num_tensors == 1 and len(third.chains) == 1 and "float32[8]" in third.chains[0]
    assert first.num_tensors == 1 and "float32[4]" in first.chains[0]  # the first report is unchanged


@pytest.mark.parametrize(("debug", "enabled"), [(0, True), (gc.DEBUG_UNCOLLECTABLE, False)])
def test_gc_state_is_restored_even_when_the_body_raises(debug, enabled):
    old_debug, old_enabled = gc.get_debug(), gc.isenabled()
    gc.set_debug(debug)
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(KeyError), check_tensor_leaks():
            gc.disable() if enabled else gc.enable()  # the body may flip it; it is put back
            raise KeyError("boom")
        assert gc.get_debug() == debug and gc.isenabled() is enabled
        with check_tensor_leaks(strict=False, max_chains=0):
            _make_cycle()
        assert gc.get_debug() == debug and gc.isenabled() is enabled
    finally:
        gc.set_debug(old_debug)
        (gc.enable if old_enabled else gc.disable)()


@pytest.mark.parametrize("collect_inside", [False, True], ids=["collected-on-exit", "collected-in-the-block"])
def test_a_block_that_clears_the_gc_debug_flags_still_has_its_leak_caught(collect_inside):
    """Note [checker survives the block's gc flags]: ``gc.set_debug(0)`` inside the block used to switch
    ``DEBUG_SAVEALL`` off, so the leaked cycle was freed unseen and the report said ``ok``."""
    old_debug = gc.get_debug()
    gc.set_debug(gc.DEBUG_UNCOLLECTABLE)  # the caller's flags, to be restored on exit
    try:
        with check_tensor_leaks(strict=False, max_chains=0) as report:
            gc.set_debug(0)
            _make_cycle()
            if collect_inside:
                _gc_phase.full_collect()
                assert gc.get_debug() == 0  # the block's own flags are back after each collection
        assert report.num_tensors == 1 and not report.ok
        assert gc.get_debug() == gc.DEBUG_UNCOLLECTABLE
        with check_tensor_leaks(strict=False, max_chains=0) as clean:  # negative control
            gc.set_debug(0)
            _clean_work()
            _gc_phase.full_collect()
        assert clean.ok and clean.num_tensors == 0 and clean.num_garbage == 0
        assert gc.get_debug() == gc.DEBUG_UNCOLLECTABLE
    finally:
        gc.set_debug(old_debug)


def _cycle_found_while_its_tensor_lives_elsewhere() -> int:
    """A cycle holding a tensor becomes garbage while the tensor is still referenced elsewhere; tracked
    allocations follow (at threshold 1: automatic collections, if the collector is on); then the other
    reference goes. Returns how many collections started between the two."""
    started = []

    def count(phase: str, _info: dict) -> None:
        if phase == "start":
            started.append(1)

    t = torch.ones(4)
    box: list = [t]
    box.append(box)
    del box
    gc.callbacks.append(count)
    try:
        kept: list[list] = [[] for _ in range(200)]  # tracked and alive: they count towards the young generation
        del kept
    finally:
        gc.callbacks.remove(count)
    del t
    return len(started)


def test_a_cycle_found_mid_block_still_counts_the_tensor_it_holds(monkeypatch):
    """Note [one collection decides]: an automatic collection inside the block saved the cycle without its
    tensor (alive elsewhere then, alive through gc.garbage after), and the block reported no tensor. The
    checker pauses the automatic collector while armed; the negative control takes the pause out (and
    checks that a collection did start inside its block)."""
    old = gc.get_threshold()
    gc.set_threshold(1)
    try:
        with check_tensor_leaks(strict=False, max_chains=0) as report:
            paused_runs = _cycle_found_while_its_tensor_lives_elsewhere()
        with monkeypatch.context() as m:  # negative control: without the pause the tensor goes uncounted
            m.setattr("ppbackward.leaks._checker.automatic_gc_paused", lambda always: ExitStack())
            with check_tensor_leaks(strict=False, max_chains=0) as unpaused:
                unpaused_runs = _cycle_found_while_its_tensor_lives_elsewhere()
    finally:
        gc.set_threshold(*old)
    assert paused_runs == 0 and report.num_tensors == 1 and not report.ok, (paused_runs, report.format())
    assert unpaused_runs > 0, "the negative control's block ran no automatic collection"
    assert unpaused.num_tensors == 0 and unpaused.num_garbage >= 1, unpaused.format()
    assert gc.isenabled()


def test_the_pause_holds_across_nested_checkers_and_a_tracker_s_report():
    """Note [one collection decides]: an inner checker's exit, or a tracker's report inside the block, used to
    switch the collector back on (a plain ``gc.enable()``) while the outer checker was still armed."""
    from ppbackward.leaks import track_activations

    assert gc.isenabled()
    with check_tensor_leaks(strict=False, max_chains=0) as outer:
        with check_tensor_leaks(strict=False, max_chains=0):
            _clean_work()
        assert not gc.isenabled()  # the outer pause holds
        with track_activations() as tracker:
            _clean_work()
        tracker.report()
        assert not gc.isenabled()
        _make_cycle()
    assert gc.isenabled() and outer.num_tensors == 1


def test_plain_gc_collect_does_nothing_while_another_thread_collects():
    """The CPython behaviour behind Note [a collection that surely ran] (the control of the next test)."""
    with another_thread_collecting():
        storage = _make_cycle()
        assert gc.collect() == 0 and storage() is not None  # nothing collected
    _gc_phase.full_collect()
    assert storage() is None


def test_a_leak_is_caught_while_another_thread_collects(monkeypatch):
    """CI once reported a leaky block clean: a background thread was collecting when the checker
    exited, so its gc.collect() returned 0 unseen. The checker now retries until its own collection ran."""
    retries = []
    with ExitStack() as other_thread:  # still collecting when the checker below exits
        with check_tensor_leaks(strict=False, max_chains=0) as report:
            release = other_thread.enter_context(another_thread_collecting())

            def _release_then_yield() -> None:
                retries.append(1)
                release.set()
                threading.Event().wait(0.001)

            monkeypatch.setattr(_gc_phase, "_yield_gil", _release_then_yield)
            _make_cycle(4)
    assert (report.num_tensors, report.num_nodes, report.tensor_bytes, report.num_storages) == (1, 0, 16, 1)
    assert not report.ok and retries  # the retry ran: the other thread was still collecting at exit


def test_full_collect_names_a_collection_that_never_ends_and_leaves_gc_callbacks_alone(monkeypatch):
    callbacks = list(gc.callbacks)
    with another_thread_collecting():
        monkeypatch.setattr(_gc_phase, "_FULL_COLLECT_TIMEOUT_S", 0.0)  # once the helper is inside its own
        storage = _make_cycle()
        with pytest.raises(RuntimeError, match="could not start a collection for 0 s: another thread's"):
            _gc_phase.full_collect()
        assert gc.callbacks == callbacks and storage() is not None
    monkeypatch.undo()
    assert _gc_phase.full_collect() >= 1 and storage() is None
    assert gc.callbacks == callbacks


def test_full_collect_from_a_finaliser_of_its_own_collection_is_refused_at_once():
    errors: list[BaseException] = []

    class _CollectsInDel:
        def __del__(self) -> None:
            try:
                _gc_phase.full_collect()
            except RuntimeError as e:
                errors.append(e)

    obj = _CollectsInDel()
    obj.self = obj
    del obj
    _gc_phase.full_collect()
    assert [str(e) for e in errors] == [
        "full_collect: called from inside this thread's own gc collection (a finaliser or callback)"
    ]


def test_no_collection_at_exit_is_an_error_and_never_masks_the_body_s_exception(monkeypatch):
    debug, enabled = gc.get_debug(), gc.isenabled()
    with ExitStack() as other_thread:
        with pytest.raises(RuntimeError, match=r"check_tensor_leaks: no report: full_collect: gc\.collect"):
            with check_tensor_leaks(max_chains=0) as report:
                other_thread.enter_context(another_thread_collecting())
                monkeypatch.setattr(_gc_phase, "_FULL_COLLECT_TIMEOUT_S", 0.0)
                _make_cycle()
        assert not report.done and (gc.get_debug(), gc.isenabled()) == (debug, enabled)
    monkeypatch.undo()
    with ExitStack() as other_thread:
        with pytest.raises(KeyError) as info, check_tensor_leaks(max_chains=0) as report:
            other_thread.enter_context(another_thread_collecting())
            monkeypatch.setattr(_gc_phase, "_FULL_COLLECT_TIMEOUT_S", 0.0)
            raise KeyError("the body's own")
        assert not report.done and (gc.get_debug(), gc.isenabled()) == (debug, enabled)
    if sys.version_info >= (3, 11):
        assert any("check_tensor_leaks: no report" in n for n in info.value.__notes__)
    monkeypatch.undo()
    _gc_phase.full_collect()


def test_body_exception_wins_over_the_leak_and_carries_the_report():
    with pytest.raises(ValueError) as info, check_tensor_leaks(max_chains=0) as report:
        _make_cycle()
        raise ValueError("original")
    assert report.done and report.body_raised and report.num_tensors == 1
    if sys.version_info >= (3, 11):
        assert info.value.__notes__ == [report.format()]


def test_warmup_runs_before_arming():
    cache: dict = {}

    def first_call_makes_a_cycle() -> None:
        if "t" not in cache:  # a one-time lazy initialisation that is cyclic garbage
            _make_cycle()
            cache["t"] = True

    with check_tensor_leaks(strict=False, max_chains=0) as without:
        first_call_makes_a_cycle()
    cache.clear()
    with check_tensor_leaks(warmup=first_call_makes_a_cycle) as with_warmup:
        first_call_makes_a_cycle()
    assert without.num_tensors == 1 and with_warmup.num_tensors == 0


def test_garbage_saved_before_the_block_is_left_alone():
    sentinel = ["saved by someone else"]
    gc.garbage.append(sentinel)
    try:
        with check_tensor_leaks(strict=False, max_chains=0) as report:
            _make_cycle()
        assert report.num_garbage == 2 and report.num_tensors == 1
        assert gc.garbage[-1] is sentinel
    finally:
        gc.garbage.remove(sentinel)


def test_nested_checkers_each_report_the_inner_leak():
    with check_tensor_leaks(strict=False, max_chains=0) as outer:
        with check_tensor_leaks(strict=False, max_chains=0) as inner:
            _make_cycle()
    assert inner.num_tensors == 1 and outer.num_tensors == 1


def test_views_and_shared_storages_count_once():
    base = torch.zeros(8)

    def leak_two_views() -> None:
        a, b = base[:4], base[4:]
        box: dict = {"a": a, "b": b}
        box["self"] = box

    with check_tensor_leaks(strict=False, max_chains=0) as report:
        leak_two_views()
    assert (report.num_tensors, report.num_storages, report.tensor_bytes) == (2, 1, 32)


def test_a_sparse_tensor_counts_its_indices_and_values_and_a_meta_tensor_no_memory():
    indices, values = torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0])  # 32 + 8 bytes
    sparse = torch.sparse_coo_tensor(indices, values, (2, 2), check_invariants=True)
    meta = torch.empty(1000, device="meta")

    def leak(t: torch.Tensor) -> None:
        box: dict = {"t": t}
        box["self"] = box

    with check_tensor_leaks(strict=False, max_chains=0) as report:
        leak(sparse)
        del sparse
    assert (report.num_tensors, report.num_storages, report.tensor_bytes) == (1, 2, 40)
    with check_tensor_leaks(strict=False, max_chains=0) as report:
        leak(meta)
        del meta
    assert (report.num_tensors, report.num_storages, report.tensor_bytes) == (1, 0, 0)


def test_output_dir_and_max_chains(tmp_path):
    def two_leaks() -> None:
        _make_cycle()
        _make_cycle()

    with check_tensor_leaks(strict=False, max_chains=1, output_dir=tmp_path / "graphs") as report:
        two_leaks()
    assert report.num_tensors == 2 and len(report.chains) == 1
    assert report.output_dir == str(tmp_path / "graphs")
    written = sorted(os.path.basename(p) for p in report.dot_paths + report.png_paths)
    assert sorted(os.listdir(tmp_path / "graphs")) == written


def test_bad_arguments_and_reuse_are_refused():
    with pytest.raises(ValueError, match="max_chains must be >= 0"):
        check_tensor_leaks(max_chains=-1)
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        check_tensor_leaks(max_depth=0)
    with pytest.raises(TypeError, match="warmup must be a callable"):
        check_tensor_leaks(warmup=3)
    for bad, message in [
        (dict(strict="no"), "strict must be a bool, got str 'no'"),
        (dict(strict=0), "strict must be a bool, got int 0"),
        (dict(max_chains="3"), "max_chains must be an int, got str '3'"),
        (dict(max_chains=2.5), "max_chains must be an int, got float 2.5"),
        (dict(max_depth="x"), "max_depth must be an int, got str 'x'"),
        (dict(output_dir=3), "output_dir must be a str, an os.PathLike or None, got int"),
    ]:
        with pytest.raises(TypeError) as raised:
            check_tensor_leaks(**bad)
        assert str(raised.value) == f"check_tensor_leaks: {message}"
    checker = check_tensor_leaks()
    with checker, pytest.raises(RuntimeError, match="already active"):
        checker.__enter__()


def test_an_output_dir_that_is_a_file_is_refused_when_made(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=r"output_dir '.*afile' exists and is not a folder"):
        check_tensor_leaks(output_dir=afile)


def test_graph_files_that_cannot_be_written_leave_the_report_and_the_body_s_exception(tmp_path):
    """A folder that cannot be made when the block exits (under a file): the report keeps its chains and says
    why the graph files are missing, a strict block still raises the leak, and a body's exception still wins."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(TensorLeakError) as raised, check_tensor_leaks(output_dir=afile / "graphs"):
        _make_cycle()
    report = raised.value.report
    assert report.num_tensors == 1 and len(report.chains) == 1
    assert report.dot_paths == [] and report.output_dir is None
    assert report.graph_error is not None and report.graph_error.startswith(f"{afile / 'graphs'}: ")
    assert report.format().splitlines()[-1] == f"graph files not written: {report.graph_error}"
    with pytest.raises(KeyError, match="boom"), check_tensor_leaks(output_dir=afile / "graphs"):
        _make_cycle()
        raise KeyError("boom")
    graphs = tmp_path / "graphs"  # the folder is made, the file cannot be written: a folder holds its name
    (graphs / "leak-1.dot").mkdir(parents=True)
    with check_tensor_leaks(strict=False, output_dir=graphs) as report:
        _make_cycle()
    assert report.num_tensors == 1 and len(report.chains) == 1
    assert report.dot_paths == [] and report.output_dir is None
    assert report.graph_error is not None and report.graph_error.startswith(f"{graphs / 'leak-1.dot'}: ")
    assert os.listdir(graphs) == ["leak-1.dot"]


def test_checkers_armed_at_overlapping_times_restore_the_flags_found_before_the_first():
    """Two threads' checkers, the first to enter leaving first; and one thread's checkers exited out of order:
    the caller's debug flags come back (Note [armed checkers share the debug flags]); each sees its leak."""
    old = gc.get_debug()
    gc.set_debug(gc.DEBUG_UNCOLLECTABLE)
    try:
        first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
        reports: dict[str, LeakReport] = {}
        errors: list[BaseException] = []

        def waited(event: threading.Event) -> None:
            assert event.wait(timeout=120), "the other thread never got there"

        def checked(name: str, before: threading.Event | None, entered: threading.Event, inside: threading.Event,
                    done: threading.Event | None) -> None:
            """A checker armed after ``before``, holding its block open until ``inside``; ``done`` once out."""
            try:
                if before is not None:
                    waited(before)
                with check_tensor_leaks(strict=False, max_chains=0) as reports[name]:
                    entered.set()
                    waited(inside)
                    _make_cycle()
            except BaseException as e:
                errors.append(e)
            finally:
                entered.set()
                if done is not None:
                    done.set()

        threads = [  # the first enters first and leaves first
            threading.Thread(target=checked, args=("first", None, first_in, second_in, first_out)),
            threading.Thread(target=checked, args=("second", first_in, second_in, first_out, None)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads) and errors == [], errors
        assert gc.get_debug() == gc.DEBUG_UNCOLLECTABLE
        # the second, still armed when the first frees what it caught, reports that too (Note [checker clears
        # gc.garbage], as nested checkers do)
        assert reports["first"].num_tensors == 1 and reports["second"].num_tensors == 2
        outer, inner = check_tensor_leaks(strict=False), check_tensor_leaks(strict=False)
        outer.__enter__()
        try:
            inner.__enter__()
            try:
                outer.__exit__(None, None, None)
                assert gc.get_debug() & gc.DEBUG_SAVEALL  # the inner one is still armed
            finally:
                inner.__exit__(None, None, None)
        finally:
            if outer._armed:
                outer.__exit__(None, None, None)
        assert gc.get_debug() == gc.DEBUG_UNCOLLECTABLE
        with pytest.raises(RuntimeError, match="this checker is not active"):
            inner.__exit__(None, None, None)  # a second exit would take another checker's share
        with check_tensor_leaks(strict=False):
            pass
        assert gc.get_debug() == gc.DEBUG_UNCOLLECTABLE
        _make_cycle()
        _gc_phase.full_collect()
        assert gc.garbage == []
    finally:
        gc.set_debug(old)


def test_a_mock_with_a_tensor_s_spec_is_no_tensor_leak():
    """``MagicMock(spec=torch.Tensor)`` answers ``isinstance`` for Tensor and sits in the mock library's own
    parent/child cycle; the checker counts objects by their type. The negative control: a real tensor beside
    it is counted."""
    from unittest import mock

    with check_tensor_leaks(strict=False, max_chains=0) as report:
        m = mock.MagicMock(spec=torch.Tensor)
        _children = (m.dtype, m.device)  # child mocks, which refer back to their parent
        del _children
        del m
    assert report.num_garbage > 0 and report.ok
    with check_tensor_leaks(strict=False, max_chains=0) as report:
        m = mock.MagicMock(spec=torch.Tensor)
        _children = (m.dtype, m.device)
        del _children
        m.real = torch.ones(2)
        del m
    assert report.num_tensors == 1 and report.num_nodes == 0


def test_report_before_exit_says_so():
    with check_tensor_leaks() as report:
        assert not report.done
        assert "has not exited yet" in report.format()


def test_a_caught_leak_s_default_graph_folder_is_left_in_no_shared_temp_dir(_own_tempdir):
    """Issue 23: the suite left ``ppbackward-leaks-*`` folders in the system temp dir; a leak test's default
    folder is now inside pytest's own temp folders (tests/leaks/conftest.py), removed with them."""
    import tempfile

    assert tempfile.gettempdir() == _own_tempdir
    with check_tensor_leaks(strict=False) as report:
        a = torch.ones(3, requires_grad=True)
        y = a * 2
        holder = [y]
        holder.append(holder)  # a cycle holding a tensor with a graph
        del y, holder
    assert report.num_tensors >= 1 and report.output_dir is not None
    assert os.path.dirname(report.output_dir) == _own_tempdir
    assert os.path.basename(report.output_dir).startswith("ppbackward-leaks-")


def test_a_report_left_half_filled_is_not_the_next_blocks(monkeypatch):
    """A block whose report could not be filled (the analysis raised) leaves it not done: the next entry still
    reports on a new one, not on that half-filled one (a "not done" test reused it; reviewer)."""
    box = check_tensor_leaks(strict=False)

    def half_filled(caught):
        box.report.chains.append("a chain of the failed block")
        raise RuntimeError("the analysis failed")

    monkeypatch.setattr(box, "_fill", half_filled)
    with pytest.raises(RuntimeError, match="the analysis failed"), box as first:
        _make_cycle()
    monkeypatch.undo()
    assert not first.done
    with box as second:
        pass
    assert second is not first and second.done and second.chains == []
