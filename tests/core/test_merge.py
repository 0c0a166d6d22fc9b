"""``install(merge_bw=True)``: a B directly followed by its own W runs as one full backward (issue 22).

Note [merged B and W] in ``ppbackward._merge``. The action lists are torch's own planner's
(``_schedule_visualizer.get_schedule_ops`` builds each schedule, lowering included, on its mock stages);
that merged schedules train exactly is shown under torchrun (``tests/multiproc/test_merged.py``).
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as s

import ppbackward
from ppbackward._install import merge_bw_enabled
from ppbackward._merge import lowering, merge_actions

try:  # torch 2.5-2.8 have no lowering to wrap (install(merge_bw=True) refuses them), 2.5 no visualizer either
    lowering()
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
except (ppbackward.UnsupportedTorchError, ImportError) as e:
    pytest.skip(f"install(merge_bw=True) does not apply to this torch: {e}", allow_module_level=True)

A = s._Action
I, W, B, F = s.BACKWARD_INPUT, s.BACKWARD_WEIGHT, s.FULL_BACKWARD, s.FORWARD  # noqa: E741  # torch's action letters
SPLIT = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@pytest.fixture(autouse=True)
def _restore():
    was = ppbackward.is_installed()
    yield
    if not was:
        ppbackward.uninstall()


def test_merges_only_a_b_directly_followed_by_its_own_w_idle_slots_skipped():
    acts = [A(0, F, 0), A(0, I, 0), None, A(0, W, 0), A(0, I, 1), A(1, W, 1), A(0, W, 1), A(1, I, 2), A(1, W, 3)]
    merged, n = merge_actions(acts)
    assert n == 1
    assert merged == [A(0, F, 0), A(0, B, 0), None, A(0, I, 1), A(1, W, 1), A(0, W, 1), A(1, I, 2), A(1, W, 3)]
    assert merge_actions([A(0, I, 0)]) == ([A(0, I, 0)], 0)  # a B at the end
    assert merge_actions([]) == ([], 0)


def test_an_overlapped_action_is_never_merged_into():
    overlap = A(0, s.OVERLAP_F_B, None, (A(0, F, 1), A(0, W, 0)))
    acts = [A(0, I, 0), overlap, A(0, W, 0)]
    assert merge_actions(acts) == (acts, 0)


@pytest.mark.parametrize("name", SPLIT)
def test_every_backward_runs_once_and_nothing_else_moves(name: str):
    for rank_ops in get_schedule_ops(getattr(s, name), 2, 8, 2):
        merged, n = merge_actions(rank_ops)
        kinds = [a.computation_type for a in merged if a is not None]
        assert kinds.count(B) - [a.computation_type for a in rank_ops if a is not None].count(B) == n
        flat = [sub for a in merged if a is not None for sub in (a.sub_actions or (a,))]
        done = {(a.stage_index, a.microbatch_index, a.computation_type) for a in flat}
        for st, mb, kind in list(done):
            if kind == F:  # each forward has exactly one full backward or one B and one W
                assert ((st, mb, B) in done) != ((st, mb, I) in done and (st, mb, W) in done), (st, mb)
        # with the merged pairs put back, the list is the planner's
        unmerged = []
        for a in merged:
            if a in _pairs(rank_ops):
                unmerged += [a._replace(computation_type=I), a._replace(computation_type=W)]
            else:
                unmerged.append(a)
        assert [a for a in unmerged if a is not None] == [a for a in rank_ops if a is not None]


def _pairs(rank_ops):
    ops = [a for a in rank_ops if a is not None]
    return {
        a._replace(computation_type=B)
        for a, b in zip(ops, ops[1:])
        if a.computation_type == I and b == a._replace(computation_type=W)
    }


def _lowered_kinds(name: str) -> list[dict]:
    ops = get_schedule_ops(getattr(s, name), 2, 8, 2, with_comms=True)
    return [{k: sum(a is not None and a.computation_type == k for a in r) for k in (B, I, W)} for r in ops]


@pytest.mark.parametrize("name", SPLIT)
def test_a_schedule_built_while_installed_with_merge_bw_runs_the_merged_list(name: str):
    plain = _lowered_kinds(name)
    if name != "ScheduleDualPipeV":  # DualPipeV plans some full backwards itself
        assert all(r[B] == 0 for r in plain)
    ppbackward.install(merge_bw=True)
    merged = _lowered_kinds(name)
    for p, m in zip(plain, merged):
        assert m[B] - p[B] == p[W] - m[W] == p[I] - m[I]  # a merged pair: one B and one W fewer, one full more
    assert sum(r[B] - p[B] for r, p in zip(merged, plain)) > 0
    ppbackward.install()  # a later plain install() leaves the switch as it is
    assert _lowered_kinds(name) == merged
    ppbackward.install(merge_bw=False)
    assert _lowered_kinds(name) == plain


@pytest.mark.parametrize("value", ["yes", 1, 0])
def test_merge_bw_other_than_a_bool_or_none_is_refused_before_anything_is_patched(value):
    cls = s._PipelineScheduleRuntime
    original = cls.__dict__["_prepare_schedule_with_comms"]
    with pytest.raises(TypeError, match=r"install\(merge_bw=.*\): expected True, False or None"):
        ppbackward.install(merge_bw=value)
    assert not ppbackward.is_installed() and cls.__dict__["_prepare_schedule_with_comms"] is original


def test_the_package_exports_the_switchs_state():
    assert "merge_bw_enabled" in ppbackward.__all__ and ppbackward.merge_bw_enabled is merge_bw_enabled
    ppbackward.install(merge_bw=True)
    assert ppbackward.merge_bw_enabled()
    ppbackward.install(merge_bw=False)
    assert not ppbackward.merge_bw_enabled() and ppbackward.is_installed()


def test_uninstall_puts_back_exactly_torchs_lowering():
    cls = s._PipelineScheduleRuntime
    original = cls.__dict__["_prepare_schedule_with_comms"]
    ppbackward.install(merge_bw=True)
    assert merge_bw_enabled() and cls.__dict__["_prepare_schedule_with_comms"] is not original
    ppbackward.install(merge_bw=True)  # idempotent: wrapped once
    assert cls.__dict__["_prepare_schedule_with_comms"].__wrapped__ is original
    ppbackward.uninstall()
    assert not merge_bw_enabled() and cls.__dict__["_prepare_schedule_with_comms"] is original


def test_a_lowering_inherited_from_a_base_class_is_wrapped_and_put_back_by_deleting_ours(monkeypatch):
    """Where the runtime inherits ``_prepare_schedule_with_comms`` (posed here by moving torch's to
    ``PipelineScheduleMulti``), install(merge_bw=True) wraps it on the runtime (it used to raise KeyError
    with the stage names already patched) and uninstall() deletes the wrapper, leaving the base's."""
    cls, base = s._PipelineScheduleRuntime, s.PipelineScheduleMulti
    original = cls.__dict__["_prepare_schedule_with_comms"]
    monkeypatch.setattr(base, "_prepare_schedule_with_comms", original, raising=False)
    monkeypatch.delattr(cls, "_prepare_schedule_with_comms")
    ppbackward.install(merge_bw=True)
    assert merge_bw_enabled() and cls.__dict__["_prepare_schedule_with_comms"].__wrapped__ is original
    ppbackward.uninstall()
    assert "_prepare_schedule_with_comms" not in cls.__dict__ and cls._prepare_schedule_with_comms is original
    assert not merge_bw_enabled() and not ppbackward.is_installed()


