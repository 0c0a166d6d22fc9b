"""install() swaps ppbackward into torch's pipelining (both modules), uninstall() restores the exact
originals, and a real PipelineStage + schedule calls whichever is installed."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import _backward as upstream_backward
from torch.distributed.pipelining import stage as upstream_stage
from torch.distributed.pipelining.schedules import ScheduleGPipe, ScheduleInterleavedZeroBubble

import ppbackward as pb
from ppbackward import _compat, _merge

NAMES = ("stage_backward", "stage_backward_input", "stage_backward_weight")
ORIGINALS = {(m.__name__, n): getattr(m, n) for m in (upstream_backward, upstream_stage) for n in NAMES}

# What does not hold on every supported torch (the sessions torch-2.5.1 and compat of noxfile.py run this file
# on other releases): each skip names the test that checks the same thing there.
_ADAPTER = _compat.select_adapter().name
_RELEASE = _compat.torch_release()
own_functions_only = pytest.mark.skipif(
    not _ADAPTER.startswith("native ("),
    reason=f"asserts install() puts in ppbackward's own functions; on this torch it puts in the adapter {_ADAPTER!r} "
           "(tests/compat/test_compat_selection.py checks that instead)",
)
same_rank_hand_off = pytest.mark.skipif(
    _RELEASE < (2, 12),
    reason="has two stages of one rank talk through P2P, which gloo cannot do to itself before torch 2.12 "
           "(same-rank hand-off); tests/compat/test_compat_schedules.py runs these schedules here",
)
try:
    _merge.lowering()
    _MERGE_BW: bool | None = True  # install(merge_bw=True) where this torch has the lowering it wraps (2.9+)
except pb.UnsupportedTorchError:
    _MERGE_BW = None
stage_api_2_7 = pytest.mark.skipif(
    _RELEASE < (2, 7),
    reason="builds PipelineStage and schedules with the 2.7+ API (no input_args, scale_grads=False); "
           "tests/compat/test_compat_schedules.py runs these schedules here",
)


@pytest.fixture(autouse=True)
def _always_uninstalled():
    pb.uninstall()
    yield
    pb.uninstall()


def _current():
    return {(m.__name__, n): getattr(m, n) for m in (upstream_backward, upstream_stage) for n in NAMES}


@own_functions_only
def test_install_swaps_both_modules_and_uninstall_restores_exact_originals():
    assert not pb.is_installed()
    pb.install()
    pb.install()  # idempotent
    assert pb.is_installed()
    for (_, name), obj in _current().items():
        assert obj is getattr(pb, name)
    pb.uninstall()
    pb.uninstall()  # idempotent
    assert not pb.is_installed()
    assert all(_current()[k] is ORIGINALS[k] for k in ORIGINALS)


def test_install_refuses_to_record_its_own_functions_as_torchs_after_its_record_was_lost(monkeypatch):
    # what importlib.reload(ppbackward._install) (IPython's autoreload) does to an install: a new, empty record
    # while torch's modules still hold ppbackward's functions; recorded, uninstall() would put those back
    from ppbackward import _install

    pb.install()
    try:
        monkeypatch.setattr(_install, "_originals", {})
        monkeypatch.setattr(_install, "_active", [])
        held = _current()
        with pytest.raises(RuntimeError, match=r"stage_backward is already ppbackward's, .*start a new interpreter"):
            pb.install()
        assert _current() == held and not _install._originals  # nothing patched, nothing recorded
    finally:
        monkeypatch.undo()
        pb.uninstall()
    assert all(_current()[k] is ORIGINALS[k] for k in ORIGINALS)


@pytest.fixture
def first_install(monkeypatch):
    """A process that has not logged its install yet (Note [install says so]), outside torchrun."""
    from ppbackward import _install

    monkeypatch.setattr(_install, "_announced", [])
    monkeypatch.delenv("RANK", raising=False)


def _install_records(caplog) -> list[logging.LogRecord]:
    """The install record (Note [install says so]), without the compiled-regions line of an older torch."""
    return [r for r in caplog.records if r.name == "ppbackward" and "torch.compile'd regions" not in r.getMessage()]


def test_install_says_once_that_compiled_regions_run_whole_on_a_torch_without_the_split(first_install, caplog):
    """Note [compiled regions split in two]: on torch 2.5-2.12 one more INFO line at the install that logs."""
    from ppbackward import _compiled

    caplog.set_level(logging.INFO, logger="ppbackward")
    pb.install()
    pb.install()
    lines = [r.getMessage() for r in caplog.records if "torch.compile'd regions" in r.getMessage()]
    if _compiled.support().ok:
        assert lines == []
    else:
        assert lines == [
            "ppbackward: torch.compile'd regions run whole in B, not split into B and W: " + _compiled.support().why
        ]


def test_install_logs_once_per_process_that_ppbackward_is_in_place(first_install, caplog):
    """A newcomer's finding: nothing said ppbackward was active. One INFO record, however often it installs."""
    caplog.set_level(logging.INFO, logger="ppbackward")
    pb.install()
    pb.install()
    pb.uninstall()
    pb.install(merge_bw=_MERGE_BW)
    (record,) = _install_records(caplog)
    assert record.levelno == logging.INFO
    adapter = pb.active_adapter()
    assert adapter is not None
    assert record.getMessage() == (
        f"ppbackward {pb.__version__} installed: torch {torch.__version__}'s pipeline stages run ppbackward's "
        f"stage backward ({adapter.name}, merge_bw off)"
    )


