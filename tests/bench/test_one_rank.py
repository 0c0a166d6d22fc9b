"""The one-rank step (``ppbackward._tools.bench.one_rank``, Note [one-rank step]) on CPU: every variant runs
with exact grads, the merged ones run only full backwards, a schedule torch refuses is skipped with
torch's message, a wrong grad is caught, and nothing is left behind (no process group, ppbackward's
installed state as found). No timing is asserted."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import ppbackward
from ppbackward._install import merge_bw_enabled
from ppbackward._tools.bench import one_rank as _one_rank
from ppbackward._tools.cli.bench import main as bench_main
from ppbackward._tools.harness.schedule_bench import variant_name

TINY = _one_rank.QUICK._replace(repeats=1)


@pytest.fixture(scope="module")
def result():
    ppbackward.uninstall()
    return _one_rank.measure(TINY)


def test_every_variant_runs_exactly(result):
    assert result["grads_match"] is True and result["skipped"] == {}
    assert result["variants"] == [variant_name(*v) for v in _one_rank.VARIANTS]
    assert set(result["grads_match_by_variant"].values()) == {True}
    assert all(result["step_ms"][v] > 0 and result["peak_bytes"][v] is None for v in result["variants"])
    assert result["ratio_to_1f1b"]["Interleaved1F1B/upstream"] == 1.0
    assert result["backend"] == "gloo" and result["stages"] == 2 and result["repeats"] == 1


def test_lowered_backward_actions(result):
    per_step = _one_rank.STAGES * TINY.microbatches
    for name, acts in result["backward_actions"].items():
        if name.startswith("Interleaved1F1B") or name.endswith("merged"):
            # one rank: every W directly follows its own B, so every pair is merged
            assert acts == {"B": 0, "W": 0, "full": per_step}, name
        else:
            assert acts == {"B": per_step, "W": per_step, "full": 0}, name


def test_nothing_left_behind(result):
    assert not dist.is_initialized() and not ppbackward.is_installed() and not merge_bw_enabled()
    ppbackward.install(merge_bw=True)
    try:
        _one_rank.measure(TINY._replace(microbatches=2))
        assert ppbackward.is_installed() and merge_bw_enabled() and not dist.is_initialized()
    finally:
        ppbackward.uninstall()


def test_formatted_table(result):
    text = _one_rank.format_one_rank(result)
    assert "One-rank step (cpu, gloo, world 1" in text
    for name in result["variants"]:
        assert name in text
    assert "ZBVZeroBubble/merged" in text and "0/0/8" in text


def test_a_schedule_torch_refuses_is_skipped_with_its_message(monkeypatch):
    monkeypatch.setattr(_one_rank, "VARIANTS", (*_one_rank.VARIANTS[:2], ("ScheduleDualPipeV", "upstream")))
    r = _one_rank.measure(TINY._replace(microbatches=1))
    assert r["variants"] == ["Interleaved1F1B/upstream", "Interleaved1F1B/ppbackward"]
    assert "at least as many microbatches as stages" in r["skipped"]["DualPipeV/upstream"]
    assert r["grads_match"] is True
    assert re.search(r"\nDualPipeV/upstream +skipped: ValueError: DualPipeV requires", _one_rank.format_one_rank(r))


def test_a_wrong_grad_is_caught(monkeypatch):
    """Negative control of the verdict: one variant's first step leaves a grad off by 1e-3."""
    step = _one_rank._Variant.step

    def off_step(self, x, target):
        t = step(self, x, target)
        if self.name == "ZBVZeroBubble/ppbackward":
            next(iter(self.params)).grad.add_(1e-3)
        return t

    monkeypatch.setattr(_one_rank._Variant, "step", off_step)
    r = _one_rank.measure(TINY)
    assert r["grads_match"] is False
    assert [k for k, ok in r["grads_match_by_variant"].items() if not ok] == ["ZBVZeroBubble/ppbackward"]


@pytest.mark.parametrize("backward", ["ppbackward", "merged"])
def test_a_first_step_that_raises_under_ppbackward_is_an_error_not_a_skip(monkeypatch, backward: str):
    """A skip is torch refusing a schedule; ppbackward's backward raising is a failure of the run, named."""
    step, bad = _one_rank._Variant.step, f"ZBVZeroBubble/{backward}"

    def failing_step(self, x, target):
        if self.name == bad:
            raise ValueError("boom")
        return step(self, x, target)

    monkeypatch.setattr(_one_rank._Variant, "step", failing_step)
    with pytest.raises(RuntimeError, match=f"one-rank step: {bad}'s first step raised: ValueError: boom"):
        _one_rank.measure(TINY)
    assert not dist.is_initialized()


def test_a_first_step_that_raises_under_torchs_backward_is_skipped(monkeypatch):
    step = _one_rank._Variant.step

    def failing_step(self, x, target):
        if self.name == "ZBVZeroBubble/upstream":
            raise ValueError("torch's own zero bubble failed")
        return step(self, x, target)

    monkeypatch.setattr(_one_rank._Variant, "step", failing_step)
    r = _one_rank.measure(TINY)
    assert r["skipped"] == {"ZBVZeroBubble/upstream": "ValueError: torch's own zero bubble failed"}
    assert "ZBVZeroBubble/upstream" not in r["variants"] and r["grads_match"] is True


def test_refuses_an_existing_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="default process group is already initialised"):
            _one_rank.measure(TINY)
        assert dist.is_initialized() and torch.get_num_threads() >= 1
    finally:
        dist.destroy_process_group()


def test_cli_refuses_one_rank_step_without_split(capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["--one-rank-step"])
    assert e.value.code == 2 and "--one-rank-step: only with --split" in capsys.readouterr().err
