"""The worker's ``--backward upstream`` mode, the one ``ppbackward check`` compares against (layer 3).

torch's own backward must get through every case on every rank (its exceptions are recorded per case,
not fatal), and every full-backward schedule must pass every check: the harness agrees with torch
itself. torch 2.13's zero-bubble (B/W split) cases fail in known ways, which are reported, not
asserted here: its W bypasses the post-accumulate-grad hooks (every split case); its W raises "Trying to
backward through the graph a second time" when one parameter scales two sequential residual branches
(``transformer``'s ``gate``: ``h = h + g * a(h); out = h + g * b(h)``); its B raises "Can't detach views
in-place" on an output that is a view (``tuple``).

torch 2.5's own backward leaks (upstream's fixes shipped in 2.6.0): there every full-backward case must
fail, and only by the leak, each step leaving tensors in reference cycles that a gc run frees.
"""

from __future__ import annotations

import pytest

from ppbackward._compat import torch_release
from ppbackward._tools.harness import schedules
from tests.multiproc.multiproc_specs import LAUNCH_TEST_TIMEOUT, uses_launch

FULL_BACKWARD = [name for name, rule in schedules.RULES.items() if not rule.split_backward]


@uses_launch("upstream-ws2")
@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
def test_upstream_mode_reports_every_case_and_full_backward_schedules_pass(launches) -> None:
    result = launches("upstream-ws2")
    assert result.complete, result.format_launch()
    print(f"\nupstream-ws2: {result.seconds:.1f}s\n{result.summary()}")
    verdict = result.verdicts[0]
    assert verdict is not None
    assert verdict.installed["stage_backward"] == "torch.distributed.pipelining._backward.stage_backward"
    full = [c for c in result.case_ids() if c.split("/")[0] in FULL_BACKWARD and result.case_status(c) != "skip"]
    assert full, result.summary()
    if torch_release()[:2] < (2, 6):
        for case_id in full:
            failures = [f for r in result.case(case_id).values() if r for f in r.failures]
            assert any(f.check == "garbage" for f in failures), result.format_case(case_id)
            others = [f for f in failures if f.kind != "reference-cycle"]  # garbage, or freed only by a gc run
            assert not others, result.format_case(case_id)
    else:
        failing = [c for c in full if result.case_status(c) != "pass"]
        assert not failing, "\n\n".join(result.format_case(c) for c in failing)
    for case_id in result.case_ids():
        for record in result.case(case_id).values():
            assert record is not None, case_id
            assert record.status == "pass" or record.failures or record.reason, case_id
