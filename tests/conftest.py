"""Test-suite wide settings and fixtures. ``tests`` is a package: shared helpers are imported by their
full name (``from tests.core.stages import build``), and pytest puts the repository root on ``sys.path``."""

import os

import pytest
import torch
import torch.distributed as dist

import ppbackward._plan

torch.set_num_threads(1)

# Note [one plan per graph structure] (ppbackward._plan): every plan B reuses is compared with a fresh analysis,
# here and in the processes the tests launch (which read the variable at import)
os.environ["PPBACKWARD_VERIFY_PLANS"] = "1"
ppbackward._plan.VERIFY = True


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
