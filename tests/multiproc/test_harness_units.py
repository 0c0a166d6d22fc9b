"""The harness's pieces, without any process group or subprocess (layer 1 of ``conftest.py``)."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from ppbackward._compat import torch_release
from ppbackward._tools.harness import diagnose, models, parallel, probes, runner, schedules, worker
from ppbackward._tools.harness.launch import LaunchResult
from ppbackward._tools.harness.records import (
    CaseRecord,
    Event,
    EventReader,
    EventWriter,
    Failure,
    RankVerdict,
    RegionsRecord,
    to_json,
)

# ----------------------------------------------------------------------------------------------------
# schedule matrix


def test_every_schedule_class_of_the_installed_torch_has_a_rule() -> None:
    found = schedules.discover()
    assert found, "no Schedule* class discovered"
    assert set(found) <= set(schedules.RULES), f"no placement rule for {set(found) - set(schedules.RULES)}"
    for case in schedules.matrix(2):
        assert case.error is None, case.error
        if case.name in found:
            assert case.skip is None


@pytest.mark.parametrize("world_size", [2, 4])
def test_placement_puts_every_stage_on_exactly_one_rank(world_size: int) -> None:
    for case in schedules.matrix(world_size):
        if case.skip:
            continue
        placed = [i for rank in range(world_size) for i in case.stage_indices(rank)]
        assert sorted(placed) == list(range(case.num_stages)), case.name
        assert all(len(case.stage_indices(r)) == case.rule.stages_per_rank for r in range(world_size))
        if case.rule.style == "v":  # the V's bottom: two adjacent stages on the last rank
            assert case.stage_indices(world_size - 1) == [world_size - 1, world_size]
            assert case.stage_indices(0) == [0, 2 * world_size - 1]
        if case.name in ("Schedule1F1B", "ScheduleDualPipeV"):
            assert case.n_microbatches >= case.num_stages


def test_unknown_schedule_class_becomes_a_failing_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedules, "discover", lambda: [*schedules.RULES, "ScheduleFromTheFuture"])
    case = schedules.matrix(2)[-1]
    assert case.name == "ScheduleFromTheFuture" and "no placement rule" in (case.error or "")


def test_rule_whose_class_is_missing_becomes_a_skip_with_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedules, "discover", lambda: ["ScheduleGPipe"])
    skipped = {c.name: c.skip for c in schedules.matrix(2) if c.skip}
    assert "first shipped in 2.8" in skipped["ScheduleDualPipeV"]


# ----------------------------------------------------------------------------------------------------
# model zoo


@pytest.mark.parametrize("name", list(models.MODELS))
def test_model_stack_is_deterministic_and_its_reference_produces_grads(name: str) -> None:
    spec = models.get_model(name)
    a, b = models.build_stages(spec, 3, seed=7), models.build_stages(spec, 3, seed=7)
    for ma, mb in zip(a, b):
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            assert torch.equal(pa, pb)
    batch = models.make_batch(spec, 2, seed=1)
    ref = models.reference_step(a, batch, 2, spec.loss_of(a[-1]))
    assert len(ref.losses) == 2 and all(torch.isfinite(x) for x in ref.losses)
    trainable = [n for i, m in enumerate(a) for n, p in models.param_names(i, m) if p.requires_grad]
    assert trainable and all(ref.grads[n] is not None for n in trainable)
    frozen = [n for i, m in enumerate(a) for n, p in models.param_names(i, m) if not p.requires_grad]
    assert all(ref.grads[n] is None for n in frozen)
    assert (name in ("transformer", "lora", "lora-last")) == bool(frozen)
    examples = models.stage_examples(a, batch, 2)
    for (_, outs), (ins, _) in zip(examples, examples[1:]):  # boundaries chain
        assert [o.shape for o in outs] == [i.shape for i in ins]
        # a frozen prefix hands on activations that need no grad (the point of the lora models)
        assert all(i.requires_grad for i in ins) or name in ("lora", "lora-last")


def test_lora_models_leave_every_stage_before_the_first_adapter_frozen() -> None:
    for name, first_trainable in (("lora", 1), ("lora-last", 3)):
        stages = models.build_stages(models.get_model(name), 4, seed=0)
        trains = [any(p.requires_grad for p in m.parameters()) for m in stages]
        assert trains == [i >= first_trainable for i in range(4)], name


def test_mean_reference_averages_the_shards_grads_and_keeps_its_own_losses() -> None:
    spec = models.get_model("mlp")
    stages = models.build_stages(spec, 2, seed=0)
    shards = [models.make_batch(spec, 2, seed=s) for s in (1, 2)]
    each = [models.reference_step(stages, shard, 2) for shard in shards]
    mean = models.mean_reference(stages, shards, 2, own=1)
    for name, grad in mean.grads.items():
        first, second = each[0].grads[name], each[1].grads[name]
        assert grad is not None and first is not None and second is not None, name
        assert torch.equal(grad, (first + second) / 2)
    assert [float(x) for x in mean.losses] == [float(x) for x in each[1].losses]


def test_sac_recompute_count_is_compared_per_data_parallel_shard() -> None:
    # with dp 2 the reference runs both shards on its modules: a rank runs one, so half the reference's count
    spec = models.get_model("sac")
    reference = models.build_stages(spec, 4, seed=0)
    rank: list[Any] = copy.deepcopy(reference)  # the zoo's counting modules (``runs``)
    shards = [models.make_batch(spec, 2, seed=s) for s in (1, 2)]
    for own in (0, 1):
        models.reference_step(rank, shards[own], 2)  # this rank's full backward of its own shard
        ref = models.mean_reference(reference, shards, 2, own=own)
        assert ref.shards == 2
        assert spec.side_effects(dict(enumerate(rank)), reference, 2, ref.shards) == []
        assert all(m.runs[0] == 0 for m in [*rank, *reference])  # every count reset
    models.reference_step(rank, shards[0], 2)
    rank[2].runs[0] += 1  # one recomputation more than a full backward
    ref = models.mean_reference(reference, shards, 2)
    (failure,) = spec.side_effects(dict(enumerate(rank)), reference, 2, ref.shards)
    assert failure.startswith("side effects: stage 2's checkpointed function ran ")
    assert models.mean_reference(reference, shards[:1], 2).shards == 1


def test_transformer_shares_a_parameter_between_two_ops_and_takes_a_non_tensor_kwarg() -> None:
    spec = models.get_model("transformer")
    stage = models.build_stages(spec, 2, seed=0)[1]
    kwargs = spec.make_kwargs()
    assert not any(isinstance(v, torch.Tensor) for v in kwargs.values())
    h = torch.randn(2, models.SEQ, models.D, requires_grad=True)
    out = stage(h, **kwargs)
    uses = 0
    seen, stack = set(), [out.grad_fn]
    while stack:  # count the graph's edges into gate's AccumulateGrad
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is stage.gate:
                uses += 1
            stack.append(nxt)
    assert uses == 2


# ----------------------------------------------------------------------------------------------------
# probes and comparison


def _ref_for(grads: dict[str, torch.Tensor | None], losses=None) -> models.ReferenceResult:
    return models.ReferenceResult(losses=losses or [], grads=grads)


def test_compare_flags_a_perturbed_grad_a_missing_grad_and_a_wrong_loss() -> None:
    lin = torch.nn.Linear(3, 3)
    lin(torch.randn(2, 3)).sum().backward()
    named = [(n, p.grad) for n, p in models.param_names(0, lin)]
    exact = {n: g.clone() for n, g in named}
    info, failures = probes.compare(named, _ref_for(exact, [torch.tensor(1.0)]), [1.0])
    assert failures == [] and info.params_compared == 2 and info.max_abs_grad_err == 0.0
    off = dict(exact)
    off["stage0.weight"] = exact["stage0.weight"] + 1e-3
    info, failures = probes.compare(named, _ref_for(off), None, step=1)
    (failure,) = failures
    assert info.grads_outside == 1
    assert failure.text.startswith("step 1: numerics: stage0.weight.grad: 9 of 9 elements outside tolerance")
    assert (failure.check, failure.kind) == ("numerics", "grads-wrong")
    within = dict(exact)
    within["stage0.weight"] = exact["stage0.weight"] * (1 + 1e-6)
    assert probes.compare(named, _ref_for(within), None)[1] == []
    missing = dict(exact, **{"stage0.bias": None})
    info, failures = probes.compare(named, _ref_for(missing), None)
    assert failures[0].message == "stage0.bias.grad is set in the pipeline but None in the reference"
    assert (info.grads_unexpected, info.grads_none, info.grads_outside, failures[0].kind) == (1, 0, 0, "grads-wrong")
    info, failures = probes.compare(named, _ref_for(exact, [torch.tensor(1.0)]), [1.001])
    assert failures[0].message == "loss of microbatch 0 = 1.001, reference 1.0" and info.losses_wrong == 1


@pytest.mark.parametrize(
    ("wrap", "grad_none", "kind"),
    [("fsdp", True, "fsdp-swap"), ("fsdp", False, "fsdp-swap"), ("fsdp-titan", True, "fsdp-loss-reshard"),
     ("fsdp-titan", False, "grads-wrong"), ("none", True, "grads-missing"), ("ddp", False, "grads-wrong")],
)
def test_a_numerics_failure_gets_its_kind_where_the_grads_are_compared(wrap: str, grad_none: bool, kind: str) -> None:
    lin = torch.nn.Linear(2, 2)
    lin(torch.randn(1, 2)).sum().backward()
    named = [(n, p.grad) for n, p in models.param_names(0, lin)]
    want = {n: g.clone() + 1.0 for n, g in named}
    if grad_none:
        named = [(n, None) for n, _ in named]
    info, failures = probes.compare(named, _ref_for(want), None, wrap=wrap, step=0)
    assert [f.kind for f in failures] == [kind, kind] and info.grads_none == (2 if grad_none else 0)


def _fake_stage(index: int, last: bool, **caches) -> types.SimpleNamespace:
    base: dict[str, Any] = {
        "fwd_cache": {}, "bwd_cache": {}, "backward_state": {}, "dw_runner": {}, "output_chunks": []
    }
    base.update(caches)
    return types.SimpleNamespace(stage_index=index, is_first=index == 0, is_last=last, **base)


def test_stage_caches_accept_torchs_tensor_free_leftovers_and_flag_anything_else() -> None:
    every_stage = probes.outputs_kept_on_every_stage()  # torch 2.5: every stage keeps its outputs
    kept = [torch.ones(1), torch.ones(1)] if every_stage else []
    ok = _fake_stage(0, False, bwd_cache={0: (None,), 1: ()}, dw_runner={0: lambda: None}, output_chunks=kept)
    assert probes.stage_caches(ok, 2)[1] == []
    last = _fake_stage(1, True, output_chunks=[torch.ones(1), torch.ones(1)])
    assert probes.stage_caches(last, 2)[1] == []
    t = torch.ones(1)
    bad = _fake_stage(
        1,
        False,
        fwd_cache={0: ((t,), [t])},
        bwd_cache={0: (t,)},
        dw_runner={0: lambda: t},
        output_chunks=[t],
    )
    failures = "\n".join(probes.stage_caches(bad, 2)[1])
    for expected in ("fwd_cache holds 1", "bwd_cache holds 1", "dw_runner placeholders hold 1 tensors",
                     "dw_runner holds closures", f"output_chunks holds 1 entries, expected {2 if every_stage else 0}"):
        assert expected in failures


def test_outputs_kept_on_every_stage_matches_the_releases_read() -> None:
    release = torch_release()[:2]
    if release == (2, 5):  # 2.5.1: forward_one_chunk appends unguarded
        assert probes.outputs_kept_on_every_stage() is True
    elif release >= (2, 13):  # 2.13.0, 2.14.1: `if self.is_last and save_forward_output:`
        assert probes.outputs_kept_on_every_stage() is False
    else:
        pytest.skip(f"torch {torch.__version__}: forward_one_chunk's output_chunks rule not read for this release")


@pytest.mark.parametrize("with_flag", [True, False], ids=["is_root_arg-False", "torch-2.5-RecvInfo"])
def test_activation_probe_counts_what_releasing_the_receive_buffers_frees(with_flag: bool) -> None:
    buffer = torch.randn(2, 4).requires_grad_()
    flag = {"is_root_arg": False} if with_flag else {}
    info = types.SimpleNamespace(buffer=buffer, **flag)
    del buffer
    stage = types.SimpleNamespace(args_recv_info={0: (info,)})
    lin = torch.nn.Linear(4, 4)
    probe = probes.ActivationProbe()
    with probe.record():
        out = lin(info.buffer).relu()
    out.sum().backward()
    del out
    probe.after_clear()
    assert probe.release_recv_buffers([stage]) == 1
    probe.after_gc()
    result = probe.to_record()
    assert result.kept_by_design.recv_buffer == 1  # Linear saved its input, the receive buffer
    assert (result.freed_only_by_gc, result.held_after_gc) == (0, 0)


def test_garbage_probe_keeps_the_chains_as_text_and_leaves_no_graph_folder(tmp_path: Path, monkeypatch) -> None:
    """A worker's leak (torch's backward, in check and the torchrun matrix) used to leave a
    ``ppbackward-leaks-*`` folder of graph files in the system temp dir that nothing read."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with probes.garbage_probe() as found:
        holder: list = [torch.ones(3, requires_grad=True) * 2]
        holder.append(holder)  # a cycle holding a tensor with a graph
        del holder
    (garbage,) = found
    assert garbage.tensors == 1 and not garbage.ok
    assert garbage.chains and garbage.chains[0].startswith("[0] Tensor float32[3]")
    assert list(tmp_path.iterdir()) == []


