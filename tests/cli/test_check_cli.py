"""``ppbackward check`` end to end (real torchrun launches) and its bad inputs.

Layers: the bad-input tests run no process group (seconds); the end-to-end test launches torchrun
twice with 2 ranks on two schedules (~20 s); the hang test waits for two 15 s launch timeouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

COMMAND = [sys.executable, "-m", "ppbackward"]


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.timeout(300)
def test_check_end_to_end_prints_table_verdict_and_json(tmp_path):
    out = tmp_path / "check.json"
    proc = _run(
        "check", "--model", "mlp", "--schedules", "ScheduleGPipe,ScheduleZBVZeroBubble",
        "--steps", "1", "--json", str(out), "--logs", str(tmp_path / "logs"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "[ppbackward] ScheduleZBVZeroBubble" in text and "elapsed" in text  # progress lines
    rows = {tuple(line.split()[:2]): line for line in text.splitlines() if line.startswith("Schedule")}
    assert "FAIL" not in rows[("ScheduleZBVZeroBubble", "ppbackward")]
    assert "hooks" in text and "64/64 ok" in rows[("ScheduleZBVZeroBubble", "ppbackward")]
    # torch's own W bypasses AccumulateGrad: its hook column fails, and that is not fatal.
    assert "FAIL" in rows[("ScheduleZBVZeroBubble", "upstream")]
    assert "VERDICT: ppbackward PASS on 2/2 schedules; torch's own backward failed 1/2" in text
    data = json.loads(out.read_text())
    assert data["passed"] is True and data["model"] == "mlp"
    ours = data["results"]["ppbackward"]["ScheduleZBVZeroBubble"]
    assert ours["garbage"] == 0 and ours["bytes_held_after_step"] == 0
    assert ours["hooks_fired"] == ours["hooks_expected"] == 64
    assert (tmp_path / "logs" / "ppbackward" / "rank1.log").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--schedules", "ScheduleNope"], "unknown schedule(s) ScheduleNope; known: "),
        (["--schedules", ","], "--schedules ',': no schedule named"),
        (["--schedules", "ScheduleFlexibleInterleaved1F1B"] if not torch.__version__.startswith("2.5.")
         else ["--schedules", "ScheduleDualPipeV"], "nothing to check with --nproc 2: Schedule"),
        (["--nproc", "0"], "--nproc 0: need at least 1 rank"),
        (["--device", "cuda"], "--device cuda: torch.cuda.is_available() is False"),
        (["--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["--steps", "0"], "--steps 0: need at least 1 step"),
        (["--timeout", "5"], "--timeout 5: must exceed 10 seconds"),
    ],
)
def test_check_bad_input_is_a_clear_error(args, message):
    proc = _run("check", *args, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"ppbackward check: error: {message}" in proc.stderr
    assert "launching" not in proc.stdout


def test_check_without_torchrun_is_a_clear_error(monkeypatch, capsys):
    import importlib.util

    from ppbackward import _check

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch.distributed.run" else real(name, *a))
    assert _check.main([]) == 2
    assert "has no torch.distributed / torchrun" in capsys.readouterr().err


def test_unknown_command_and_help():
    proc = _run("frobnicate", timeout=60)
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0 and "check" in proc.stdout and "bench" in proc.stdout


@pytest.mark.timeout(200)
def test_check_hung_rank_fails_in_bounded_time_with_log_tail(tmp_path):
    proc = _run(
        "check", "--model", "mlp", "--schedules", "ScheduleGPipe", "--steps", "1", "--timeout", "15",
        "--worker-arg=--hang-rank=1", "--logs", str(tmp_path),
    timeout=150)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the launch itself failed" in proc.stdout and "timed out after 15s" in proc.stdout
    assert "rank 1" in proc.stdout and "recv" in proc.stdout  # the hung rank's log tail
    assert "VERDICT: ppbackward FAIL" in proc.stdout
