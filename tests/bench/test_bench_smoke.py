"""Smoke test of the benchmark (``ppbackward bench``, ``ppbackward._bench``).

Cheap, no-process checks first: the quick configuration once, one repeat; the report's structure
and that its memory figures are consistent (W cannot read more than B left alive). No timing is
asserted anywhere: timings are the benchmark's output, not a test criterion. Last, the torchrun
launcher's timeout path (one short-lived process group, no schedule actually run).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time

import pytest

from ppbackward._bench import _models, _timing, main
from ppbackward._bench._schedule import ScheduleBenchError, run_schedule


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "report.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--quick", "--repeats", "1", "--json", str(path)])
    return rc, json.loads(path.read_text()), out.getvalue()


def test_quick_run_succeeds_and_is_exact(quick_report):
    rc, report, _ = quick_report
    assert rc == 0
    (cfg,) = report["configs"]
    assert cfg["name"] == _models.QUICK and cfg["repeats"] == 1
    assert cfg["grads_match"] == {"upstream": True, "ppbackward": True, "full": True}
    assert cfg["param_groups"]["upstream"] > 0 and cfg["param_groups"]["ppbackward"] > 0


def test_report_structure(quick_report):
    _, report, _ = quick_report
    meta = report["meta"]
    assert {"date", "torch", "cpu_count", "threads", "argv"} <= meta.keys()
    assert meta["threads"] == 1
    (cfg,) = report["configs"]
    assert set(cfg["time_ms"]) == set(_timing.KEYS)
    assert all(v > 0 for v in cfg["time_ms"].values())
    assert cfg["ratio_to_plain"]["plain"] == pytest.approx(1.0)
    assert set(cfg["paired_ratio_median"]) == set(_timing.PAIRS)
    assert all(v > 0 for v in cfg["paired_ratio_median"].values())
    points = report["analysis_scaling"]["points"]
    assert [p["layers"] for p in points] == [1, 2, 4]
    assert all(a["size"] < b["size"] for a, b in zip(points, points[1:]))
    assert {t["status"] for t in report["targets"]} <= {"PASS", "MISS"}
    assert any("held between B and W" in t["target"] for t in report["targets"])


@pytest.mark.parametrize("impl", ["upstream", "ppbackward"])
def test_memory_figures_are_sane(quick_report, impl):
    _, report, _ = quick_report
    mem = report["configs"][0]["memory"][impl]
    assert 0 < mem["floor_bytes"] <= mem["held_bytes"] <= mem["saved_bytes"]
    # the hook-free and the hooked forward count the same saved storages
    assert mem["saved_bytes"] == mem["saved_bytes_hooked"]
    assert mem["held_over_floor"] == pytest.approx(mem["held_bytes"] / mem["floor_bytes"])
    assert mem["held_after_gc_bytes"] <= mem["held_bytes"]


def test_ppbackward_frees_every_saved_activation_after_w(quick_report):
    _, report, _ = quick_report
    assert report["configs"][0]["memory"]["ppbackward"]["after_w_bytes"] == 0


def test_tables_printed(quick_report):
    _, report, out = quick_report
    for heading in ("Time:", "Memory:", "Graph analysis", "Targets (docs/performance.md)"):
        assert heading in out
    assert out.count("PASS") + out.count("MISS") >= len(report["targets"])


def test_where_time_goes_counts():
    from ppbackward._bench._profile import where_time_goes

    prof = where_time_goes(_models.Config(1, 64, 16), reps=1)
    plain = prof["plain"]
    assert plain["node_calls"] > 0 and plain["matmuls"] > 0
    assert plain["accumulate_grad"] == prof["params"] + 1  # every parameter and the stage input
    for impl in ("upstream", "ppbackward"):
        d = prof[impl]
        assert d["param_groups"] > 0
        assert d["b"]["node_calls"] > 0 and d["w"]["node_calls"] > 0
        for phase in ("b", "w"):
            shares = d["profile"][phase]
            assert shares["engine_calls"] >= 1
            assert set(shares) >= {"total_ms", "engine_ms", "analysis_ms", "hooks_ms", "python_other_ms"}


@pytest.mark.parametrize("bad", ["4x64", "4x63x16", "axbxc", ""])
def test_bad_configs_are_a_usage_error(bad):
    with pytest.raises(SystemExit) as info:
        main(["--configs", bad])
    assert info.value.code == 2


def test_schedule_timeout_kills_the_process_group():
    with pytest.raises(ScheduleBenchError) as info:
        run_schedule(repeats=1, timeout_s=0.5)
    msg = str(info.value)
    assert "timed out" in msg and "torch.distributed.run" in msg
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(info.value.pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"process group {info.value.pgid} still alive after the timeout")