def test_install_logs_on_rank_zero_only(first_install, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="ppbackward")
    monkeypatch.setenv("RANK", "1")  # torchrun's rank 1, before init_process_group
    pb.install(merge_bw=_MERGE_BW)
    assert _install_records(caplog) == []
    pb.uninstall()
    monkeypatch.setenv("RANK", "0")
    pb.install(merge_bw=_MERGE_BW)
    (record,) = _install_records(caplog)
    assert record.getMessage().endswith(f", merge_bw {'on' if _MERGE_BW else 'off'})")


def test_an_initialised_process_group_decides_the_rank(first_install, caplog, monkeypatch):
    import torch.distributed as dist

    caplog.set_level(logging.INFO, logger="ppbackward")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)  # RANK unset would say rank 0
    pb.install()
    assert _install_records(caplog) == []


def test_installed_context_manager_nests():
    with pb.installed():
        assert pb.is_installed()
        with pb.installed():
            assert pb.is_installed()
        assert pb.is_installed(), "inner exit must not uninstall what the outer installed"
    assert not pb.is_installed()
    assert all(_current()[k] is ORIGINALS[k] for k in ORIGINALS)


@pytest.mark.parametrize("version", ["2.4.1", "2.3.1", "2.16.0", "3.0.0"])
def test_unsupported_versions_are_refused_naming_version_and_range(version):
    with pytest.raises(pb.UnsupportedTorchError) as info:
        _compat.check_supported(version)
    assert f"torch {version}" in str(info.value) and pb.SUPPORTED_TORCH in str(info.value)


def test_install_refuses_unknown_torch_and_patches_nothing(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.4.1+cpu")
    with pytest.raises(pb.UnsupportedTorchError, match=r"torch 2\.4\.1\+cpu"):
        pb.install()
    assert not pb.is_installed()
    assert all(_current()[k] is ORIGINALS[k] for k in ORIGINALS)


@pytest.mark.parametrize("version", ["2.12.0", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"])
def test_supported_versions_pass(version):
    _compat.check_supported(version)


# --- a real PipelineStage and schedule, in one process (gloo, world size 1) ---------------------


class RecordingStage(PipelineStage):
    """A real PipelineStage that records which backward ran and what B handed to W."""

    seen: list

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        RecordingStage.seen.append((backward_type, type(result[1]).__name__))
        return result


def _run(schedule_cls, n_stages=2, before_step=lambda: None):
    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(n_stages)]
    ref = copy.deepcopy(nn.Sequential(*mods))
    fired = []
    for m in mods:
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    RecordingStage.seen = []
    stages = [RecordingStage(m, i, n_stages, torch.device("cpu")) for i, m in enumerate(mods)]
    loss_fn = lambda out, target: (out - target).pow(2).sum()  # noqa: E731
    kwargs = dict(n_microbatches=2, loss_fn=loss_fn, scale_grads=False)
    sched = schedule_cls(stages if n_stages > 1 else stages[0], **kwargs)
    x, target = torch.randn(4, 4), torch.randn(4, 4)
    losses = []
    before_step()
    sched.step(x, target=target, losses=losses)
    loss_fn(ref(x[:2]), target[:2]).backward()
    loss_fn(ref(x[2:]), target[2:]).backward()
    got = [p.grad for m in mods for p in m.parameters()]
    for g, p in zip(got, ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
    return sorted(set(RecordingStage.seen)), len(fired)


@same_rank_hand_off
def test_real_zero_bubble_schedule_calls_ppbackward_after_install(process_group):
    pb.install()
    seen, fired = _run(ScheduleInterleavedZeroBubble)
    assert ("input", "ParamGroups") in seen and ("weight", "NoneType") in seen
    n_params, n_microbatches = 4, 2
    # Every parameter's post-accumulate hook fires once per microbatch (stage 0 runs a full
    # backward at W time, the other stage B then W).
    assert fired == n_params * n_microbatches


@same_rank_hand_off
def test_install_after_the_schedule_is_built_takes_effect_at_its_next_step(process_group):
    """The stage looks the backward functions up in torch's modules when it runs them, so a schedule built
    before ``install()`` runs ppbackward's from its next step (docs say: before the schedule runs)."""
    try:
        seen, fired = _run(ScheduleInterleavedZeroBubble, before_step=pb.install)
    finally:
        pb.uninstall()
    assert ("input", "ParamGroups") in seen and fired == 4 * 2


@same_rank_hand_off
def test_real_zero_bubble_schedule_calls_torch_after_uninstall(process_group):
    pb.install()
    pb.uninstall()
    seen, fired = _run(ScheduleInterleavedZeroBubble)
    assert ("input", "list") in seen, seen
    # torch's own W bypasses AccumulateGrad: only stage 0 (full backward) fires hooks.
    assert fired == 2 * 2


@stage_api_2_7
def test_real_gpipe_schedule_full_backward(process_group):
    with pb.installed():
        seen, fired = _run(ScheduleGPipe, n_stages=1)
    assert seen == [("full", "NoneType")] and fired == 2 * 2
