"""Private: name what went wrong in a failing case, as a kind with a one-line reason and its public report.

A failing case record (:class:`ppbackward._tools.harness.records.CaseRecord`) holds
:class:`~ppbackward._tools.harness.records.Failure` s, each with its *kind* set where it was detected
(Note [failure kinds] in ``ppbackward._tools.harness.records``): by the probe that measured it, or, for
an exception, by the worker where it caught it, from the texts :attr:`Kind.raised_with` lists.
:func:`diagnose` turns them into :class:`Finding` s, most telling first, each naming a *kind* of failure
(``ddp-replicas``, ``hooks-skipped``, ...) with why it happens and the public report of that kind where
there is one; it reads the kinds, never the messages. ``ppbackward check`` shows the first finding of
every failing cell; ``tests/multiproc/test_training_upstream.py`` pins, kind by kind, which cells
torch's own backward fails.
"""

from __future__ import annotations

import dataclasses

from ppbackward._tools.harness.records import CaseRecord, Failure

__all__ = ["KINDS", "ORDER", "OTHER", "Finding", "Kind", "diagnose", "kind"]


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of failure.

    Attributes:
        key: stable name (a :class:`~ppbackward._tools.harness.records.Failure`'s ``kind``, tests).
        label: a few words, for a table cell.
        reason: one line: why, and the public report.
        raised_with: for a kind that shows as an exception, texts of which one is in the exception's
            message (or in its whole traceback, with ``in_traceback``): the worker names an exception's kind
            with them where it catches it; ``()`` for a kind a probe detects.
        in_traceback: look for ``raised_with`` in the whole formatted traceback too.
    """

    key: str
    label: str
    reason: str
    raised_with: tuple[str, ...] = ()
    in_traceback: bool = False


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
        ("backward through the graph a second time",),
    ),
    Kind(
        "view-output", "view output: B cannot detach it",
        "torch's B detaches every stage output in place, views included ('Can't detach views in-place', "
        "pytorch/pytorch#142229)",
        ("Can't detach views in-place",),
    ),
    Kind(
        "donated-buffers", "torch.compile donated buffers",
        "torch's B retains the graph, which a compiled region with donated buffers refuses (pytorch/pytorch#161904)",
        ("donated buffers",),
    ),
    Kind(
        "compile-refused", "refuses torch.compile'd stages",
        "torch's zero-bubble schedules refuse, when built, a stage module holding a torch.compile'd module (an "
        "OptimizedModule child): torch's B would run each compiled region whole, W having nothing of it left, "
        "and B's retain_graph clashes with the region's donated buffers (pytorch/pytorch#161904)",
        ("is not supported with stage modules that have used torch.compile",),
    ),
    Kind(
        "sac-second-backward", "selective AC: W recomputes",
        "selective activation checkpointing allows one backward per region: torch's W recomputes the region "
        "in a second engine call, which it refuses ('backward an extra time'; zero bubble with activation "
        "checkpointing: pytorch/pytorch#136766, pytorch/torchtitan#773)",
        ("backward an extra time",),
    ),
    Kind(
        "detached-output", "W reads a detached output",
        "a node W runs saved a stage output that was detached in place after B ('detached in-place')",
        ("detached in-place",),
    ),
    Kind(
        "ddp-shape-inference", "DDP + shape inference",
        "torch's PipelineStage shape inference (no input_args) arms DDP's reducer outside no_sync; DDP fails "
        "at step 2 with either backward: give PipelineStage input_args/output_args",
        (_DDP_REBUILT_BUCKETS,), in_traceback=True,  # Note [DDP and shape inference]
    ),
    Kind(
        "ddp-replicas", "DDP replicas diverge",
        "torch's W bypasses AccumulateGrad, so DDP's reducer never all-reduces the grads it computes: the dp "
        "replicas diverge (pytorch/pytorch#144530)",
    ),
    Kind(
        "fsdp-swap", "FSDP2 reshard: grads lost",
        "FSDP2 (reshard_after_forward=True) puts a module's sharded parameters back after each forward: torch's "
        "B looks the stage's weights up by object, finds none of them in the graph after a forward, builds no "
        "param group, and W drops that microbatch's weight grads (the last stage's None, the middle stages' "
        "partial sums)",
    ),
    Kind(
        "fsdp-loss-reshard", "loss reshards FSDP2: norm grad None",
        "torchtitan's shape: the loss applies lm_head and reshards its FSDP2 unit [norm, lm_head], swapping "
        "norm.weight for its sharded parameter; torch's B looks the stage's weights up by object, gives the "
        "final norm no param group, and W never computes its grad (torchtitan with zero bubble: the final "
        "RMSNorm never trains)",
    ),
    Kind(
        "grads-missing", "trainable grads None",
        "a stage whose input needs no grad (a frozen prefix, LoRA): torch's B finds no input path, so no "
        "intermediate, and its W computes no weight grad",
    ),
    Kind(
        "recompute-more", "checkpoint recomputed again",
        "torch's W recomputes a checkpointed region once more per engine call (zero bubble with activation "
        "checkpointing: pytorch/pytorch#136766, pytorch/torchtitan#773)",
    ),
    Kind(
        "side-effects-twice", "custom Function runs twice",
        "torch's W re-runs a custom autograd.Function's backward that B already ran: side effects (e.g. "
        "main_grad accumulation) happen twice",
    ),
    Kind(
        "grads-wrong", "wrong grads",
        "the grads differ from a single-process reference of the same microbatches",
    ),
    Kind(
        "regions-whole", "compiled region not split",
        "ppbackward's B ran a torch.compile'd region whole instead of splitting it into B and W (its backward "
        "compiled before ppbackward.install(), or a graph it could not cut: Note [compiled regions split in two] "
        "in ppbackward._compiled): exact, but W has none of that region's work to fill the bubble with",
    ),
    Kind(
        "hooks-skipped", "hooks skipped in W",
        "torch's W bypasses AccumulateGrad: post-accumulate-grad hooks (DDP, optimizer-in-backward) do not "
        "fire for the microbatches it handles (pytorch/pytorch#144530)",
    ),
    Kind(
        "reference-cycle", "reference cycle",
        "tensors or autograd nodes left in reference cycles: activations live until the gc runs "
        "(pytorch/pytorch#136507, #136584)",
    ),
    Kind(
        "held-activations", "activations held",
        "saved activations still alive after the step: a live reference holds them",
    ),
    Kind(
        "stage-caches", "stage caches not emptied",
        "the stage's per-microbatch caches hold entries after the step",
    ),
    Kind(
        "peer-failed", "a peer rank failed",
        "another rank of the pipeline stopped on an exception, and this rank timed out waiting for it (or lost "
        "its connection, where the other rank's process ended)",
        ("Timed out waiting", "Connection closed by peer",),
    ),
)

#: The kind of a failure no known kind explains (shown as recorded).
OTHER = Kind("other", "other failure", "")

_BY_KEY: dict[str, Kind] = {k.key: k for k in (*KINDS, OTHER)}

#: Each kind's place in :data:`KINDS` (most telling first); ``other`` goes after all of them.
ORDER: dict[str, int] = {kind.key: i for i, kind in enumerate(KINDS)}


def kind(key: str) -> Kind:
    """The kind named ``key``.

    Raises:
        KeyError: no kind of that key (the message lists the known keys).
    """
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"unknown failure kind {key!r}; known: {', '.join(_BY_KEY)}") from None


@dataclasses.dataclass(frozen=True)
class Finding:
    """A kind found in a case, with the first failure of that kind (as recorded)."""

    kind: Kind
    failure: Failure

    @property
    def example(self) -> str:
        """The failure as shown (``step 0: hooks: ...``, ``exception: RuntimeError: ...``)."""
        return self.failure.text

    @property
    def line(self) -> str:
        """One line: ``label: reason``, or the raw message for an ``other`` failure."""
        if self.kind is OTHER:
            return self.failure.message if self.failure.check == "exception" else self.failure.text
        return f"{self.kind.label}: {self.kind.reason}"


def diagnose(record: CaseRecord) -> list[Finding]:
    """The kinds of failure in one rank's case ``record``, most telling first; ``[]`` when it passed.

    Each failure counts for the kind it carries; an ``other`` failure is a finding of its own, shown as
    recorded.

    Raises:
        KeyError: a failure of an unknown kind.
    """
    found: dict[str, Finding] = {}
    for failure in record.failures:
        key = failure.kind if failure.kind != OTHER.key else f"other:{failure.text}"
        found.setdefault(key, Finding(kind(failure.kind), failure))
    return sorted(found.values(), key=lambda f: ORDER.get(f.kind.key, len(ORDER)))