def test_hook_counter_counts_post_accumulate_calls_and_removes_its_hooks() -> None:
    lin = torch.nn.Linear(2, 2)
    lin.bias.requires_grad_(False)
    counter = probes.HookCounter(models.param_names(0, lin))
    assert list(counter.calls) == ["stage0.weight"]
    for _ in range(2):
        lin(torch.ones(1, 2)).sum().backward()
    assert counter.calls == {"stage0.weight": 2}
    counter.remove()
    lin(torch.ones(1, 2)).sum().backward()
    assert counter.calls == {"stage0.weight": 2}


def _b_through_the_stage_module(module: torch.nn.Module) -> None:
    """One B as torch's stage calls it: through ``pipelining.stage``'s ``stage_backward_input``."""
    from torch.distributed.pipelining import stage as stage_mod

    x = torch.randn(2, models.D, requires_grad=True)
    _, groups = stage_mod.stage_backward_input([module(x).sum()], None, [x], iter(list(module.parameters())))
    del groups  # W never runs: B's param groups let go of what they held


@pytest.mark.parametrize("compiled_before_install", [False, True], ids=["split", "run-whole"])
def test_regions_probe_counts_the_regions_each_b_split_and_flags_one_run_whole(compiled_before_install: bool) -> None:
    """Note [regions counted]; the negative control: a region whose backward was compiled before install
    runs whole in B (exact), which the probe must report as ``regions-whole``."""
    import torch._dynamo
    from torch.distributed.pipelining import stage as stage_mod

    import ppbackward
    from ppbackward import _compiled

    if not _compiled.support().ok:
        pytest.skip(f"no split here: {_compiled.support().why}")
    ppbackward.uninstall()
    torch._dynamo.reset()
    spec = models.get_model("compiled-blocks")
    module = spec.prepare(models.build_stages(spec, 2, seed=0)[1])
    if compiled_before_install:
        module(torch.randn(2, models.D, requires_grad=True)).sum().backward()  # forward and backward compiled
    try:
        with ppbackward.installed():
            probe, step = probes.RegionsProbe(models.BLOCKS), runner.StepRun(0)
            real = stage_mod.stage_backward_input
            probe.before(step)
            assert stage_mod.stage_backward_input is not real
            for _ in range(2):
                _b_through_the_stage_module(module)
            probe.after_step(step)
            assert stage_mod.stage_backward_input is real  # put back
            record, failures = probe.finish(step)
    finally:
        torch._dynamo.reset()
    if compiled_before_install:
        assert (record.b_calls, record.b_split, record.regions, record.fewest, record.most) == (2, 0, 0, 0, 0)
        (failure,) = failures
        assert (failure.check, failure.kind, failure.step) == ("regions", "regions-whole", 0)
        assert failure.message.startswith("2 of 2 B calls split 0 compiled regions, 2 expected")
    else:
        assert record == RegionsRecord(b_calls=2, b_split=2, regions=4, fewest=2, most=2, expected=2, counted=True)
        assert failures == []


