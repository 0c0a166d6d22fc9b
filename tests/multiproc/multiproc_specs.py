"""The torchrun launches of ``tests/multiproc`` (see the docstring of ``conftest.py`` for the layers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LEAKY = str(HERE / "leaky_backward.py")
TRAINING_ARGS = ("--models", "training")
DP_ARGS = ("--models", "mlp,lora", "--dp", "2", "--wraps", "ddp,fsdp,fsdp-keep")
TITAN_ARGS = ("--models", "titan,titan-sac", "--wraps", "none,fsdp-titan")  # issue 20
ZB_SCHEDULES = ("--schedules", "ScheduleInterleavedZeroBubble,ScheduleZBVZeroBubble,ScheduleDualPipeV")
# issue 37: torch.compile(block) children under the zero-bubble schedules torch refuses them in (check's compiled-zb)
COMPILED_ZB_ARGS = ("--models", "compiled-blocks", "--schedules", "ScheduleInterleavedZeroBubble,ScheduleZBVZeroBubble")
CONTROL_ARGS = (
    "--schedules", "Schedule1F1B,ScheduleInterleavedZeroBubble", "--models", "mlp", "--metadata", "static"
)


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """One torchrun launch. ``timeout``: seconds without progress once every rank has started (Note [hang
    clock] in ``ppbackward._tools.harness.launch``), so it does not depend on how busy the machine is."""

    nproc: int
    args: tuple[str, ...]
    timeout: float = 120.0
    env: tuple[tuple[str, str], ...] = ()
    slow: bool = True  # its tests are marked ``slow`` (``pytest -m "not slow"`` skips the launch)


LAUNCHES: dict[str, LaunchSpec] = {
    # the quick suite (``-m "not slow"``) keeps one launch of each kind: the matrix at world size 2, the
    # training models, and one negative control
    "ws2": LaunchSpec(2, ("--backward", "ppbackward"), slow=False),
    "ws4": LaunchSpec(4, ("--backward", "ppbackward")),
    "ws2-static": LaunchSpec(2, ("--backward", "ppbackward", "--metadata", "static")),
    # issue 12's training setups (test_training.py): the training models on one pipeline of 2 ranks, and
    # pipeline x data parallel on a 2-D mesh of 4 ranks (dp 2 x pp 2), each with torch's backward too
    "training-ws2": LaunchSpec(2, ("--backward", "ppbackward", *TRAINING_ARGS), slow=False),
    "training-dp": LaunchSpec(4, ("--backward", "ppbackward", *DP_ARGS)),
    "upstream-training-ws2": LaunchSpec(2, ("--backward", "upstream", *TRAINING_ARGS, "--case-timeout", "6")),
    "upstream-training-dp": LaunchSpec(4, ("--backward", "upstream", *DP_ARGS, "--case-timeout", "6")),
    # issue 20: torchtitan's shape (final norm, lm_head in the loss, its FSDP2 units), plain and as torchtitan shards it
    "training-titan": LaunchSpec(2, ("--backward", "ppbackward", *TITAN_ARGS)),
    "upstream-training-titan": LaunchSpec(2, ("--backward", "upstream", *TITAN_ARGS, "--case-timeout", "6")),
    # issue 22: install(merge_bw=True), the zero-bubble schedules (test_merged.py)
    "merged-ws2": LaunchSpec(2, ("--backward", "ppbackward-merged", *ZB_SCHEDULES), slow=False),
    "merged-ws4": LaunchSpec(4, ("--backward", "ppbackward-merged", *ZB_SCHEDULES)),
    "merged-training-ws2": LaunchSpec(2, ("--backward", "ppbackward-merged", *TRAINING_ARGS, *ZB_SCHEDULES)),
    "merged-training-dp": LaunchSpec(4, ("--backward", "ppbackward-merged", *DP_ARGS, *ZB_SCHEDULES)),
    # issue 37: compiled blocks under the zero-bubble schedules, each region split into B and W (test_compiled_zb.py)
    "compiled-zb": LaunchSpec(2, ("--backward", "ppbackward", *COMPILED_ZB_ARGS)),
    "upstream-compiled-zb": LaunchSpec(2, ("--backward", "upstream", *COMPILED_ZB_ARGS, "--case-timeout", "6")),
    # torch's own backward raises on some zero-bubble cases; its peers then wait for the case timeout
    # (6 s, scaled by the launch's measured start-up: Note [timeouts scale with start-up] in the worker)
    "upstream-ws2": LaunchSpec(2, ("--backward", "upstream", "--case-timeout", "6")),
    # static metadata: no shape-inference forward on step 0, so every count is exactly one per call
    "leaky-cycle": LaunchSpec(
        2, ("--backward", f"leaky:{LEAKY}", *CONTROL_ARGS), env=(("PPBACKWARD_LEAK_KIND", "cycle"),), slow=False
    ),
    "leaky-live": LaunchSpec(
        2, ("--backward", f"leaky:{LEAKY}", *CONTROL_ARGS), env=(("PPBACKWARD_LEAK_KIND", "live"),)
    ),
    "leaky-cxx-cycle": LaunchSpec(
        2, ("--backward", f"leaky:{LEAKY}", *CONTROL_ARGS), env=(("PPBACKWARD_LEAK_KIND", "cxx-cycle"),)
    ),
}

# The backstop of any test that launches: the launcher bounds start-up (300 s) and every stretch without
# progress itself; this only catches a launcher bug, and is far beyond what a busy machine needs.
LAUNCH_TEST_TIMEOUT = 1800


def slow_params(values: list) -> list:
    """``pytest.param`` per value, marked ``slow`` when the launch it reads (its first item, or the value
    itself) is a slow one."""
    out = []
    for value in values:
        name = value[0] if isinstance(value, tuple) else value
        marks = (pytest.mark.slow,) if LAUNCHES[name].slow else ()
        out.append(pytest.param(*(value if isinstance(value, tuple) else (value,)), marks=marks))
    return out


def uses_launch(name: str):
    """Decorator for a test that reads launch ``name`` without a parameter naming it: records the name
    (for the prefetch in ``conftest.py``) and marks the test ``slow`` when the launch is slow."""

    def decorate(test):
        test.launch_names = (*getattr(test, "launch_names", ()), name)
        return pytest.mark.slow(test) if LAUNCHES[name].slow else test

    return decorate


def launches_of(item: pytest.Item) -> list[str]:
    """The launches a collected test reads: parameters naming one, and ``uses_launch`` names."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    names = [v for v in params.values() if isinstance(v, str) and v in LAUNCHES]
    return names + list(getattr(getattr(item, "function", None), "launch_names", ()))
