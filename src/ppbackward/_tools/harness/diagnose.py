"""Private: name what went wrong in a failing case, as a kind with a one-line reason and its public report.

A failing case record (``ppbackward._tools.harness.worker``) holds failure messages (``"step 0: hooks: ..."``) or an
exception (``"exception: RuntimeError: ..."``, its first line, cut; the whole traceback is the record's
``error``). :func:`diagnose` turns them into :class:`Finding`\\ s, most telling first, each naming a *kind*
of failure (``ddp-replicas``, ``hooks-skipped``, ...) with why it happens and the public report of that kind
where there is one. ``ppbackward check`` shows the first finding of every failing cell;
``tests/multiproc/test_training_upstream.py`` pins, kind by kind, which cells torch's own backward fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["KINDS", "ORDER", "Finding", "Kind", "diagnose", "kind_of"]


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of failure: ``key`` (stable, for tests), ``label`` (a few words, for a table cell) and
    ``reason`` (one line: why, and the public report)."""

    key: str
    label: str
    reason: str
    matches: Callable[[str, dict[str, Any]], bool]  # (one failure message, the case record) -> bool


def _exception(*texts: str, traceback: bool = False) -> Callable[[str, dict[str, Any]], bool]:
    """Matches an exception whose message holds one of ``texts`` or, with ``traceback``, whose whole
    traceback does (the record's ``error``; the message is the first line of the exception and of its root
    cause, cut)."""

    def matches(failure: str, record: dict[str, Any]) -> bool:
        if not failure.startswith("exception: "):
            return False
        where = (failure, record.get("error") or "") if traceback else (failure,)
        return any(text in w for text in texts for w in where)

    return matches


def _check(prefix: str, text: str = "", wrap: str | None = None) -> Callable[[str, dict[str, Any]], bool]:
    def matches(failure: str, record: dict[str, Any]) -> bool:
        body = failure.split(": ", 1)[1] if failure.startswith("step ") else failure
        if not body.startswith(prefix) or text not in body:
            return False
        return wrap is None or record.get("wrap", "none") == wrap

    return matches


# Note [DDP and shape inference]: a PipelineStage built without input_args infers its shapes with a forward
# on its first step; around a DDP module that forward runs outside ``no_sync`` and arms DDP's reducer, and
# step 2 then fails in DDP's ``_rebuild_buckets`` ("rebuilt parameter indices size is not same as original
# model parameters size") with torch's backward and with ppbackward alike: torch's stage code, not the
# backward. Static stage metadata (``input_args``/``output_args``) avoids it, so the worker gives DDP cases
# static metadata unless ``--metadata dynamic`` is asked for explicitly, and the ``ddp-shape-inference``
# kind explains the failure when it is. The failure line keeps only the first line of the exception and of
# its root cause, cut, which can lose DDP's message: the kind looks for it in the whole traceback too.
_DDP_REBUILT_BUCKETS = "rebuilt parameter indices size is not same as original model parameters size"

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
        _exception(_DDP_REBUILT_BUCKETS, traceback=True),  # Note [DDP and shape inference]
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
        "fsdp-loss-reshard", "loss reshards FSDP2: norm grad None",
        "torchtitan's shape: the loss applies lm_head and reshards its FSDP2 unit [norm, lm_head], swapping "
        "norm.weight for its sharded parameter; torch's B looks the stage's weights up by object, gives the "
        "final norm no param group, and W never computes its grad (torchtitan with zero bubble: the final "
        "RMSNorm never trains; ppbackward issue 20)",
        _check("numerics:", "is None in the pipeline", wrap="fsdp-titan"),
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
        "another rank of the pipeline stopped on an exception, and this rank timed out waiting for it (or lost "
        "its connection, where the other rank's process ended)",
        _exception("Timed out waiting", "Connection closed by peer"),
    ),
)

_OTHER = Kind("other", "other failure", "", lambda failure, record: True)

#: Each kind's place in :data:`KINDS` (most telling first); ``other`` goes after all of them.
ORDER: dict[str, int] = {kind.key: i for i, kind in enumerate(KINDS)}


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


def _kind(failure: str, record: dict[str, Any]) -> Kind:
    """The first kind (in :data:`KINDS` order) ``failure`` (one message of ``record``) matches; ``other`` for none."""
    return next((kind for kind in KINDS if kind.matches(failure, record)), _OTHER)


def kind_of(failure: str, record: dict[str, Any]) -> str:
    """The key of the first kind ``failure`` (one message of ``record``) matches; ``"other"`` for none."""
    return _kind(failure, record).key


def diagnose(record: dict[str, Any]) -> list[Finding]:
    """The kinds of failure in one rank's case ``record``, most telling first; ``[]`` when it passed.

    Each failure message counts for the first kind (in :data:`KINDS` order) it matches; one that matches
    none is an ``other`` finding, shown as recorded.
    """
    found: dict[str, Finding] = {}
    for failure in record.get("failures") or []:
        kind = _kind(failure, record)
        key = kind.key if kind is not _OTHER else f"other:{failure}"
        found.setdefault(key, Finding(kind, failure))
    return sorted(found.values(), key=lambda f: ORDER.get(f.kind.key, len(ORDER)))
