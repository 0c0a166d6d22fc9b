"""Compiled blocks under the zero-bubble schedules, under torchrun (issue 37; ``ppbackward check --scenario
compiled-zb``).

Every stage of the ``compiled-blocks`` model is ``BLOCKS`` residual blocks, each a ``torch.compile(block)``
child (``aot_eager``): the spelling torch's ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble``
refuse when they are built. With ``ppbackward.install()`` they run, and every case must pass every check of
the matrix on every rank (grads against the single-process eager reference, zero garbage, activations dead
on time, hooks once per parameter per microbatch) with every B call splitting each of its stage's compiled
regions into B and W (the regions probe: Note [regions counted] in ``ppbackward._tools.harness.probes``).
torch's own backward fails every case with exactly one kind, ``compile-refused``, where its schedules
check for compiled modules (torch 2.9+; 2.13 and 2.15 do).
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from ppbackward import _compiled
from ppbackward._tools.harness import models
from ppbackward._tools.harness.diagnose import diagnose
from ppbackward._tools.harness.worker import case_id
from tests.multiproc.multiproc_specs import LAUNCH_TEST_TIMEOUT, uses_launch

ZB = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")
CASES = [case_id(s, "compiled-blocks") for s in ZB]


@uses_launch("compiled-zb")
@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
@pytest.mark.skipif(not _compiled.support().ok, reason=f"no split here: {_compiled.support().why}")
def test_ppbackward_splits_every_compiled_region_of_every_b_exactly(launches) -> None:
    result = launches("compiled-zb")
    assert result.complete, result.format_launch()
    assert result.case_ids() == CASES, result.summary()
    for case in CASES:
        assert result.case_status(case) == "pass", result.format_case(case)
        records = [r for r in result.case(case).values() if r is not None]
        assert len(records) == 2
        for record in records:
            assert len(record.steps) == 2
            for step in record.steps:
                where = f"{case} rank stages {record.stages} step {step.step}"
                regions = step.regions
                assert regions is not None and regions.counted, where
                # every B action of this rank's list (torch's "I"; the others run full backwards) calls B, but
                # stage 0's (torch skips B there, its W runs a full backward), and every call split both
                # blocks' regions of its stage
                planned = record.actions["lowered"]["I"]
                assert regions.b_calls > 0 and regions.b_split == regions.b_calls, (where, regions)
                assert regions.b_calls == planned if 0 not in record.stages else regions.b_calls < planned, where
                assert regions.fewest == regions.most == regions.expected == models.BLOCKS, (where, regions)
                assert regions.regions == models.BLOCKS * regions.b_calls, (where, regions)
                assert step.numerics.params_compared > 0 and step.numerics.max_abs_grad_err <= 1e-5, where
                assert step.lifetime.saved > 0 and step.hooks.expected > 0, where  # measured, not vacuous


@uses_launch("upstream-compiled-zb")
@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
@pytest.mark.skipif(
    not hasattr(torch_schedules, "_check_torch_compile_compatibility"),
    reason="this torch's zero-bubble schedules do not check for compiled modules",
)
def test_torch_refuses_every_case_when_the_schedule_is_built(launches) -> None:
    result = launches("upstream-compiled-zb")
    assert result.complete, result.format_launch()
    assert result.case_ids() == CASES, result.summary()
    for case in CASES:
        records = [r for r in result.case(case).values() if r is not None]
        assert len(records) == 2 and all(r.status == "error" and not r.steps for r in records), result.format_case(case)
        kinds = {finding.kind.key for record in records for finding in diagnose(record)}
        assert kinds == {"compile-refused"}, result.format_case(case)
