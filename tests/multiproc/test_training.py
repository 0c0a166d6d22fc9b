"""Real training setups under torchrun with ``ppbackward.install()`` (issue 12; layer 2 of ``conftest.py``).

Two launches: the training models (frozen prefix + LoRA, LoRA on the last stage only, a compiled block,
bf16 autocast with a scaled loss, a custom Function with a side-effect counter) on one pipeline of 2
ranks; and pipeline x data parallel on a 2-D mesh of 4 ranks (dp 2 x pp 2; Note [dp x pp layout] in
``ppbackward._tools.harness.parallel``), ``mlp`` and ``lora`` with every stage wrapped in DDP, in FSDP2's
``fully_shard``, and in ``fully_shard(reshard_after_forward=False)``, each dp rank on its own data shard.
Every case of every schedule must pass every check on every rank (the single-pipeline ones, plus the
grads against the reference of the mean of the per-shard losses, identical DDP replicas, and the custom
Function's backward run once per microbatch). A third launch (issue 20) runs torchtitan's shape
(``titan``, ``titan-sac``: final RMSNorm, ``lm_head`` applied in a chunked loss with its own backward)
plain and sharded as torchtitan shards it (``fsdp-titan``: Note [torchtitan's final norm] in
``ppbackward._tools.harness.models``). torch's own backward on the same launches: ``test_training_upstream.py``.
"""

from __future__ import annotations

import pytest

from ppbackward._tools.harness import models, parallel, schedules
from ppbackward._tools.harness.records import CaseRecord
from ppbackward._tools.harness.worker import case_id
from tests.multiproc.multiproc_specs import LAUNCH_TEST_TIMEOUT, slow_params

WRAPS = ("ddp", "fsdp", "fsdp-keep")
TITAN_WRAPS = ("none", "fsdp-titan")
LAUNCHES = ("training-ws2", "training-dp", "training-titan")


def expected_cases(launch: str) -> list[str]:
    if launch == "training-ws2":
        return [case_id(c.name, m) for c in schedules.matrix(2) for m in models.TRAINING_MODELS]
    if launch == "training-titan":
        return [case_id(c.name, m, w) for c in schedules.matrix(2) for m in models.TITAN_MODELS for w in TITAN_WRAPS]
    return [case_id(c.name, m, w) for c in schedules.matrix(2) for m in ("mlp", "lora") for w in WRAPS]


def _trainable(record: CaseRecord, stage: int) -> bool:
    if record.model == "lora":
        return stage > 0
    if record.model == "lora-last":
        return stage == record.num_stages - 1
    return True


def assert_measured(record: CaseRecord) -> None:
    """A passing case measured what it claims, on every step (no vacuous pass)."""
    trains = any(_trainable(record, i) for i in record.stages)  # else a frozen stage: nothing to save
    for step in record.steps:
        where = f"{record.id} rank dp {record.dp_rank} stages {record.stages} step {step.step}"
        if trains:
            assert step.lifetime.saved > 0, f"{where}: no saved activation recorded"
            assert step.numerics.params_compared > 0, f"{where}: no grad compared"
            if not record.wrap.startswith("fsdp"):
                assert step.hooks.expected > 0, f"{where}: no hook expected"
        if record.wrap == "ddp":
            assert step.numerics.max_replica_diff == 0.0, where
        expected = models.get_model(record.model).regions_per_b
        if expected:  # issue 37: every B split each compiled region of its stage (Note [regions counted])
            regions = step.regions
            assert regions is not None and regions.counted and regions.b_split == regions.b_calls, (where, regions)
            assert not regions.b_calls or regions.fewest == regions.most == expected, (where, regions)


@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
@pytest.mark.parametrize("name", slow_params(list(LAUNCHES)))
def test_launch_reports_every_case_on_every_rank(name: str, launches) -> None:
    result = launches(name)
    assert result.complete, result.format_launch()
    assert result.case_ids() == expected_cases(name), result.summary()
    print(f"\n{name}: {result.seconds:.1f}s\n{result.summary()}")


@pytest.mark.timeout(LAUNCH_TEST_TIMEOUT)
@pytest.mark.parametrize(
    ("name", "case"), slow_params([(n, c) for n in LAUNCHES for c in expected_cases(n)])
)
def test_case(name: str, case: str, launches) -> None:
    result = launches(name)
    status = result.case_status(case)
    if status == "skip":
        pytest.skip(next(r.reason for r in result.case(case).values() if r))
    assert status == "pass", result.format_case(case)
    records = list(result.case(case).values())
    for record in records:
        assert record is not None
        assert len(record.steps) == 2
        assert_measured(record)
    if name == "training-dp":  # every dp rank fed its own shard: the losses on the last stage differ
        losses = {
            r.dp_rank: r.steps[0].numerics.losses_compared for r in records if r.num_stages - 1 in r.stages
        }
        assert sorted(losses) == [0, 1] and all(n == records[0].n_microbatches for n in losses.values())


def test_dp_batches_differ_per_dp_rank() -> None:
    spec = models.get_model("mlp")
    a, b = (models.make_batch(spec, 2, parallel.batch_seed(0, 0, d)) for d in (0, 1))
    assert not a.args[0].equal(b.args[0])