def test_regions_probe_counts_nothing_in_torchs_param_groups_and_judges_nothing_unexpected() -> None:
    import ppbackward

    ppbackward.uninstall()  # torch's own B: its param groups are dicts, which do not say
    eager = models.build_stages(models.get_model("compiled-blocks"), 2, seed=0)[1]
    probe, step = probes.RegionsProbe(models.BLOCKS), runner.StepRun(1)
    probe.before(step)
    try:
        _b_through_the_stage_module(eager)
    finally:
        probe.close()
    record, failures = probe.finish(step)
    assert (record.b_calls, record.counted, failures) == (1, False, [])
    with ppbackward.installed():  # an eager stage under ppbackward: counted, 0 regions, judged only if expected
        probe = probes.RegionsProbe(0)
        probe.before(step)
        _b_through_the_stage_module(eager)
        probe.after_step(step)
    record, failures = probe.finish(step)
    assert (record.b_calls, record.counted, record.regions, record.expected, failures) == (1, True, 0, 0, [])


def test_compiled_blocks_are_compiled_children_named_as_their_eager_reference() -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    spec = models.get_model("compiled-blocks")
    eager, compiled = models.build_stages(spec, 2, seed=0)[1], models.build_stages(spec, 2, seed=0)[1]
    spec.prepare(compiled)
    blocks = list(compiled.get_submodule("blocks").children())
    assert all(isinstance(b, OptimizedModule) for b in blocks) and len(blocks) == models.BLOCKS
    assert [n for n, _ in models.param_names(1, compiled)] == [n for n, _ in models.param_names(1, eager)]
    assert spec.regions_per_b == models.BLOCKS and models.get_model("compiled").regions_per_b == 1
    assert models.get_model("mlp").regions_per_b == 0  # nothing counted: no regions probe
    assert "_orig_mod." in next(n for n, _ in compiled.named_parameters())


