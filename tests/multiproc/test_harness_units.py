"""The harness's pieces, without any process group or subprocess (layer 1 of ``conftest.py``)."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import pytest
import torch

from ppbackward._compat import torch_release
from ppbackward._tools.harness import models, parallel, probes, schedules, worker
from ppbackward._tools.harness.launch import LaunchResult

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
        assert torch.equal(grad, (each[0].grads[name] + each[1].grads[name]) / 2)
    assert [float(x) for x in mean.losses] == [float(x) for x in each[1].losses]


def test_sac_recompute_count_is_compared_per_data_parallel_shard() -> None:
    # with dp 2 the reference runs both shards on its modules: a rank runs one, so half the reference's count
    spec = models.get_model("sac")
    reference = models.build_stages(spec, 4, seed=0)
    rank = copy.deepcopy(reference)
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
    info, failures = worker._compare(named, _ref_for(exact, [torch.tensor(1.0)]), [1.0])
    assert failures == [] and info["params_compared"] == 2 and info["max_abs_grad_err"] == 0.0
    off = dict(exact)
    off["stage0.weight"] = exact["stage0.weight"] + 1e-3
    _, failures = worker._compare(named, _ref_for(off), None)
    assert len(failures) == 1 and "stage0.weight.grad: 9 of 9 elements outside tolerance" in failures[0]
    within = dict(exact)
    within["stage0.weight"] = exact["stage0.weight"] * (1 + 1e-6)
    assert worker._compare(named, _ref_for(within), None)[1] == []
    missing = dict(exact, **{"stage0.bias": None})
    assert "None in the reference" in worker._compare(named, _ref_for(missing), None)[1][0]
    _, failures = worker._compare(named, _ref_for(exact, [torch.tensor(1.0)]), [1.001])
    assert failures and "loss of microbatch 0" in failures[0]


def _fake_stage(index: int, last: bool, **caches) -> types.SimpleNamespace:
    base = {"fwd_cache": {}, "bwd_cache": {}, "backward_state": {}, "dw_runner": {}, "output_chunks": []}
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
    result = probe.to_dict()
    assert result["kept_by_design"]["recv_buffer"] == 1  # Linear saved its input, the receive buffer
    assert (result["freed_only_by_gc"], result["held_after_gc"]) == (0, 0)


def test_garbage_probe_keeps_the_chains_as_text_and_leaves_no_graph_folder(tmp_path: Path, monkeypatch) -> None:
    """A worker's leak (torch's backward, in check and the torchrun matrix) used to leave a
    ``ppbackward-leaks-*`` folder of graph files in the system temp dir that nothing read."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with probes.garbage_probe() as garbage:
        holder: list = [torch.ones(3, requires_grad=True) * 2]
        holder.append(holder)  # a cycle holding a tensor with a graph
        del holder
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


def test_start_step_gives_args_to_the_first_stage_and_the_target_to_the_last_and_resets_grads() -> None:
    lin = torch.nn.Linear(2, 2)
    named = models.param_names(0, lin)
    hooks = probes.HookCounter(named)
    batch = models.Batch(args=(torch.ones(2, 2),), kwargs={"mask": "m"}, target=torch.zeros(2, 2))
    try:
        for first, last in ((True, False), (False, True), (True, True), (False, False)):
            stage = types.SimpleNamespace(is_first=first, is_last=last)
            ctx = worker.StepContext([stage], {0: lin}, named, hooks, models.get_model("mlp"), 2)
            lin(torch.ones(1, 2)).sum().backward()
            assert lin.weight.grad is not None and hooks.calls["stage0.weight"] == 1
            args, kwargs = worker._start_step(ctx, batch)
            assert args == (batch.args if first else ())
            assert kwargs == ({"mask": "m", "target": batch.target} if last else {"mask": "m"})
            assert lin.weight.grad is None and lin.bias.grad is None and set(hooks.calls.values()) == {0}
    finally:
        hooks.remove()


def test_select_backward_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown --backward"):
        worker.select_backward("nonsense")


# ----------------------------------------------------------------------------------------------------
# failure formatting