def test_installed_context_restores_the_switch():
    cls = s._PipelineScheduleRuntime
    original = cls.__dict__["_prepare_schedule_with_comms"]
    with ppbackward.installed(merge_bw=True):
        assert merge_bw_enabled()
    assert not ppbackward.is_installed() and cls.__dict__["_prepare_schedule_with_comms"] is original
    ppbackward.install()
    with ppbackward.installed(merge_bw=True):
        assert merge_bw_enabled()
    assert ppbackward.is_installed() and not merge_bw_enabled()


def test_an_uninstall_inside_an_installed_block_stands():
    ppbackward.install()
    with ppbackward.installed(merge_bw=True):
        ppbackward.uninstall()
    assert not ppbackward.is_installed() and not merge_bw_enabled()
    cls = s._PipelineScheduleRuntime
    assert not getattr(cls.__dict__["_prepare_schedule_with_comms"], "__ppbackward_merging__", False)


MISSING = ["_PipelineScheduleRuntime", "_PipelineScheduleRuntime._prepare_schedule_with_comms"]


def _names() -> dict:
    import torch.distributed.pipelining._backward as backward_mod
    import torch.distributed.pipelining.stage as stage_mod

    return {(m.__name__, n): getattr(m, n) for m in (backward_mod, stage_mod) for n in ppbackward._install.NAMES}