def test_start_step_gives_args_to_the_first_stage_and_the_target_to_the_last_and_resets_grads() -> None:
    lin = torch.nn.Linear(2, 2)
    named = models.param_names(0, lin)
    batch = models.Batch(args=(torch.ones(2, 2),), kwargs={"mask": "m"}, target=torch.zeros(2, 2))
    for first, last in ((True, False), (False, True), (True, True), (False, False)):
        stage = types.SimpleNamespace(is_first=first, is_last=last)
        case = runner.CaseRun(None, [stage], {0: lin}, named, models.get_model("mlp"), 2, probes.CHECK_TOLERANCE)
        hooks = probes.HooksProbe(case)
        try:
            lin(torch.ones(1, 2)).sum().backward()
            assert lin.weight.grad is not None and hooks.counter.calls["stage0.weight"] == 1
            args, kwargs = runner.start_step(case, batch)
            assert args == (batch.args if first else ())
            assert kwargs == ({"mask": "m", "target": batch.target} if last else {"mask": "m"})
            assert lin.weight.grad is None and lin.bias.grad is None
            hooks.before(runner.StepRun(0))
            assert set(hooks.counter.calls.values()) == {0}
        finally:
            hooks.close()


def test_select_backward_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown --backward"):
        worker.select_backward("nonsense")