def _result(tmp_path: Path, verdicts: dict[int, dict | None], **kw) -> LaunchResult:
    for rank, verdict in verdicts.items():
        if verdict is not None:
            (tmp_path / f"rank{rank}.json").write_text(json.dumps(verdict))
    defaults = dict(command=["torchrun"], out_dir=tmp_path, world_size=len(verdicts), returncode=0,
                    timeout=10.0, seconds=1.0, verdicts=verdicts)
    defaults.update(kw)
    return LaunchResult(**defaults)


def _record(case_id: str, status: str, **extra) -> dict:
    return {"id": case_id, "status": status, "stages": [0], "failures": [], "steps": [], **extra}


def test_failures_are_one_block_per_case_with_failing_ranks_details_and_log(tmp_path: Path) -> None:
    ok = {"complete": True, "backward": "ppbackward", "cases": [_record("S/m", "pass"), _record("S/x", "pass")]}
    bad = {
        "complete": True,
        "backward": "ppbackward",
        "cases": [
            _record("S/m", "pass"),
            _record(
                "S/x", "error", failures=["exception: RuntimeError: boom"], error="Traceback ...\nRuntimeError: boom"
            ),
        ],
    }
    (tmp_path / "rank1.log").write_text("[rank 1] >>> S/m\n[rank 1] S/m: pass\n[rank 1] >>> S/x\nboom happened\n")
    result = _result(tmp_path, {0: ok, 1: bad})
    assert result.complete and not result.ok
    assert result.case_status("S/m") == "pass" and result.case_status("S/x") == "fail"
    text = result.format_failures()
    assert text.count("=== ") == 1 and "=== S/x (world size 2, backward=ppbackward) ===" in text
    assert "rank 0 [stages 0]: pass" in text and "rank 1 [stages 0]: error" in text
    assert "RuntimeError: boom" in text and "boom happened" in text
    assert ">>> S/m" not in text  # only the failing case's part of the log


def test_a_missing_verdict_and_a_timeout_are_launch_problems_with_log_tails(tmp_path: Path) -> None:
    (tmp_path / "rank1.log").write_text("stuck here\n")
    verdict = {"complete": False, "backward": "upstream", "cases": []}
    result = _result(tmp_path, {0: verdict, 1: None}, returncode=-9, hang="progress")
    problems = "\n".join(result.launch_problems())
    assert "timed out: no rank made progress for 10s after every rank had started" in problems
    assert "rank 1 wrote no verdict" in problems and "rank 0 did not finish its cases" in problems
    text = result.format_failures()
    assert "stuck here" in text and "command: torchrun" in text