@pytest.mark.parametrize("missing", MISSING)
@pytest.mark.parametrize("already", [False, True])
def test_a_torch_without_the_lowering_refuses_merge_bw_and_patches_nothing(monkeypatch, missing: str, already: bool):
    if already:
        ppbackward.install()
    before = _names()
    if missing == "_PipelineScheduleRuntime":
        monkeypatch.delattr(s, "_PipelineScheduleRuntime")
    else:
        monkeypatch.delattr(s._PipelineScheduleRuntime, "_prepare_schedule_with_comms")
    with pytest.raises(ppbackward.UnsupportedTorchError, match=f"has no {missing}; cannot merge B and W"):
        ppbackward.install(merge_bw=True)  # a RuntimeError, and what the launcher and check refuse
    with pytest.raises(RuntimeError, match=f"has no {missing};"), ppbackward.installed(merge_bw=True):
        pass
    assert _names() == before and ppbackward.is_installed() == already and not merge_bw_enabled()
    ppbackward.uninstall()  # works on such a torch: the switch was never on
    assert not ppbackward.is_installed()


# --- real schedules in one process (gloo, world size 1: both stages on rank 0) ------------------------


def _schedule(name: str, n_microbatches: int = 3, scale_grads: bool = True):
    import torch
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(0)
    chunks: list[torch.nn.Module] = [
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)) for _ in range(2)
    ]
    stages = [PipelineStage(c, i, 2, torch.device("cpu")) for i, c in enumerate(chunks)]
    loss_fn = torch.nn.functional.mse_loss
    return chunks, getattr(s, name)(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def _step_grads(chunks, schedule, n_microbatches: int) -> list:
    import torch

    torch.manual_seed(1)
    x, target = torch.randn(2 * n_microbatches, 8), torch.randn(2 * n_microbatches, 8)
    for _ in range(2):  # two steps: grads accumulate across steps as well
        schedule.step(x, target=target)
    return [p.grad for c in chunks for p in c.parameters()]


def _ran(schedule) -> dict:
    return {k: sum(a.computation_type == k for a in schedule.pipeline_order_with_comms[0]) for k in (B, I, W)}


@pytest.mark.parametrize("scale_grads", [True, False])
@pytest.mark.parametrize("name", SPLIT)
def test_a_merged_schedule_keeps_running_merged_and_exact_after_uninstall(process_group, name: str, scale_grads: bool):
    import torch

    n = 3  # odd: the last backward of a stage falls on a merged pair as well
    ppbackward.install()
    chunks, plain = _schedule(name, n, scale_grads)
    expected = _step_grads(chunks, plain, n)
    ppbackward.install(merge_bw=True)
    chunks, merged = _schedule(name, n, scale_grads)
    ppbackward.uninstall()
    assert _ran(merged)[B] > _ran(plain)[B] and _ran(merged)[W] < _ran(plain)[W]
    got = _step_grads(chunks, merged, n)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert _ran(merged)[B] > _ran(plain)[B]  # still the merged list


def _refused(make_actions) -> list[str]:
    """torch's error for the same bad compute-only list, lowered with the switch off and on."""
    messages = []
    for merge in (False, True):
        ppbackward.install(merge_bw=merge)
        _, schedule = _schedule("ScheduleInterleavedZeroBubble", 1)
        with pytest.raises((ValueError, AssertionError)) as err:
            schedule._prepare_schedule_with_comms(make_actions())
        messages.append(str(err.value))
    return messages


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        ([A(0, s.SEND_F, 0)], "'0SEND_F0' at rank 0, position 4"),
        ([A(0, W, 1)], "Rank 0, step 4: Running Backward Weight for stage 0, microbatch 1"),
        # a pair the merge would make a full backward: torch names the B the caller wrote
        ([A(0, I, 1), A(0, W, 1)], "Rank 0, step 4: Running Backward Input for stage 0, microbatch 1 without"),
    ],
)
def test_a_list_torch_refuses_is_named_by_the_callers_own_positions(process_group, bad: list, where: str):
    def actions():  # a pair that merges, then the bad actions
        return {0: [A(0, F, 0), A(1, F, 0), A(1, I, 0), A(1, W, 0), *bad, A(0, I, 0), A(0, W, 0)]}

    off, on = _refused(actions)
    assert where in off and on == off


