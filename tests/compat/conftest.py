"""Fixtures for tests/compat: a loopback transport for torch 2.5 and a cyclic-garbage meter (the
one-process gloo group, ``process_group``, is tests/conftest.py's). These tests run on whatever torch
is installed (``nox -s torch-2.5.1``, ``torch-2.15`` and ``compat`` run them on other releases) and skip what does
not apply to it."""

from __future__ import annotations

import collections
import gc

import pytest
import torch
from torch.distributed.pipelining import schedules

import ppbackward as pb
from ppbackward.leaks._gc_phase import full_collect


@pytest.fixture(autouse=True)
def _always_uninstalled():
    pb.uninstall()
    yield
    pb.uninstall()


class _Work:
    def wait(self) -> bool:
        return True


class _Works(list):
    """Finished work in both shapes torch's schedules expect from ``_batch_p2p``: one object with
    ``wait()`` (torch 2.5-2.7) or a list of them (2.8+). Empty, it is falsy like upstream's
    ``None``."""

    def wait(self) -> bool:
        return True


class Loopback:
    """Stands in for ``schedules._batch_p2p`` so that several stages can share rank 0: gloo cannot
    send to its own rank, and up to torch 2.7 the multi-stage schedules talk between stages of one
    rank through P2P (later ones hand tensors over locally and never get here). Only the transport
    is replaced: each send's data is queued and copied into the next receive buffer, in the order
    the schedule posts them; the schedule, ``stage.py`` and the backward are torch's."""

    def __init__(self) -> None:
        self.queue: collections.deque = collections.deque()

    def __call__(self, ops, desc=None):
        if not ops:
            return _Works()
        for op in ops:
            if op.op.__name__ == "isend":
                self.queue.append(op.tensor.detach().clone())
        for op in ops:
            if op.op.__name__ == "irecv":
                data = self.queue.popleft()
                # numel, not shape: the neighbour handshake sends a 0-d tensor into a (1,) buffer.
                assert data.numel() == op.tensor.numel(), "loopback: send/recv order mismatch"
                with torch.no_grad():
                    op.tensor.copy_(data.reshape(op.tensor.shape))
        return _Works([_Work()])


@pytest.fixture
def same_rank_transport(monkeypatch, process_group):
    """Lets several stages share rank 0 on every supported torch (see :class:`Loopback`)."""
    monkeypatch.setattr(schedules, "_batch_p2p", Loopback())


class Garbage:
    """What the cyclic garbage collector found while running a callable (``gc.DEBUG_SAVEALL``)."""

    def __init__(self, objects: list) -> None:
        self.total = len(objects)
        self.tensors = sum(isinstance(o, torch.Tensor) for o in objects)
        self.nodes = sum(isinstance(o, torch.autograd.graph.Node) for o in objects)
        self.kinds = collections.Counter(type(o).__name__ for o in objects).most_common(6)

    def __repr__(self) -> str:
        return (
            f"Garbage(total={self.total}, tensors={self.tensors}, nodes={self.nodes}, {self.kinds})"
        )


def _collect_all() -> None:
    while full_collect():  # not gc.collect(): Note [a collection that surely ran]
        pass


@pytest.fixture
def cyclic_garbage():
    """``cyclic_garbage(fn)`` runs ``fn`` and returns a :class:`Garbage` of the reference cycles it
    left; gc state is restored and the garbage freed afterwards."""

    def measure(fn) -> Garbage:
        _collect_all()
        enabled, flags = gc.isenabled(), gc.get_debug()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            fn()
            _collect_all()
            found = Garbage(gc.garbage)
        finally:
            # the switch and the flags first: a collection below that raises (another thread's that never
            # ends) or a timeout's signal must not leave the suite with the gc off (Note [each test leaves
            # the process as it found it] in tests/conftest.py)
            gc.set_debug(flags)
            if enabled:
                gc.enable()
            gc.garbage.clear()
            _collect_all()
        return found

    return measure