def test_a_rank_that_never_started_is_a_start_up_timeout(tmp_path: Path) -> None:
    result = _result(tmp_path, {0: {"complete": False, "cases": []}, 1: None}, returncode=-9,
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
            assert "gloo cannot send to its own rank" in case.skip


# ----------------------------------------------------------------------------------------------------
# scenarios, data-parallel layout, diagnosis


def test_scenarios_select_default_all_and_names_and_refuse_unknown_ones() -> None:
    from ppbackward._tools.harness import scenarios

    assert [s.name for s in scenarios.select("default")] == list(scenarios.DEFAULT)
    assert len(scenarios.select("all")) == len(scenarios.SCENARIOS)
    ddp = scenarios.select("ddp")[0]
    assert ddp.worker_args() == ["--models", "mlp", "--dp", "2", "--wraps", "ddp"] and ddp.layout == "4 ranks: dp 2 x pp 2"
    with pytest.raises(ValueError, match="unknown scenario.s. nope; known: transformer"):
        scenarios.select("lora,nope")
    for scenario in scenarios.SCENARIOS.values():  # every scenario names real models and wrappers
        assert models.model_names(",".join(scenario.models)) == list(scenario.models)
        assert set(scenario.wraps) <= set(parallel.WRAPS) and scenario.nproc % scenario.dp == 0


def test_layout_puts_each_rank_on_one_dp_x_pp_coordinate() -> None:
    layout = parallel.Layout(2, 2)
    assert [layout.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    assert parallel.wrap(frozen, "ddp", parallel.Groups(None, None, None, [])) is frozen  # nothing to reduce
    with pytest.raises(ValueError, match="--wraps ddp needs --dp 2"):
        parallel.wrap(torch.nn.Linear(2, 2), "ddp", parallel.Groups(None, None, None, []))


@pytest.mark.parametrize(
    ("failure", "wrap", "kind"),
    [
        ("exception: RuntimeError: Trying to backward through the graph a second time (or ...", "none", "shared-parameter"),
        ("exception: RuntimeError: Can't detach views in-place. Use detach() instead ...", "none", "view-output"),
        ("exception: RuntimeError: rebuilt parameter indices size is not same as original model parameters size.", "ddp",
         "ddp-shape-inference"),
        ("exception: RuntimeError: [gloo] Timed out waiting 6000ms for recv operation to complete", "none", "peer-failed"),
        ("exception: RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:14546. This is typically ...", "none",
         "peer-failed"),
        ("step 0: replicas: the dp replicas' gradients differ (...)", "ddp", "ddp-replicas"),
        ("step 0: numerics: stage1.w.grad: 4 of 4 elements outside tolerance (...)", "fsdp", "fsdp-swap"),
        ("step 0: numerics: stage1.w.grad is None in the pipeline but set in the reference", "fsdp-keep", "grads-missing"),
        ("step 0: numerics: stage1.w.grad: 4 of 4 elements outside tolerance (...)", "none", "grads-wrong"),
        ("step 1: side effects: stage 3's custom Function backward ran 8 times ...", "none", "side-effects-twice"),
        ("step 0: hooks: post-accumulate-grad hooks fired 0 times, expected 8 (...)", "none", "hooks-skipped"),
        ("step 0: garbage: 1 tensors and 1 autograd nodes in reference cycles after the step (...)", "none", "reference-cycle"),
        ("step 0: lifetime: 2 saved activations (64 B) outlived the step and were freed only by a gc run", "none", "reference-cycle"),
        ("step 0: lifetime: 2 saved activations (64 B) still alive after clear_runtime_states() ...", "none", "held-activations"),
        ("step 0: caches: stage 1: fwd_cache holds 2 entries after the step", "none", "stage-caches"),
        ("exception: ValueError: never seen before", "none", "other"),
    ],
)
def test_every_kind_of_failure_is_named(failure: str, wrap: str, kind: str) -> None:
    from ppbackward._tools.harness import diagnose

    record = {"failures": [failure], "wrap": wrap}
    assert diagnose.kind_of(failure, record) == kind
    (finding,) = diagnose.diagnose(record)
    assert finding.kind.key == kind
    assert finding.line == (failure.removeprefix("exception: ") if kind == "other" else f"{finding.kind.label}: {finding.kind.reason}")


def test_ddp_shape_inference_is_named_from_torchs_message_in_the_whole_traceback() -> None:
    from ppbackward._tools.harness import diagnose

    # the failure line lost DDP's message to the cut (Note [DDP and shape inference]); the traceback has it
    failure = "exception: RuntimeError: [Stage 1] failed to run forward: ... (caused by RuntimeError: false INTERNAL ..."
    error = (
        "Traceback (most recent call last):\n  ...\nRuntimeError: false INTERNAL ASSERT FAILED at reducer.cpp:1, please "
        "report a bug to PyTorch. rebuilt parameter indices size is not same as original model parameters size."
        "Original model param size is: 4 versus rebuilt params size of: 2\n"
    )
    record = {"status": "error", "failures": [failure], "error": error, "wrap": "ddp"}
    assert diagnose.kind_of(failure, record) == "ddp-shape-inference"
    assert [f.kind.key for f in diagnose.diagnose(record)] == ["ddp-shape-inference"]
    assert diagnose.kind_of(failure, {**record, "error": "Traceback ...\nRuntimeError: something else\n"}) == "other"
    # a check failure is no exception, whatever traceback the record holds
    assert diagnose.kind_of("step 1: caches: x", record) == "stage-caches"


def test_order_ranks_every_kind_as_kinds_lists_them() -> None:
    from ppbackward._tools.harness import diagnose

    assert list(diagnose.ORDER) == [kind.key for kind in diagnose.KINDS]
    assert sorted(diagnose.ORDER.values()) == list(range(len(diagnose.KINDS)))


def test_findings_come_most_telling_first_and_once_per_kind() -> None:
    from ppbackward._tools.harness import diagnose

    record = {"wrap": "ddp", "failures": ["step 0: hooks: a", "step 0: numerics: x outside", "step 0: replicas: r", "step 1: hooks: b"]}
    assert [f.kind.key for f in diagnose.diagnose(record)] == ["ddp-replicas", "grads-wrong", "hooks-skipped"]
    assert diagnose.diagnose({"failures": []}) == []


def test_progress_reports_a_case_once_every_rank_has_it_and_says_what_runs_meanwhile(tmp_path: Path) -> None:
    """Issue 23: progress came from rank 0 alone (``lora-last pass`` over a failing row) and froze 20-29 s
    with no word of why (Note [progress says what runs]); no process, a fake clock: no timing involved."""
    from ppbackward._tools.harness.launch import _CaseReporter

    now = [0.0]
    seen: list[tuple[str, dict]] = []
    said: list[str] = []
    reporter = _CaseReporter(tmp_path, 2, lambda c, r: seen.append((c, r)), said.append, quiet_s=10.0,
                             clock=lambda: now[0])

    def write(rank: int, *cases: tuple[str, str]) -> None:
        records = [{"id": c, "status": s} for c, s in cases]
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"cases": records}))

    now[0] = 10.0
    reporter.poll()
    assert said == ["starting: 0/2 ranks have joined the process group"]
    write(0)
    write(1)
    (tmp_path / "rank0.log").write_text("[rank 0] >>> ScheduleGPipe/lora-last\n")
    now[0] = 15.0
    reporter.poll()
    assert len(said) == 1  # not quiet long enough yet
    now[0] = 20.0
    reporter.poll()
    assert said[-1] == "still running ScheduleGPipe/lora-last (rank 0's log; 0 case(s) done)"
    write(0, ("ScheduleGPipe/lora-last", "pass"))
    reporter.poll()
    assert seen == []  # rank 1 is still on it
    write(1, ("ScheduleGPipe/lora-last", "fail"))
    reporter.poll()
    reporter.poll()
    assert [(c, {r: v["status"] for r, v in per.items()}) for c, per in seen] == [
        ("ScheduleGPipe/lora-last", {0: "pass", 1: "fail"})
    ]  # once, with every rank's record
    now[0] = 25.0
    reporter.poll()
    assert len(said) == 2  # a finished case restarted the quiet clock


def test_titan_chunked_loss_equals_the_unchunked_cross_entropy() -> None:
    """torchtitan's chunked loss (issue 20): the loss and every grad (lm_head's accumulated inside the
    loss, the rest through the custom Function) equal plain autograd of the whole cross-entropy."""
    import torch.nn.functional as F

    spec = models.get_model("titan")
    chunked, plain = models.build_stages(spec, 2, seed=3), models.build_stages(spec, 2, seed=3)
    batch = models.make_batch(spec, 1, seed=4)
    ref = models.reference_step(chunked, batch, 1, spec.loss_of(chunked[-1]))
    h = plain[1](plain[0](*batch.args))
    want = batch.target.flatten(0, 1).softmax(-1)
    loss = F.cross_entropy(plain[1].lm_head(h).flatten(0, 1), want, reduction="sum")
    loss.backward()
    assert torch.allclose(ref.losses[0], loss.detach())
    for i, module in enumerate(plain):
        for name, p in models.param_names(i, module):
            assert torch.allclose(ref.grads[name], p.grad, atol=1e-6), name
    assert ref.grads["stage1.norm.weight"] is not None


def test_a_model_name_is_not_shadowed_by_a_group() -> None:
    for name in models.MODELS:
        assert models.model_names(name) == [name]
