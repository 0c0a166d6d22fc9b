"""Private: the named scenarios ``ppbackward check`` runs (and ``tests/multiproc`` launches).

A :class:`Scenario` is one torchrun launch per backward: a set of models at a world size, optionally
pipeline × data parallel (``dp``, ``wraps``; Note [dp x pp layout] in ``ppbackward._tools.harness.parallel``),
over every schedule of the installed torch. :data:`DEFAULT` is what ``ppbackward check`` runs without
``--scenario``: on torch 2.13 it shows, side by side with torch's own backward, a shared parameter
crashing torch's W (``transformer``), the frozen-prefix grads torch leaves ``None`` (``lora``), the DDP
replicas it leaves apart (``ddp``) and selective activation checkpointing it refuses (``ac``), in about
two minutes on 2 CPU cores; the bytes held between B and W are measured in process (``ppbackward._tools.cli.check``).
A scenario may run only some schedules (``compiled-zb``: the zero-bubble schedules torch's refusal of
compiled stages is about).
"""

from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT", "SCENARIOS", "Scenario", "select"]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One launch configuration: ``models`` on ``nproc`` ranks, ``dp`` pipelines of them, each stage
    module wrapped as each of ``wraps`` says; ``schedules``, the schedule classes it runs (``None``: all)."""

    name: str
    title: str
    nproc: int
    models: tuple[str, ...]
    dp: int = 1
    wraps: tuple[str, ...] = ("none",)
    schedules: tuple[str, ...] | None = None

    def schedules_within(self, only: list[str] | None) -> list[str] | None:
        """The schedules to run when ``--schedules`` asks for ``only`` (``None``: all): those of both lists."""
        if self.schedules is None:
            return only
        return [s for s in self.schedules if only is None or s in only]

    def worker_args(self) -> list[str]:
        """The harness worker's arguments for this scenario (besides backward, schedules, steps, ...)."""
        return ["--models", ",".join(self.models), "--dp", str(self.dp), "--wraps", ",".join(self.wraps)]

    @property
    def layout(self) -> str:
        if self.dp == 1:
            return f"{self.nproc} ranks"
        return f"{self.nproc} ranks: dp {self.dp} x pp {self.nproc // self.dp}"


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "transformer", "transformer blocks: a parameter used by two ops, a frozen weight, a non-tensor kwarg",
            2, ("transformer",),
        ),
        Scenario(
            "lora", "frozen prefix + LoRA adapters on later stages, and on the last stage only", 2,
            ("lora", "lora-last"),
        ),
        Scenario("ddp", "pipeline x DDP on a 2-D mesh, one data shard per dp rank", 4, ("mlp",), dp=2, wraps=("ddp",)),
        Scenario(
            "fsdp", "pipeline x FSDP2 (fully_shard) on a 2-D mesh, with and without reshard_after_forward",
            4, ("mlp",), dp=2, wraps=("fsdp", "fsdp-keep"),
        ),
        Scenario(
            "ac", "activation checkpointing: selective (several policies, nested) and plain, recomputations counted",
            2, ("sac", "ckpt"),
        ),
        Scenario(
            "titan", "torchtitan's shape: final RMSNorm, lm_head in a chunked loss, FSDP2 units as torchtitan's "
            "(mesh of 1), with and without per-block selective checkpointing",
            2, ("titan", "titan-sac"), wraps=("fsdp-titan",),
        ),
        Scenario("compiled", "a torch.compile'd block (aot_eager) inside every stage", 2, ("compiled",)),
        Scenario(
            "compiled-zb", "torch.compile(block) children (aot_eager) in every stage under the zero-bubble "
            "schedules: torch refuses them, ppbackward splits each compiled region into B and W (counted)",
            2, ("compiled-blocks",), schedules=("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"),
        ),
        Scenario("bf16", "bfloat16 autocast stages with a scaled loss", 2, ("bf16",)),
        Scenario("custom-fn", "a custom autograd.Function whose backward has a side effect", 2, ("custom-fn",)),
        Scenario("mlp", "Linear-GELU-Linear stages", 2, ("mlp",)),
        Scenario("tuple", "tuple boundaries, one a view from a multi-output node", 2, ("tuple",)),
        Scenario("ckpt", "non-reentrant activation checkpointing inside every stage", 2, ("ckpt",)),
    )
}

#: What ``ppbackward check`` runs by default.
DEFAULT: tuple[str, ...] = ("transformer", "lora", "ddp", "ac")


def select(text: str) -> list[Scenario]:
    """``default``, ``all`` or a comma-separated list of names, as scenarios.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if text == "default":
        return [SCENARIOS[n] for n in DEFAULT]
    if text == "all":
        return list(SCENARIOS.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise ValueError(
            f"unknown scenario(s) {', '.join(unknown) or repr(text)}; known: {', '.join(SCENARIOS)}, "
            "or 'default' / 'all'"
        )
    return [SCENARIOS[n] for n in names]
