"""torch's own backward in the training setups of ``test_training.py``: which cells it fails, and why.

Same two launches with ``--backward upstream``. Every cell's kinds of failure
(``ppbackward._tools.harness.diagnose``, the kinds ``ppbackward check`` names) must be exactly the ones stated
here, strictly: a cell that starts passing, or fails another way, fails this test. Pinned for torch
2.13 and 2.14, whose ``_backward.py`` are identical, and 2.15 (its ``_backward.py`` only takes
``GradientEdge`` and ``None`` outputs besides: the same kinds, checked on 2.15.0); other releases are
skipped (their kinds differ: docs/compatibility.md).

Why each kind happens (one line each, with the public report, in ``diagnose.KINDS``):

* zero-bubble schedules only: the full-backward schedules pass every check;
* ``hooks-skipped``: torch's W bypasses ``AccumulateGrad`` (pytorch/pytorch#144530), in every split
  case whose hooks are counted (not FSDP2's: its autograd runs on unsharded copies);
* ``grads-missing`` (``lora``, ``lora-last``): a stage whose input needs no grad has no input path, so
  torch's B finds no intermediate and its W computes nothing; under ``ScheduleDualPipeV``, which runs
  some microbatches as full backwards, the grads are partial instead (``grads-wrong``);
* ``side-effects-twice`` (``custom-fn``): torch's W runs the custom Function's backward again;
* ``donated-buffers`` (``compiled``, issue 37): torch's B keeps the graph (``retain_graph``), which the
  compiled region's backward refuses for its donated buffers (pytorch/pytorch#161904); the case stops
  there. (Before the activation tracker stepped aside in compiled regions, Note [tracker steps aside in
  compiled regions] in ``ppbackward.leaks._saved_hooks``, the region ran eagerly under the check's probes
  and torch's backward only skipped hooks.)
* ``sac-second-backward`` (``sac``): torch's W recomputes the selectively checkpointed region in a second
  engine call, which selective checkpointing refuses; the case stops there (a rank waiting for the one
  that raised times out: ``peer-failed``, a consequence, not a kind of torch's, and not counted);
* ``ddp-replicas`` + ``grads-wrong`` (DDP): DDP's reducer never runs for W's grads, the replicas diverge;
* ``fsdp-swap`` (FSDP2 with ``reshard_after_forward``): FSDP2 swaps parameter objects between B and W;
  with ``reshard_after_forward=False`` only the frozen-prefix kind remains;
* ``fsdp-loss-reshard`` (``titan`` sharded as torchtitan shards it, issue 20): torchtitan's loss
  reshards the FSDP2 unit ``[norm, lm_head]``, so B gets the final norm's sharded parameter, which is
  not in the graph: its grad stays None (partial under ``ScheduleDualPipeV``: ``grads-wrong``); plain
  ``titan`` only skips hooks, and ``titan-sac`` stops at selective checkpointing's second backward.
"""

from __future__ import annotations

import pytest

from ppbackward._compat import torch_release
from ppbackward._tools.harness import schedules
from ppbackward._tools.harness.diagnose import KINDS, diagnose
from tests.multiproc.multiproc_specs import LAUNCH_TEST_TIMEOUT
from tests.multiproc.test_training import expected_cases

SPLIT = {name for name, rule in schedules.RULES.items() if rule.split_backward}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (2, 13) <= torch_release()[:2] <= (2, 15),
        reason="the kinds below are pinned for torch 2.13-2.15's _backward.py (checked on each)",
    ),
]


def expected_kinds(case: str) -> frozenset[str]:
    """The kinds of failure of torch's own backward in ``case`` (``Schedule/model[+wrap]``)."""
    schedule, rest = case.split("/")
    model, _, wrap = rest.partition("+")
    if schedule not in SPLIT:
        return frozenset()
    frozen = model in ("lora", "lora-last")
    lost = "grads-wrong" if schedule == "ScheduleDualPipeV" else "grads-missing"
    if model == "titan-sac":
        return frozenset({"sac-second-backward"})
    if model == "titan":  # Note [torchtitan's final norm]: the loss's reshard hides the final norm from B
        if wrap == "fsdp-titan":
            return frozenset({"grads-wrong" if schedule == "ScheduleDualPipeV" else "fsdp-loss-reshard"})
        return frozenset({"hooks-skipped"})
    if model == "sac":
        return frozenset({"sac-second-backward"})
    if model == "compiled":
        return frozenset({"donated-buffers"})
    if wrap == "fsdp":
        return frozenset({"fsdp-swap"})
    if wrap == "fsdp-keep":
        return frozenset({lost} if frozen else ())
    kinds = {"hooks-skipped"}
    if frozen:
        kinds.add(lost)
    if model == "custom-fn":
        kinds.add("side-effects-twice")
    if wrap == "ddp":
        kinds |= {"ddp-replicas", "grads-wrong"}
    return frozenset(kinds)


CELLS = [
    (launch, case)
    for launch, name in (
        ("upstream-training-ws2", "training-ws2"),
        ("upstream-training-dp", "training-dp"),
        ("upstream-training-titan", "training-titan"),
    )
    for case in expected_cases(name)
]


@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
@pytest.mark.parametrize(
    ("launch", "case"), CELLS, ids=[f"{c}[{'+'.join(sorted(expected_kinds(c))) or 'pass'}]" for _, c in CELLS]
)
def test_torch_backward_fails_exactly_the_stated_kinds(launch: str, case: str, launches) -> None:
    result = launches(launch)
    assert result.complete, result.format_launch()
    records = result.case(case)
    if result.case_status(case) == "skip":
        pytest.skip(next(r.reason for r in records.values() if r))
    assert all(records.values()), f"{case}: a rank left no record of it\n" + result.format_case(case)
    found = {finding.kind.key for record in records.values() if record for finding in diagnose(record)}
    # a rank waiting for the one that raised: a consequence; alone, a stall with no kind of torch's
    assert found != {"peer-failed"}, f"{case}: every failing rank timed out waiting\n" + result.format_case(case)
    found.discard("peer-failed")
    expected = expected_kinds(case)
    reasons = "\n".join(f"  {k.key}: {k.reason}" for k in KINDS if k.key in expected | found)
    stated = f"{case}: torch's backward failed with {sorted(found)}, stated {sorted(expected)}\n{reasons}\n"
    assert found == expected, stated + result.format_case(case)
