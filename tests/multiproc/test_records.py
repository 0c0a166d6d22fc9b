"""The harness's typed records (``ppbackward._tools.harness.records``): one JSON round trip for every record,
and a clear refusal of a record of another schema version or shape (Note [record schema])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppbackward._tools.harness import records
from ppbackward._tools.harness.records import (
    SCHEMA_VERSION,
    CacheCount,
    CaseRecord,
    Event,
    Failure,
    GarbageRecord,
    HooksRecord,
    KeptByDesign,
    LifetimeRecord,
    NumericsRecord,
    RankVerdict,
    SchemaError,
    StepRecord,
    Timeouts,
    Tolerance,
    from_json,
    to_json,
)


def _step(n: int) -> StepRecord:
    return StepRecord(
        step=n, seconds=0.25,
        garbage=GarbageRecord(1, 2, 64, 3, {"dict": 3}, ["a -> b"]),
        lifetime=LifetimeRecord(saved=4, bytes_saved=256, kept_by_design=KeptByDesign(1, 32), held_after_gc=1,
                                node_examples=["TanhBackward0"], examples=["float32[2, 4]"]),
        caches={"stage 0": {"fwd_cache": CacheCount(0, 0)}, "schedule": {}},
        numerics=NumericsRecord(params_compared=2, max_abs_grad_err=1.5e-3, worst_param="stage0.w", grads_none=1,
                                max_replica_diff=0.0),
        hooks=HooksRecord(fired=3, expected=4, params_wrong=1),
    )


def _verdict() -> RankVerdict:
    case = CaseRecord(
        "Schedule1F1B/mlp+ddp", schedule="Schedule1F1B", model="mlp", wrap="ddp", status="fail",
        failures=[Failure("hooks", "hooks-skipped", "fired 3 times, expected 4", 1),
                  Failure("exception", "peer-failed", "RuntimeError: Timed out", raised="RuntimeError")],
        steps=[_step(0), _step(1)], error="Traceback ...", world_size=4, dp=2, dp_rank=1, stages=[1],
        num_stages=2, n_microbatches=4, metadata="static", actions={"lowered": {"F": 4, "B": 4}}, seconds=1.5,
    )
    return RankVerdict(
        rank=1, world_size=4, backward="ppbackward", torch="2.13.0", tolerance=Tolerance(1e-5, 1e-6),
        kept_by_design={"recv_buffer": "why"}, complete=True, workarounds=["w"], dp=2, metadata="static",
        installed={"stage_backward": "ppbackward.x"}, timeouts=Timeouts(3.1, 1.033, 31.0, 310.0),
        cases=[case, CaseRecord("ScheduleGPipe/mlp", status="skip", reason="needs 3 ranks")], seconds=9.5,
    )


def test_a_verdict_survives_its_json_round_trip_field_for_field(tmp_path: Path) -> None:
    verdict = _verdict()
    assert from_json(RankVerdict, json.loads(json.dumps(to_json(verdict)))) == verdict
    records.write_verdict(tmp_path / "rank1.json", verdict)
    back = records.read_verdict(tmp_path / "rank1.json")
    assert back == verdict and back is not verdict
    assert back.cases[0].steps[1].lifetime.kept_by_design == KeptByDesign(1, 32)
    assert back.cases[0].failures[1].kind == "peer-failed" and back.cases[1].steps == []


def test_an_event_with_its_case_record_survives_its_round_trip() -> None:
    event = Event("case_end", 1, 12.5, case="Schedule1F1B/mlp+ddp", record=_verdict().cases[0], log_offset=120)
    assert from_json(Event, json.loads(json.dumps(to_json(event)))) == event
    assert from_json(Event, to_json(Event("started", 0, 1.0))) == Event("started", 0, 1.0)


def test_another_schema_version_is_refused_with_what_and_where() -> None:
    data = to_json(_verdict())
    data["schema"] = SCHEMA_VERSION - 1
    with pytest.raises(SchemaError, match=rf"^RankVerdict: schema version 1, this ppbackward reads version "
                                          rf"{SCHEMA_VERSION} \(Note \[record schema\]"):
        from_json(RankVerdict, data)
    event = to_json(Event("started", 0, 1.0))
    del event["schema"]
    with pytest.raises(SchemaError, match=r"^Event: schema version None, this ppbackward reads version"):
        from_json(Event, event)


def test_a_missing_unknown_or_mistyped_field_names_its_path() -> None:
    data = to_json(_verdict())
    del data["cases"][0]["steps"][1]["hooks"]
    data["cases"][0]["steps"][1]["hooks_total"] = 1
    with pytest.raises(SchemaError, match=r"^RankVerdict.cases\[0\].steps\[1\]: unknown field\(s\) hooks_total for "
                                          r"StepRecord$"):
        from_json(RankVerdict, data)
    data = to_json(_verdict())
    del data["cases"][0]["steps"][1]["seconds"]
    with pytest.raises(SchemaError,
                       match=r"^RankVerdict.cases\[0\].steps\[1\]: missing field 'seconds' of StepRecord$"):
        from_json(RankVerdict, data)
    data = to_json(_verdict())
    data["cases"][0]["steps"][0]["hooks"]["fired"] = "3"
    with pytest.raises(SchemaError, match=r"^RankVerdict.cases\[0\].steps\[0\].hooks.fired: expected int, got str '3'"):
        from_json(RankVerdict, data)
    data = to_json(_verdict())
    data["cases"][0]["failures"][0]["check"] = "vibes"
    with pytest.raises(SchemaError, match=r"^RankVerdict.cases\[0\].failures\[0\]: Failure.check 'vibes': expected "
                                          r"one of garbage, "):
        from_json(RankVerdict, data)


def test_a_failure_needs_a_known_check_and_a_kind() -> None:
    with pytest.raises(ValueError, match=r"Failure.kind is empty \(check 'hooks'\)"):
        Failure("hooks", "", "m")
    assert Failure("case", "other", "no placement rule for S").text == "no placement rule for S"
    assert Failure("garbage", "reference-cycle", "2 tensors", 3).text == "step 3: garbage: 2 tensors"


def test_a_file_that_is_not_json_is_no_verdict_but_a_wrong_one_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "rank0.json"
    assert records.read_verdict(path) is None
    path.write_text("{half")
    assert records.read_verdict(path) is None
    path.write_text(json.dumps({"cases": []}))  # the untyped format of schema 1 had no version here
    with pytest.raises(SchemaError, match=r"^rank0.json: schema version None, this ppbackward reads version"):
        records.read_verdict(path)
