"""The torchrun launches of ``tests/multiproc`` (see the docstring of ``conftest.py`` for the layers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEAKY = str(HERE / "leaky_backward.py")
CONTROL_ARGS = (
    "--schedules", "Schedule1F1B,ScheduleInterleavedZeroBubble", "--models", "mlp", "--metadata", "static"
)


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    nproc: int
    args: tuple[str, ...]
    timeout: float
    env: tuple[tuple[str, str], ...] = ()


LAUNCHES: dict[str, LaunchSpec] = {
    "ws2": LaunchSpec(2, ("--backward", "ppbackward"), 180),
    "ws4": LaunchSpec(4, ("--backward", "ppbackward"), 300),
    "ws2-static": LaunchSpec(2, ("--backward", "ppbackward", "--metadata", "static"), 180),
    # torch's own backward raises on some zero-bubble cases; its peers then wait for the case timeout
    "upstream-ws2": LaunchSpec(2, ("--backward", "upstream", "--case-timeout", "6"), 240),
    # static metadata: no shape-inference forward on step 0, so every count is exactly one per call
    "leaky-cycle": LaunchSpec(
        2, ("--backward", f"leaky:{LEAKY}", *CONTROL_ARGS), 120,
        (("PPBACKWARD_LEAK_KIND", "cycle"),),
    ),
    "leaky-live": LaunchSpec(
        2, ("--backward", f"leaky:{LEAKY}", *CONTROL_ARGS), 120,
        (("PPBACKWARD_LEAK_KIND", "live"),),
    ),
}

# the largest launch timeout plus the launcher's kill grace: the backstop of any test that launches
LAUNCH_TEST_TIMEOUT = int(max(spec.timeout for spec in LAUNCHES.values())) + 60
