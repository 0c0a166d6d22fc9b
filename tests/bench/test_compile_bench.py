"""``ppbackward bench --compile``: the split's cost where every layer is ``torch.compile``'d (Note [compiled
split cost] in ``ppbackward._tools.bench.compiled``; Note [compiled schedule benchmark] in
``ppbackward._tools.harness.schedule_bench``).

The ``aot_eager`` backend throughout (it compiles in seconds; the command's default, inductor, in minutes).
No timing is asserted: what is checked is that the command runs, measures the split it claims to (every
region split by every B call, grads as the compiled full backward's), writes its typed records and prints
its tables and targets; and that a region run whole in B is reported, not timed as the split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch

import ppbackward
from ppbackward import _compiled
from ppbackward._tools.bench import compiled as _compiled_bench
from ppbackward._tools.bench import report as _report
from ppbackward._tools.bench.records import CompileRun
from ppbackward._tools.cli.bench import main
from ppbackward._tools.harness import records, schedule_bench
from ppbackward._tools.harness.models import build

pytestmark = pytest.mark.skipif(not _compiled.support().ok, reason=f"no split here: {_compiled.support().why}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile") / "report.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--compile", "--compile-backend", "aot_eager", "--quick", "--repeats", "1", "--json", str(path)])
    return rc, json.loads(path.read_text()), out.getvalue()


def test_the_compiled_stage_is_split_exactly_and_timed_against_the_compiled_full_backward(quick):
    rc, data, _ = quick
    assert rc == 0
    run = CompileRun.from_report(data)
    assert run.to_report() == data and run.schedule is None  # the JSON written is the JSON read
    c = run.compiled
    assert (c.backend, c.device, c.regions, c.regions_per_b, c.grads_match) == ("aot_eager", "cpu", 4, 4, True)
    assert c.config.name == "4x16x4" and c.config.limit_bw == _compiled_bench.LIMIT_BW == 1.2
    assert c.eager_nodes is not None and c.config.nodes is not None and c.config.nodes < c.eager_nodes
    for regime in ("first", "accumulating"):
        assert list(c.config.ratios_of(regime)) == ["pp"]  # torch's split is not timed (donated buffers)
        times = c.config.times(regime)
        assert times.full > 0 and times.variants["pp"].b > 0 and times.variants["pp"].w > 0
    names = [(t["target"], t["where"].split(", ")[1]) for t in run.targets]
    assert names == [("compiled split: B+W <= 1.20x compiled full backward", r) for r in ("first", "accumulating")]


def test_the_report_prints_the_split_table_the_targets_and_the_split_verdict(quick):
    _, _, text = quick
    assert "ppbackward bench --compile " in text and " backend aot_eager " in text
    lines = text.splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("Compiled stage: B, W and B+W"))
    assert "4 compiled regions, " in lines[heading] and "B split 4 regions" in lines[heading]
    assert lines[heading + 1].split() == ["regime", "N", "full", "B", "W", "B+W", "B+W/full", "median", "[q1-q3]",
                                          "B/full"]
    assert [line.split()[0] for line in lines[heading + 3 : heading + 5]] == ["first", "accumulating"]
    assert 'Targets (docs/performance.md, "The split\'s host cost")' in text
    assert lines[-1] == "split: every B split every compiled region, grads as the compiled full backward's"


def test_a_region_run_whole_in_b_is_reported_not_timed_as_the_split(quick):
    """The negative control: a stage whose regions were compiled before ``install()`` runs them whole in B
    (exact); ``check_split`` counts 0 and the run says so and fails."""
    ppbackward.uninstall()
    stage = build(_compiled_bench.CONFIG)
    schedule_bench.compile_layers(stage.model, "aot_eager")
    stage.model(stage.x).backward(stage.grad)  # forward and backward compiled without ppbackward's compiler
    with ppbackward.installed():
        exact, split = _compiled_bench.check_split(stage)
    assert (exact, split) == (True, 0)
    run = CompileRun.from_report(quick[1])
    whole = dataclasses.replace(run, compiled=dataclasses.replace(run.compiled, regions_per_b=split))
    assert _compiled_bench.split_problems(whole) == [
        "B split 0 of the stage's 4 compiled regions (the others ran whole in B: not split into B and W)"
    ]
    assert _compiled_bench.format_run(whole, _report).endswith("split: B split 0 of the stage's 4 compiled regions "
                                                               "(the others ran whole in B: not split into B and W)")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compile", "--split"], "--compile: not with --split, --one-rank-step or --plot"),
        (["--compile-backend", "aot_eager"], "--compile-backend: only with --compile"),
        (["--compile", "--configs", "4x16x4,4x64x16"], "--compile: one configuration at a time"),
    ],
)
def test_compile_options_are_checked_first(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2 and message in capsys.readouterr().err


def _verdict(rank: int, regions: int | None) -> records.RankVerdict:
    cases = []
    for i, (s, _, b) in enumerate(schedule_bench.COMPILED_VARIANTS):
        name = schedule_bench.variant_name(s, b)
        bench = records.VariantRecord(10.0 + i, records.StepParts(), [], records.MemoryRecord(None, None, None))
        split = None
        if b != "upstream" and "ZeroBubble" in s and regions is not None:
            split = records.RegionsRecord(b_calls=8, b_split=8 if regions else 0, regions=8 * regions,
                                          fewest=regions, most=regions, expected=4)
        cases.append(records.CaseRecord(id=name, bench=bench, steps=[records.StepRecord(0, 0.01, regions=split)]))
    return records.RankVerdict(rank, 2, "upstream", mode="bench", cases=cases)


def test_the_compiled_real_step_collects_the_regions_each_variants_b_split():
    config = schedule_bench.BenchConfig(d_model=256, compile="aot_eager")
    assert config.worker_args()[-2:] == ["--compile", "aot_eager"] and config.variants[0][2] == "upstream"
    assert not any(b == "upstream" and "ZeroBubble" in s for s, _, b in config.variants)  # torch refuses them
    result = schedule_bench.collect([_verdict(0, 4), _verdict(1, 4)], config, repeats=2)
    assert result.compile == "aot_eager" and result.variants[0] == "Interleaved1F1B/upstream"
    assert set(result.regions) == {"InterleavedZeroBubble/ppbackward", "InterleavedZeroBubble/merged",
                                   "ZBVZeroBubble/ppbackward", "ZBVZeroBubble/merged"}
    zbv = result.regions["ZBVZeroBubble/ppbackward"]
    assert (zbv.b_calls, zbv.regions, zbv.fewest, zbv.most, zbv.all_split) == (16, 64, 4, 4, True)
    assert records.from_json(records.ScheduleBench, json.loads(json.dumps(records.to_json(result)))) == result
    whole = schedule_bench.collect([_verdict(0, 4), _verdict(1, 0)], config, repeats=2)
    assert not whole.regions["ZBVZeroBubble/ppbackward"].all_split
    targets = _compiled_bench._split._real_step_targets(result, "compiled real step")
    assert [t["target"] for t in targets if "ZBV" in t["target"]] == [
        "compiled real step: ZBVZeroBubble (ppbackward) <= 1.00x Interleaved1F1B",
        "compiled real step: ZBVZeroBubble (merged) <= 1.00x Interleaved1F1B",
    ]
    assert all(t["where"].endswith(", aot_eager") for t in targets)
    eager = schedule_bench.BenchConfig()
    assert eager.variants == schedule_bench.VARIANTS and "--compile" not in eager.worker_args()


@pytest.mark.slow
def test_the_compiled_real_step_runs_every_variant_exactly_with_every_region_split():
    """One real torchrun launch with every layer compiled (aot_eager, d 64): torch's Interleaved1F1B against
    ppbackward's zero-bubble variants, each B call splitting every layer's region."""
    result = schedule_bench.run_schedule(repeats=1, timeout_s=600, d_model=64, compile="aot_eager")
    assert result.grads_match is True and result.compile == "aot_eager"
    assert result.variants == [schedule_bench.variant_name(s, b) for s, _, b in schedule_bench.COMPILED_VARIANTS]
    assert result.ratio_to_1f1b["Interleaved1F1B/upstream"] == pytest.approx(1.0)
    assert set(result.regions) == {v for v in result.variants if "ZeroBubble" in v}
    for name, regions in result.regions.items():
        assert regions.b_calls > 0 and regions.fewest == regions.most == regions.expected == 4, (name, regions)
    text = _compiled_bench._real_step_text(result, _report)
    assert "Real step with compiled layers (torchrun 2 ranks, 4 stages x 4 layers d 64" in text
    assert any(line.split()[-1] == "4/B" for line in text.splitlines() if line.startswith("ZBVZeroBubble/"))
