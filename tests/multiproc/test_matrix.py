"""The schedule × model matrix with ``ppbackward.install()`` active (layer 2 of ``conftest.py``).

One torchrun launch per configuration; one test per case reads every rank's verdict for that case.
"""

from __future__ import annotations

import pytest

from ppbackward._tools.harness import models, schedules
from ppbackward._tools.harness.probes import recv_buffers_kept_by_stage
from ppbackward._tools.harness.records import CaseRecord
from tests.multiproc.multiproc_specs import LAUNCH_TEST_TIMEOUT, LAUNCHES, slow_params

MATRIX = ("ws2", "ws4", "ws2-static")


def expected_cases(world_size: int) -> list[str]:
    return [f"{case.name}/{model}" for case in schedules.matrix(world_size) for model in models.CORE_MODELS]


def assert_measured(record: CaseRecord) -> None:
    """A passing case must have measured something on every step (no vacuous pass)."""
    stages = record.stages
    assert len(record.steps) == 2, record.steps
    for step in record.steps:
        where = f"{record.id} stages {stages} step {step.step}"
        assert step.lifetime.saved > 0, f"{where}: no saved activation recorded"
        assert step.numerics.params_compared > 0, f"{where}: no grad compared"
        assert step.hooks.expected > 0, f"{where}: no hook expected"
        if record.num_stages - 1 in stages:
            assert step.numerics.losses_compared == record.n_microbatches, where
        kept = step.lifetime.kept_by_design.recv_buffer
        if not recv_buffers_kept_by_stage():  # torch 2.15+: a buffer per receive, handed over, none kept
            assert kept == 0, f"{where}: {kept} activations kept by receive buffers this torch does not keep"
        elif any(s != 0 for s in stages):
            assert kept > 0, f"{where}: receive buffers not seen"


@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
@pytest.mark.parametrize("name", slow_params(list(MATRIX)))
def test_launch_reports_every_case_on_every_rank(name: str, launches) -> None:
    result = launches(name)
    assert result.complete, result.format_launch()
    assert result.case_ids() == expected_cases(LAUNCHES[name].nproc), result.summary()
    assert result.progress == result.case_ids()  # every case was reported while the launch ran
    print(f"\n{name}: {result.seconds:.1f}s\n{result.summary()}")


@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
@pytest.mark.parametrize(
    ("name", "case_id"),
    slow_params([(name, case_id) for name in MATRIX for case_id in expected_cases(LAUNCHES[name].nproc)]),
)
def test_case(name: str, case_id: str, launches) -> None:
    result = launches(name)
    status = result.case_status(case_id)
    if status == "skip":
        pytest.skip(next(r.reason for r in result.case(case_id).values() if r))
    assert status == "pass", result.format_case(case_id)
    for record in result.case(case_id).values():
        assert record is not None
        assert_measured(record)