# ----------------------------------------------------------------------------------------------------
# failure formatting


def _result(tmp_path: Path, verdicts: dict[int, RankVerdict | None], **kw) -> LaunchResult:
    defaults: dict[str, Any] = dict(command=["torchrun"], out_dir=tmp_path, world_size=len(verdicts), returncode=0,
                                    timeout=10.0, seconds=1.0, verdicts=verdicts)
    defaults.update(kw)
    return LaunchResult(**defaults)


def _verdict(rank: int, *cases: CaseRecord, complete: bool = True, backward: str = "ppbackward") -> RankVerdict:
    return RankVerdict(rank, 2, backward, complete=complete, cases=list(cases))


def test_failures_are_one_block_per_case_with_failing_ranks_details_and_log(tmp_path: Path) -> None:
    ok = _verdict(0, CaseRecord("S/m", stages=[0]), CaseRecord("S/x", stages=[0]))
    boom = Failure("exception", "other", "RuntimeError: boom", raised="RuntimeError")
    bad = _verdict(1, CaseRecord("S/m", stages=[0]), CaseRecord(
        "S/x", status="error", stages=[0], failures=[boom], error="Traceback ...\nRuntimeError: boom"
    ))
    log = tmp_path / "rank1.log"
    events = EventWriter(tmp_path, 1, log=log)
    events.emit("started")
    events.emit("case_start", case="S/m")
    log.write_text("[rank 1] case S/m\n[rank 1] S/m: pass\n")
    events.emit("case_end", case="S/m", record=bad.cases[0])
    events.emit("case_start", case="S/x")
    with log.open("a") as f:
        f.write("[rank 1] case S/x\nboom happened\n")
    events.close()
    result = _result(tmp_path, {0: ok, 1: bad})
    assert result.complete and not result.ok
    assert result.case_status("S/m") == "pass" and result.case_status("S/x") == "fail"
    text = result.format_failures()
    assert text.count("=== ") == 1 and "=== S/x (world size 2, backward=ppbackward) ===" in text
    assert "rank 0 [stages 0]: pass" in text and "rank 1 [stages 0]: error" in text
    assert "exception: RuntimeError: boom" in text and "boom happened" in text
    # only the failing case's part of the log (from its events' log offsets)
    assert "case S/m" not in text and "case S/x" in text


def test_a_missing_verdict_and_a_timeout_are_launch_problems_with_log_tails(tmp_path: Path) -> None:
    (tmp_path / "rank1.log").write_text("stuck here\n")
    verdict = _verdict(0, complete=False, backward="upstream")
    result = _result(tmp_path, {0: verdict, 1: None}, returncode=-9, hang="progress")
    problems = "\n".join(result.launch_problems())
    assert "timed out: no rank made progress for 10s after every rank had started" in problems
    assert "rank 1 wrote no verdict" in problems and "rank 0 did not finish its cases" in problems
    text = result.format_failures()
    assert "stuck here" in text and "command: torchrun" in text


def test_a_rank_that_never_started_is_a_start_up_timeout(tmp_path: Path) -> None:
    result = _result(tmp_path, {0: _verdict(0, complete=False), 1: None}, returncode=-9,
                     hang="startup", startup_timeout=300.0)
    problems = "\n".join(result.launch_problems())
    assert "timed out: rank(s) 1 had not started 300s after the launch" in problems


def test_first_line_of_an_exception_is_cut_with_an_ellipsis() -> None:
    short = worker._first_line(RuntimeError("short\nsecond line"))
    assert short == "RuntimeError: short"
    cut = worker._first_line(RuntimeError("x" * 500))
    assert cut.endswith("...") and len(cut) == len("RuntimeError: ") + worker._MESSAGE_CHARS


def test_one_rank_skips_multi_stage_schedules_only_where_torch_cannot_hand_over_locally() -> None:
    release = torch_release()[:2]
    for case in schedules.matrix(1):
        if case.rule is None or case.name not in schedules.discover():
            continue
        local = case.rule.stages_per_rank == 1 or release >= (2, 12)
        assert (case.skip is None) is local, (case.name, case.skip)
        if not local:
            assert "gloo cannot send to its own rank" in (case.skip or "")