def test_a_merged_pair_runs_the_full_backwards_custom_function(process_group):
    """Documented in api.md: a custom function registered for I or W does not see a merged pair."""
    from collections import Counter

    ppbackward.install(merge_bw=True)
    chunks, schedule = _schedule("ScheduleZBVZeroBubble", 2)
    calls: Counter = Counter()
    for kind in (I, W, B):
        schedule.register_custom_function(kind, lambda action, ctx, kind=kind: calls.update([kind]))
    _step_grads(chunks, schedule, 2)
    ran = _ran(schedule)
    assert calls == Counter({B: 2 * ran[B], I: 2 * ran[I], W: 2 * ran[W]}) and ran[B] == 4


def _dp_grads(name: str, wrap: str, merge: bool, n_microbatches: int = 3) -> tuple[list, list]:
    """Two steps of a world-1 data-parallel pipeline: the grads (full tensors) and DDP's all-reduces in
    the second step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    chunks: list[torch.nn.Module] = [
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)) for _ in range(2)
    ]
    reduced: list = []  # (stage, how many backwards the schedule had counted for it) per all-reduce
    held: list = []  # the schedule, once built

    def counting(i: int):
        def hook(state, bucket):
            reduced.append((i, held[0].backward_counter[i]))
            return allreduce_hook(state, bucket)

        return hook

    if wrap == "ddp":
        chunks = [DistributedDataParallel(c) for c in chunks]
        for i, c in enumerate(chunks):
            c.register_comm_hook(dist.group.WORLD, counting(i))  # type: ignore[operator]  # a DDP module
    elif wrap == "fsdp":
        for c in chunks:
            fully_shard(c)
    stages = [PipelineStage(c, i, 2, torch.device("cpu")) for i, c in enumerate(chunks)]
    ppbackward.install(merge_bw=merge)
    schedule = getattr(s, name)(stages, n_microbatches=n_microbatches, loss_fn=torch.nn.functional.mse_loss)
    held.append(schedule)
    assert (_ran(schedule)[B] > 0) == (merge or name == "ScheduleDualPipeV")
    torch.manual_seed(1)
    x, target = torch.randn(2 * n_microbatches, 8), torch.randn(2 * n_microbatches, 8)
    schedule.step(x, target=target)
    # the first step's first backward all-reduces with torch's own backward too (DDP's first iteration)
    reduced.clear()
    schedule.step(x, target=target)
    grads = [p.grad for c in chunks for p in c.parameters()]
    return [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads], reduced


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", SPLIT)
def test_ddp_and_fsdp2_reduce_once_at_the_last_backward_when_merged(process_group, name: str, wrap: str):
    """A merged pair counts as the stage's backward: DDP all-reduces only in a stage's last backward of
    a step, as often as unmerged, and FSDP2's reduction (REDUCE_GRAD, after the last backward) still sees
    every microbatch's grads (run earlier, later microbatches' grads would be left out of ``.grad``)."""
    import torch

    n = 3
    plain, _ = _dp_grads(name, "none", False, n)
    runs = {merge: _dp_grads(name, wrap, merge, n) for merge in (False, True)}
    for grads, _ in runs.values():  # FSDP2 adds a step's reduced grads to the last: ulps off a plain stage
        assert all((g - e).abs().max() <= 1e-6 * e.abs().max() for g, e in zip(grads, plain, strict=True))
    assert all(torch.equal(g, e) for g, e in zip(runs[True][0], runs[False][0], strict=True))
    if wrap == "ddp":
        merged, unmerged = runs[True][1], runs[False][1]
        assert merged == unmerged and {stage for stage, _ in merged} == {0, 1}
        assert all(counted == n for _, counted in merged), merged  # only in the last backward


def test_dump_csv_writes_torchs_plan_compute_only_and_what_runs_with_comms(process_group, tmp_path):
    ppbackward.install()
    _, plain = _schedule("ScheduleZBVZeroBubble", 2)
    ppbackward.install(merge_bw=True)
    _, merged = _schedule("ScheduleZBVZeroBubble", 2)
    assert merged.pipeline_order == plain.pipeline_order  # torch's plan, untouched
    for schedule, name in ((plain, "plain"), (merged, "merged")):
        schedule._dump_csv(str(tmp_path / f"{name}-plan.csv"), format="compute_only")
        schedule._dump_csv(str(tmp_path / f"{name}-runs.csv"))
    assert (tmp_path / "merged-plan.csv").read_text() == (tmp_path / "plain-plan.csv").read_text()
    assert (tmp_path / "merged-runs.csv").read_text() != (tmp_path / "plain-runs.csv").read_text()
    # what runs, loaded back with the switch off (a compute-and-comms list runs as given): still merged
    ppbackward.install(merge_bw=False)
    _, loaded = _schedule("ScheduleZBVZeroBubble", 2)
    loaded._load_csv(str(tmp_path / "merged-runs.csv"), format="compute_comms")
    assert loaded.pipeline_order_with_comms == merged.pipeline_order_with_comms
    assert _ran(loaded) == {B: 4, I: 0, W: 0}
    # torch's plan, loaded back with the switch on, is merged again
    ppbackward.install(merge_bw=True)
    loaded._load_csv(str(tmp_path / "plain-plan.csv"))
    assert loaded.pipeline_order_with_comms == merged.pipeline_order_with_comms


def test_threads_switching_at_once_leave_one_consistent_state():
    """install(merge_bw=...) and uninstall() from 8 threads at once (the module lock): afterwards the
    lowering is wrapped exactly once or not at all, as merge_bw_enabled() says, and uninstall() puts back
    torch's own objects."""
    import threading

    cls = s._PipelineScheduleRuntime
    original, names = cls.__dict__["_prepare_schedule_with_comms"], _names()
    start, errors = threading.Barrier(8), []

    def switch(i: int) -> None:
        try:
            start.wait()
            for k in range(30):
                [lambda: ppbackward.install(merge_bw=True), lambda: ppbackward.install(merge_bw=False),
                 ppbackward.uninstall][(i + k) % 3]()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=switch, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    current = cls.__dict__["_prepare_schedule_with_comms"]
    if merge_bw_enabled():
        assert ppbackward.is_installed() and current.__wrapped__ is original
    else:
        assert current is original
    ppbackward.uninstall()
    assert cls.__dict__["_prepare_schedule_with_comms"] is original and _names() == names
