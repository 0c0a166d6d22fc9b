"""Negative controls (layer 4 of ``conftest.py``): a deliberately leaky backward must be reported,
with the kind of leak and its exact count, on every rank and every step."""

from __future__ import annotations

import pytest

from ppbackward.leaks._saved_hooks import top_hooks
from tests.multiproc.multiproc_specs import LAUNCH_TEST_TIMEOUT, uses_launch


def _cases(result):
    assert result.complete, result.format_launch()
    ids = result.case_ids()
    assert ids == ["Schedule1F1B/mlp", "ScheduleInterleavedZeroBubble/mlp"], ids
    for case_id in ids:
        for rank, record in result.case(case_id).items():
            assert record is not None, f"rank {rank} has no record for {case_id}"
            # leaky_backward.py leaks once per stage per microbatch
            yield case_id, rank, record, record.n_microbatches * len(record.stages)


@uses_launch("leaky-cycle")
@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
def test_reference_cycle_leak_is_reported_as_garbage_with_exact_counts(launches) -> None:
    result = launches("leaky-cycle")
    assert not result.ok
    for case_id, rank, record, leaks in _cases(result):
        assert record.status == "fail", (case_id, rank)
        for step in record.steps:
            garbage = step.garbage
            assert (garbage.tensors, garbage.nodes) == (leaks, leaks), (case_id, rank, step.step, garbage)
            assert garbage.chains, "no back-reference chain reported"
        text = result.format_case(case_id)
        assert f"garbage: {leaks} tensors and {leaks} autograd nodes in reference cycles" in text
        assert "leaky_backward.py" in text  # the chain names the closure that closes the cycle


@uses_launch("leaky-live")
@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
def test_live_reference_leak_is_reported_as_lifetime_with_exact_counts(launches) -> None:
    result = launches("leaky-live")
    assert not result.ok
    for case_id, rank, record, leaks in _cases(result):
        assert record.status == "fail", (case_id, rank)
        for step in record.steps:
            assert step.garbage.ok, "a live reference is not a cycle"
            # the mlp stage's first Linear saved each kept input: one saved activation per call
            assert step.lifetime.held_after_gc == leaks, (case_id, rank, step.step, step.lifetime)
            assert step.lifetime.freed_only_by_gc == 0
        assert f"lifetime: {leaks} saved activations" in result.format_case(case_id)
        assert "still alive after clear_runtime_states()" in result.format_case(case_id)


@pytest.mark.skipif(
    top_hooks is None,
    reason="this torch has no torch._C._autograd._top_saved_tensors_default_hooks: the tracker sees no pack hook",
)
@uses_launch("leaky-cxx-cycle")
@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
def test_a_node_held_by_a_cycle_the_gc_cannot_see_is_reported_as_lifetime_with_exact_counts(launches) -> None:
    """Note [leaks the gc cannot see]: nothing reaches gc.garbage, the activation tracker's weak watches
    on the step's nodes and packed tensors see every one."""
    result = launches("leaky-cxx-cycle")
    assert not result.ok
    for case_id, rank, record, leaks in _cases(result):
        assert record.status == "fail", (case_id, rank)
        for step in record.steps:
            assert step.garbage.ok, step.garbage  # no tensor, no node in gc.garbage
            lifetime = step.lifetime
            assert (lifetime.nodes_held_after_gc, lifetime.packed_held_after_gc) == (leaks, leaks), lifetime
            assert lifetime.node_examples == ["TanhBackward0"] * min(leaks, 5)
        assert f"lifetime: {leaks} autograd nodes and {leaks} packed saved tensors" in result.format_case(case_id)