# ----------------------------------------------------------------------------------------------------
# scenarios, data-parallel layout, diagnosis


def test_scenarios_select_default_all_and_names_and_refuse_unknown_ones() -> None:
    from ppbackward._tools.harness import scenarios

    assert [s.name for s in scenarios.select("default")] == list(scenarios.DEFAULT)
    assert len(scenarios.select("all")) == len(scenarios.SCENARIOS)
    ddp = scenarios.select("ddp")[0]
    assert ddp.worker_args() == ["--models", "mlp", "--dp", "2", "--wraps", "ddp"]
    assert ddp.layout == "4 ranks: dp 2 x pp 2"
    with pytest.raises(ValueError, match=r"unknown scenario.s. nope; known: transformer"):
        scenarios.select("lora,nope")
    for scenario in scenarios.SCENARIOS.values():  # every scenario names real models, wrappers and schedules
        assert models.model_names(",".join(scenario.models)) == list(scenario.models)
        assert set(scenario.wraps) <= set(parallel.WRAPS) and scenario.nproc % scenario.dp == 0
        assert set(scenario.schedules or ()) <= set(schedules.RULES)
    compiled = scenarios.select("compiled-zb")[0]  # issue 37: the zero-bubble schedules only
    zb = ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"]
    assert compiled.models == ("compiled-blocks",) and compiled.schedules_within(None) == zb
    assert compiled.schedules_within(["ScheduleGPipe", "ScheduleZBVZeroBubble"]) == ["ScheduleZBVZeroBubble"]
    assert compiled.schedules_within(["ScheduleGPipe"]) == []
    assert ddp.schedules_within(["ScheduleGPipe"]) == ["ScheduleGPipe"]
    assert ddp.schedules_within(None) is None


def test_layout_puts_each_rank_on_one_dp_x_pp_coordinate() -> None:
    layout = parallel.Layout(2, 2)
    assert [layout.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    assert parallel.wrap(frozen, "ddp", parallel.Groups(None, None, None, [])) is frozen  # nothing to reduce
    with pytest.raises(ValueError, match="--wraps ddp needs --dp 2"):
        parallel.wrap(torch.nn.Linear(2, 2), "ddp", parallel.Groups(None, None, None, []))


def _raised(exc: BaseException) -> Failure:
    try:
        raise exc
    except BaseException as e:
        return worker._exception_failure(e)[0]


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("Trying to backward through the graph a second time (or ...", "shared-parameter"),
        ("Can't detach views in-place. Use detach() instead ...", "view-output"),
        ("rebuilt parameter indices size is not same as original model parameters size.", "ddp-shape-inference"),
        ("The ScheduleZBVZeroBubble schedule is not supported with stage modules that have used torch.compile. "
         "Found OptimizedModule in OptimizedModule", "compile-refused"),
        ("[gloo] Timed out waiting 6000ms for recv operation to complete", "peer-failed"),
        ("[gloo] Connection closed by peer [127.0.0.1]:14546. This is typically ...", "peer-failed"),
        ("never seen before", "other"),
    ],
)
def test_an_exceptions_kind_is_set_where_it_is_caught(message: str, kind: str) -> None:
    failure = _raised(RuntimeError(message))
    assert (failure.check, failure.kind, failure.raised) == ("exception", kind, "RuntimeError")
    assert failure.text == f"exception: RuntimeError: {message.splitlines()[0]}"


def test_ddp_shape_inference_is_named_from_torchs_message_in_the_whole_traceback() -> None:
    # the failure line loses DDP's message to the cut (Note [DDP and shape inference]); the chain has it
    ddp = ("false INTERNAL ASSERT FAILED at reducer.cpp:1, please report a bug to PyTorch.\n" + "x" * 300 +
           "\nrebuilt parameter indices size is not same as original model parameters size.")
    try:
        try:
            raise RuntimeError(ddp)
        except RuntimeError as inner:
            raise RuntimeError("[Stage 1] failed to run forward") from inner
    except RuntimeError as e:
        failure, _ = worker._exception_failure(e)
    assert failure.kind == "ddp-shape-inference" and "rebuilt parameter" not in failure.message
    # only in the traceback (a message torch formatted into it, not an exception's own): still found
    assert worker._exception_kind(RuntimeError("x"), "Traceback ...\n" + ddp) == "ddp-shape-inference"
    assert worker._exception_kind(RuntimeError("x"), "Traceback ...\nRuntimeError: something else\n") == "other"
    # a kind that is not in_traceback is never read from the traceback
    assert worker._exception_kind(RuntimeError("x"), "Traceback ...\nCan't detach views in-place") == "other"


