"""A process forked inside a leak checker or ppbackward's gc pause starts with the gc as the user had it (Note [a fork
inside a checker] in ppbackward.leaks._checker, Note [a fork inside a pause] in ppbackward._gc_pause): a
``multiprocessing`` or ``DataLoader`` worker never leaves the block it was forked in."""

from __future__ import annotations

import gc
import json
import os
import threading
import traceback

import pytest

import ppbackward._gc_pause as pause
import ppbackward.leaks._checker as checker_module
from ppbackward.leaks import check_tensor_leaks

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")


def _in_child(leave=None) -> dict:
    """Fork; the child makes cyclic garbage as library code does, collects, optionally runs ``leave`` (the block's
    exit, as a bare fork that goes on would), and sends back what its gc looks like."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest; what it raised goes back through the pipe
        code = 1
        try:
            os.close(read)
            for _ in range(100):
                d: dict = {}
                d["me"] = d
            gc.collect()
            if leave is not None:
                leave()
            state = {
                "enabled": gc.isenabled(),
                "debug": gc.get_debug(),
                "garbage": len(gc.garbage),
                "save_all_callbacks": sum(isinstance(cb, checker_module._SaveAll) for cb in gc.callbacks),
            }
            os.write(write, json.dumps(state).encode())
            code = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, text
    return json.loads(text)


AS_THE_USER_HAD_IT = {"enabled": True, "debug": 0, "garbage": 0, "save_all_callbacks": 0}


def test_a_worker_forked_inside_a_checker_starts_with_the_gc_as_the_user_had_it():
    assert gc.isenabled() and gc.get_debug() == 0 and not gc.garbage
    with check_tensor_leaks(strict=False) as report:
        child = _in_child()
    assert child == AS_THE_USER_HAD_IT
    assert report.ok  # the parent's checker is unharmed


def test_a_fork_that_leaves_the_checker_in_the_child_finds_nothing_to_disarm():
    """A bare ``os.fork`` that goes on runs the checker's exit in the child too: nothing is disarmed twice, the
    flags stay as the user had them."""
    box = check_tensor_leaks(strict=False)
    box.__enter__()
    try:
        child = _in_child(leave=lambda: box.__exit__(None, None, None))
    finally:
        box.__exit__(None, None, None)
    assert child == AS_THE_USER_HAD_IT


def test_a_worker_forked_inside_the_gc_pause_runs_with_the_collector_on():
    with pause.automatic_gc_paused(always=True):
        assert not gc.isenabled()
        child = _in_child()
        assert not gc.isenabled()  # the parent's pause holds
    assert gc.isenabled()
    assert child["enabled"]


def _pause_held_on_another_thread():
    """A thread inside ppbackward's gc pause (a B on another thread) until the returned event is set."""
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with pause.automatic_gc_paused(always=True):
            inside.set()
            leave.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert inside.wait(60)
    return thread, leave


def _checker_in_child() -> None:
    """In the child: a checker must pause and put back the collector as in any process."""
    with check_tensor_leaks(strict=False):
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_worker_forked_while_another_thread_holds_the_pause_starts_with_none_held():
    """The thread holding the pause does not exist in the child: its share is not counted there, so the child's
    collector is on and a checker there pauses and puts it back (with the share counted, the checker's exit switched
    it off for good; reviewer)."""
    thread, leave = _pause_held_on_another_thread()
    try:
        child = _in_child(leave=_checker_in_child)
    finally:
        leave.set()
        thread.join(60)
    assert child["enabled"] and gc.isenabled()


def test_negative_control_without_the_fork_handlers_the_worker_keeps_the_checkers_gc(monkeypatch):
    monkeypatch.setattr(checker_module, "_after_fork_in_child", lambda: None)
    monkeypatch.setattr(pause, "_after_fork_in_child", lambda: None)
    with check_tensor_leaks(strict=False):
        child = _in_child()
    assert not child["enabled"]
    # the 100 cycles but the last (its dict still named by the loop)
    assert child["debug"] & gc.DEBUG_SAVEALL and child["garbage"] >= 99 and child["save_all_callbacks"] == 1


def test_negative_control_without_the_fork_handlers_the_other_threads_pause_stays_in_the_child(monkeypatch):
    monkeypatch.setattr(pause, "_after_fork_in_child", lambda: None)
    thread, leave = _pause_held_on_another_thread()
    try:
        child = _in_child()
    finally:
        leave.set()
        thread.join(60)
    assert not child["enabled"]
