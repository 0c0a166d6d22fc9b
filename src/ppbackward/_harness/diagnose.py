"""Private: name what went wrong in a failing case, as a kind with a one-line reason and its public report.

A failing case record (``ppbackward._harness.worker``) holds failure messages (``"step 0: hooks: ..."``) or an
exception (``"exception: RuntimeError: ..."``). :func:`diagnose` turns them into :class:`Finding`\\ s, most
telling first, each naming a *kind* of failure (``ddp-replicas``, ``hooks-skipped``, ...) with why it
happens and the public report of that kind where there is one. ``ppbackward check`` shows the first
finding of every failing cell; ``tests/multiproc/test_training_upstream.py`` pins, kind by kind, which
cells torch's own backward fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["KINDS", "Finding", "Kind", "diagnose", "kind_of"]


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of failure: ``key`` (stable, for tests), ``label`` (a few words, for a table cell) and
    ``reason`` (one line: why, and the public report)."""

    key: str
    label: str
    reason: str
    matches: Callable[[str, dict[str, Any]], bool]  # (one failure message, the case record) -> bool


def _exception(text: str) -> Callable[[str, dict[str, Any]], bool]:
    return lambda failure, record: failure.startswith("exception: ") and text in failure


def _check(prefix: str, text: str = "", wrap: str | None = None) -> Callable[[str, dict[str, Any]], bool]:
    def matches(failure: str, record: dict[str, Any]) -> bool:
        body = failure.split(": ", 1)[1] if failure.startswith("step ") else failure
        if not body.startswith(prefix) or text not in body:
            return False
        return wrap is None or record.get("wrap", "none") == wrap

    return matches


#: Every known kind, most telling first (a case's findings come in this order).
KINDS: tuple[Kind, ...] = (
    Kind(
        "shared-parameter", "shared parameter: W backprops twice",
        "a parameter feeds two ops of the stage: torch's W runs the graph below it twice and finds it freed "
        "('backward through the graph a second time'; the shared-weight kind of pytorch/pytorch#180952)",
        _exception("backward through the graph a second time"),
    ),
    Kind(
        "view-output", "view output: B cannot detach it",
        "torch's B detaches every stage output in place, views included ('Can't detach views in-place', "
        "pytorch/pytorch#142229)",
        _exception("Can't detach views in-place"),
    ),
    Kind(
        "donated-buffers", "torch.compile donated buffers",
        "torch's B retains the graph, which a compiled region with donated buffers refuses (pytorch/pytorch#161904)",
        _exception("donated buffers"),
    ),
    Kind(
        "sac-second-backward", "selective AC: W recomputes",
        "selective activation checkpointing allows one backward per region: torch's W recomputes the region "
        "in a second engine call, which it refuses ('backward an extra time'; zero bubble with activation "
        "checkpointing: pytorch/pytorch#136766, pytorch/torchtitan#773)",
        _exception("backward an extra time"),
    ),
    Kind(
        "detached-output", "W reads a detached output",
        "a node W runs saved a stage output that was detached in place after B ('detached in-place')",
        _exception("detached in-place"),
    ),
    Kind(
        "ddp-shape-inference", "DDP + shape inference",
        "torch's PipelineStage shape inference (no input_args) arms DDP's reducer outside no_sync; DDP fails "
        "at step 2 with either backward: give PipelineStage input_args/output_args",
        _exception("Note [DDP and shape inference]"),  # the worker's explanation (messages are cut)
    ),
    Kind(
        "ddp-replicas", "DDP replicas diverge",
        "torch's W bypasses AccumulateGrad, so DDP's reducer never all-reduces the grads it computes: the dp "
        "replicas diverge (pytorch/pytorch#144530)",
        _check("replicas:"),
    ),
    Kind(
        "fsdp-swap", "FSDP2 reshard: grads lost",
        "FSDP2 (reshard_after_forward) swaps its sharded and unsharded parameter objects around forward and "
        "backward: torch's split looks the weights up by object, misses them, and loses their grads",
        _check("numerics:", wrap="fsdp"),
    ),
    Kind(
        "grads-missing", "trainable grads None",
        "a stage whose input needs no grad (a frozen prefix, LoRA): torch's B finds no input path, so no "
        "intermediate, and its W computes no weight grad",
        _check("numerics:", "is None in the pipeline"),
    ),
    Kind(
        "recompute-more", "checkpoint recomputed again",
        "torch's W recomputes a checkpointed region once more per engine call (zero bubble with activation "
        "checkpointing: pytorch/pytorch#136766, pytorch/torchtitan#773)",
        _check("side effects:", "checkpointed function ran"),
    ),
    Kind(
        "side-effects-twice", "custom Function runs twice",
        "torch's W re-runs a custom autograd.Function's backward that B already ran: side effects (e.g. "
        "main_grad accumulation) happen twice",
        _check("side effects:"),
    ),
    Kind(
        "grads-wrong", "wrong grads",
        "the grads differ from a single-process reference of the same microbatches",
        _check("numerics:"),
    ),
    Kind(
        "hooks-skipped", "hooks skipped in W",
        "torch's W bypasses AccumulateGrad: post-accumulate-grad hooks (DDP, optimizer-in-backward) do not "
        "fire for the microbatches it handles (pytorch/pytorch#144530)",
        _check("hooks:"),
    ),
    Kind(
        "reference-cycle", "reference cycle",
        "tensors or autograd nodes left in reference cycles: activations live until the gc runs "
        "(pytorch/pytorch#136507, #136584)",
        lambda failure, record: _check("garbage:")(failure, record)
        or _check("lifetime:", "freed only by a gc run")(failure, record),
    ),
    Kind(
        "held-activations", "activations held",
        "saved activations still alive after the step: a live reference holds them",
        _check("lifetime:", "still alive"),
    ),
    Kind(
        "stage-caches", "stage caches not emptied",
        "the stage's per-microbatch caches hold entries after the step",
        _check("caches:"),
    ),
    Kind(
        "peer-failed", "a peer rank failed",
        "another rank of the pipeline stopped on an exception, and this rank timed out waiting for it",
        _exception("Timed out waiting"),
    ),
)

_OTHER = Kind("other", "other failure", "", lambda failure, record: True)


@dataclasses.dataclass(frozen=True)
class Finding:
    """A kind found in a case, with the first failure message of that kind (as recorded)."""

    kind: Kind
    example: str

    @property
    def line(self) -> str:
        """One line: ``label: reason``, or the raw message for an unknown kind."""
        if self.kind is _OTHER:
            return self.example.removeprefix("exception: ")
        return f"{self.kind.label}: {self.kind.reason}"


def kind_of(failure: str, record: dict[str, Any]) -> str:
    """The key of the first kind ``failure`` (one message of ``record``) matches; ``"other"`` for none."""
    return next((k.key for k in KINDS if k.matches(failure, record)), _OTHER.key)


def diagnose(record: dict[str, Any]) -> list[Finding]:
    """The kinds of failure in one rank's case ``record``, most telling first; ``[]`` when it passed.

    Each failure message counts for the first kind (in :data:`KINDS` order) it matches; one that matches
    none is an ``other`` finding, shown as recorded.
    """
    found: dict[str, Finding] = {}
    for failure in record.get("failures") or []:
        kind = next((k for k in KINDS if k.matches(failure, record)), _OTHER)  # kind_of, as a Kind
        key = kind.key if kind is not _OTHER else f"other:{failure}"
        found.setdefault(key, Finding(kind, failure))
    order = {k.key: i for i, k in enumerate(KINDS)}
    return sorted(found.values(), key=lambda f: order.get(f.kind.key, len(order)))