@pytest.mark.parametrize("key", [kind.key for kind in diagnose.KINDS])
def test_every_kind_is_named_with_its_label_and_reason(key: str) -> None:
    record = CaseRecord("S/m", status="fail", failures=[Failure("hooks", key, "a message", 0)])
    (finding,) = diagnose.diagnose(record)
    assert finding.kind.key == key and finding.line == f"{finding.kind.label}: {finding.kind.reason}"
    assert finding.example == "step 0: hooks: a message"


def test_an_other_failure_is_shown_as_recorded() -> None:
    raised = Failure("exception", "other", "ValueError: never seen before", raised="ValueError")
    case = Failure("case", "other", "no placement rule for ScheduleX")
    findings = diagnose.diagnose(CaseRecord("S/m", status="error", failures=[raised, case]))
    assert [f.line for f in findings] == ["ValueError: never seen before", "no placement rule for ScheduleX"]
    with pytest.raises(KeyError, match="unknown failure kind 'nope'; known: shared-parameter, "):
        diagnose.diagnose(CaseRecord("S/m", status="fail", failures=[Failure("hooks", "nope", "m", 0)]))


def test_a_failures_kind_comes_from_the_record_not_from_its_text() -> None:
    """The message reads like a missing grad under FSDP2 (what the prose parser of issue 30 matched);
    the record says hooks-skipped, and that is what the finding names."""
    fake = Failure("numerics", "hooks-skipped", "stage1.w.grad is None in the pipeline but set in the reference", 0)
    record = CaseRecord("S/m", wrap="fsdp-titan", status="fail", failures=[fake])
    assert [f.kind.key for f in diagnose.diagnose(record)] == ["hooks-skipped"]


def test_order_ranks_every_kind_as_kinds_lists_them() -> None:
    assert list(diagnose.ORDER) == [kind.key for kind in diagnose.KINDS]
    assert sorted(diagnose.ORDER.values()) == list(range(len(diagnose.KINDS)))


def test_findings_come_most_telling_first_and_once_per_kind() -> None:
    failures = [Failure("hooks", "hooks-skipped", "a", 0), Failure("numerics", "grads-wrong", "x outside", 0),
                Failure("replicas", "ddp-replicas", "r", 0), Failure("hooks", "hooks-skipped", "b", 1)]
    findings = diagnose.diagnose(CaseRecord("S/m", wrap="ddp", status="fail", failures=failures))
    assert [(f.kind.key, f.example) for f in findings] == [
        ("ddp-replicas", "step 0: replicas: r"), ("grads-wrong", "step 0: numerics: x outside"),
        ("hooks-skipped", "step 0: hooks: a"),
    ]
    assert diagnose.diagnose(CaseRecord("S/m")) == []


def test_progress_reports_a_case_once_every_rank_has_it_and_says_what_runs_meanwhile(tmp_path: Path) -> None:
    """Issue 23: progress came from rank 0 alone (``lora-last pass`` over a failing row) and froze 20-29 s
    with no word of why (Note [progress says what runs]); no process, a fake clock: no timing involved."""
    from ppbackward._tools.harness.launch import _CaseReporter

    now = [0.0]
    seen: list[tuple[str, dict]] = []
    said: list[str] = []
    reporter = _CaseReporter(tmp_path, 2, lambda c, r: seen.append((c, r)), said.append, quiet_s=10.0,
                             clock=lambda: now[0])

    writers = {r: EventWriter(tmp_path, r) for r in range(2)}
    now[0] = 10.0
    reporter.poll()
    assert said == ["starting: 0/2 ranks have joined the process group"]
    writers[0].emit("started")
    writers[1].emit("started")
    writers[0].emit("case_start", case="ScheduleGPipe/lora-last")
    now[0] = 15.0
    reporter.poll()
    assert len(said) == 1  # not quiet long enough yet
    now[0] = 20.0
    reporter.poll()
    assert said[-1] == "still running ScheduleGPipe/lora-last (rank 0; 0 case(s) done)"
    writers[0].emit("case_end", case="ScheduleGPipe/lora-last", record=CaseRecord("ScheduleGPipe/lora-last"))
    reporter.poll()
    assert seen == []  # rank 1 is still on it
    failed = CaseRecord("ScheduleGPipe/lora-last", status="fail", failures=[Failure("hooks", "hooks-skipped", "h", 0)])
    writers[1].emit("case_end", case="ScheduleGPipe/lora-last", record=failed)
    reporter.poll()
    reporter.poll()
    assert [(c, {r: v.status for r, v in per.items()}) for c, per in seen] == [
        ("ScheduleGPipe/lora-last", {0: "pass", 1: "fail"})
    ]  # once, with every rank's record
    assert seen[0][1][1] == failed
    now[0] = 25.0
    reporter.poll()
    assert len(said) == 2  # a finished case restarted the quiet clock
    assert (reporter.started, reporter.events) == (2, 5)


