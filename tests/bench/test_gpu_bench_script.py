"""scripts/gpu_bench.sh (issue 22) runs on CPU with ``--device cpu``: the split table, the replayed
steps, the one-rank step (every variant, exact) and the targets come out, in one process, and it exits
0. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ppbackward._tools.bench import one_rank as _one_rank
from ppbackward._tools.harness.schedule_bench import variant_name

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_script_runs_on_cpu(tmp_path):
    out = tmp_path / "split.json"
    env_py = Path(sys.executable).parent
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_bench.sh"), "--device", "cpu", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
        env={"PATH": f"{env_py}:/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Split cost per microbatch-stage" in proc.stdout
    assert "Replayed step" in proc.stdout
    report = json.loads(out.read_text())
    (cfg,) = report["split"]["configs"]
    assert report["split"]["device"] == "cpu" and cfg["held_bytes"] is None
    for regime in ("first", "accumulating"):
        t = cfg["time_ms"][regime]
        assert {"fwd", "full", "pp_b", "pp_w", "pp_bw", "torch_b", "torch_w", "torch_bw"} <= t.keys()
        assert all(v > 0 for v in t.values())
        assert t["pp_bw"] >= t["pp_b"] and t["pp_bw"] >= t["pp_w"]
    rp = cfg["replay"]["2 ranks"]
    assert rp["ratio_to_1f1b"]["ScheduleInterleaved1F1B"] == 1.0
    assert 0 < rp["merged_share"]["ScheduleZBVZeroBubble"] <= 1
    one = report["one_rank_step"]
    assert "One-rank step" in proc.stdout
    assert one["ranks"] == 1 and one["device"] == "cpu" and one["grads_match"] is True
    assert one["skipped"] == {} and one["variants"] == [variant_name(*v) for v in _one_rank.VARIANTS]
    assert all(one["step_ms"][v] > 0 and one["peak_bytes"][v] is None for v in one["variants"])
    assert one["ratio_to_1f1b"]["Interleaved1F1B/upstream"] == 1.0
    assert {t["status"] for t in report["targets"]} <= {"PASS", "MISS"}
    assert any(t["target"].startswith("split: B alone") for t in report["targets"])


def test_gpu_bench_script_refuses_cuda_without_a_device():
    import torch

    if torch.cuda.is_available():
        return
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "no CUDA device" in proc.stderr