def test_an_event_line_is_read_once_its_newline_is_there(tmp_path: Path) -> None:
    reader = EventReader(tmp_path, 0)
    assert reader.poll() == []  # no stream yet
    line = json.dumps(to_json(Event("started", 0, 1.0)))
    path = tmp_path / "rank0.events.jsonl"
    path.write_text(line[:10])
    assert reader.poll() == []
    path.write_text(line + "\n")
    assert reader.poll() == [Event("started", 0, 1.0)] and reader.poll() == []


def test_titan_chunked_loss_equals_the_unchunked_cross_entropy() -> None:
    """torchtitan's chunked loss (issue 20): the loss and every grad (lm_head's accumulated inside the
    loss, the rest through the custom Function) equal plain autograd of the whole cross-entropy."""
    import torch.nn.functional as F

    spec = models.get_model("titan")
    chunked, plain = models.build_stages(spec, 2, seed=3), models.build_stages(spec, 2, seed=3)
    head: Any = plain[1]  # the zoo's titan head stage (``lm_head``)
    batch = models.make_batch(spec, 1, seed=4)
    ref = models.reference_step(chunked, batch, 1, spec.loss_of(chunked[-1]))
    h = plain[1](plain[0](*batch.args))
    want = batch.target.flatten(0, 1).softmax(-1)
    loss = F.cross_entropy(head.lm_head(h).flatten(0, 1), want, reduction="sum")
    loss.backward()
    assert torch.allclose(ref.losses[0], loss.detach())
    for i, module in enumerate(plain):
        for name, p in models.param_names(i, module):
            want_grad, got = ref.grads[name], p.grad
            assert want_grad is not None and got is not None, name
            assert torch.allclose(want_grad, got, atol=1e-6), name
    assert ref.grads["stage1.norm.weight"] is not None


def test_a_model_name_is_not_shadowed_by_a_group() -> None:
    for name in models.MODELS:
        assert models.model_names(name) == [name]


def test_errors_a_worker_printed_before_its_own_log_are_shown(tmp_path: Path) -> None:
    """A bad worker argument fails before a rank has a log: the error is in torchrun's log only, above the
    summary its tail shows (hostile review). The elastic summary's own lines are not errors of the ranks."""
    from ppbackward._tools.harness.launch import _errors_before_rank_logs

    log = tmp_path / "torchrun.log"
    log.write_text(
        "usage: python -m worker [-h] --out OUT\n"
        "python -m worker: error: unrecognized arguments: junk\n"
        "python -m worker: error: unrecognized arguments: junk\n"
        "Traceback (most recent call last):\n"
        '  File "/x/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper\n'
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "  error_file: <N/A>\n"
        "ModuleNotFoundError: No module named 'nope'\n"
    )
    assert _errors_before_rank_logs(log).splitlines() == [
        "python -m worker: error: unrecognized arguments: junk",
        "ModuleNotFoundError: No module named 'nope'",
    ]
    assert _errors_before_rank_logs(tmp_path / "missing.log") == ""


_TERMINATE_PROBE = """
import os, signal, sys, threading
from ppbackward._tools.torchrun import terminate_raises

def code_of(block):
    try:
        block()
    except SystemExit as e:
        return e.code
    return None

def term_twice():
    with terminate_raises():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(60)
        except SystemExit:
            os.kill(os.getpid(), signal.SIGTERM)  # during the clean-up: ignored, it must not cut it short
            os.kill(os.getpid(), signal.SIGHUP)
            raise

def nested():
    with terminate_raises(), terminate_raises():
        os.kill(os.getpid(), signal.SIGHUP)
        threading.Event().wait(60)

print(code_of(term_twice), code_of(nested), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
      signal.getsignal(signal.SIGHUP) is signal.SIG_DFL)
mine = lambda signum, frame: print("caller's handler", signum)
signal.signal(signal.SIGTERM, mine)
with terminate_raises():
    os.kill(os.getpid(), signal.SIGTERM)
print(signal.getsignal(signal.SIGTERM) is mine)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
seen = []
def off_main():
    with terminate_raises():
        seen.append(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
worker = threading.Thread(target=off_main)
worker.start()
worker.join()
print(seen)
"""


def test_sigterm_raises_system_exit_only_while_a_launch_is_supervised() -> None:
    """Note [a terminated launcher stops its launch]: SIGTERM's default action killed the launcher with no
    clean-up, leaving torchrun and its ranks running (hostile review). Inside ``terminate_raises`` SIGTERM and
    SIGHUP raise ``SystemExit(128 + signal)`` once (a second signal during the clean-up is ignored), nested use
    keeps the outer handler, a caller's own handler is left alone, a thread other than the main one changes
    nothing, and the default comes back after. In a child process: a regression kills it, not pytest."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _TERMINATE_PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["143 129 True True", "caller's handler 15", "True", "[True]"], proc.stdout
