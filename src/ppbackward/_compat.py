"""Which torch releases ppbackward supports, and how it adapts to each one's pipelining contract.

Private module; ``SUPPORTED_TORCH``, ``UnsupportedTorchError`` and ``UntestedTorchWarning`` are
re-exported by ``ppbackward``.
``ppbackward.install()`` calls :func:`select_adapter` before patching anything; the adapter it
returns holds the three functions to put into ``torch.distributed.pipelining``. See
``docs/compatibility.md`` for the matrix of verified releases.

Note [adapters only reshape]: ppbackward's own ``stage_backward``, ``stage_backward_input`` and
``stage_backward_weight`` keep exactly their semantics (exact grads, no reference cycle, hooks
fired through ``AccumulateGrad``) under every adapter. An adapter changes only what the installed
torch's ``stage.py`` needs to see: the container type of a result (2.5's ``stage.py`` tells B's
result from the others by ``isinstance(result, tuple) and len(result) == 2``), or when B may free
the graph (2.5's ``stage.py`` runs B on stage 0 and then a *full* backward of the same outputs at W
time). From 2.6 on, ``stage.py`` consumes ppbackward's own functions unchanged; that includes
2.15's, which hands released outputs over as ``GradientEdge`` roots and ``None`` entries
(``StageShape.roots_may_be_edges``): ppbackward's functions take both as they are (Note
[GradientEdge outputs] in ``ppbackward._tree``).

Note [untested newer torch] (at :func:`select_adapter`): what ``install()`` does on a torch newer
than the newest known release.

Note [custom Function nodes need an owner] lives in ``ppbackward._node_owner``: ppbackward's own B
keeps the nodes it needs on the releases that need it (2.5-2.12), whichever adapter is in place;
:class:`Adapter` only reports it (``owns_custom_nodes``).
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import weakref
from typing import Any, Callable, NamedTuple

import torch

from ppbackward import backward as _ours
from ppbackward._node_owner import custom_nodes_need_owner
from ppbackward._tree import flatten_outputs_and_grads

__all__ = [  # private module: what other modules use
    "ALLOW_UNTESTED_ENV",
    "SUPPORTED_TORCH",
    "Adapter",
    "UnsupportedTorchError",
    "UntestedTorchWarning",
    "allow_untested_from_env",
    "check_supported",
    "contract_for",
    "is_newer_than_known",
    "legacy_stage_backward",
    "legacy_stage_backward_input",
    "legacy_stage_backward_weight",
    "probe_stage_shape",
    "select_adapter",
    "torch_release",
]

# Keep in sync with the ``torch`` requirement in pyproject.toml and docs/compatibility.md.
SUPPORTED_TORCH = ">=2.5,<2.16"
_MIN = (2, 5)
_MAX_EXCLUSIVE = (2, 16)

#: Setting this environment variable to ``1`` has the effect of ``install(allow_untested=True)``
#: (Note [untested newer torch]).
ALLOW_UNTESTED_ENV = "PPBACKWARD_ALLOW_UNTESTED_TORCH"


class UnsupportedTorchError(RuntimeError):
    """Raised by ``ppbackward.install()`` for a torch whose pipelining contract is unknown."""


class UntestedTorchWarning(UserWarning):
    """Warned by ``ppbackward.install(allow_untested=True)`` when it puts in the adapter of the newest
    known torch on a newer, untested one (Note [untested newer torch])."""


def torch_release(version: str | None = None) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``version`` (default: the installed torch), no local part."""
    text = str(version if version is not None else torch.__version__)
    parts = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if parts is None:
        raise UnsupportedTorchError(f"cannot parse torch version {text!r}")
    return (int(parts.group(1)), int(parts.group(2)), int(parts.group(3) or 0))


def is_newer_than_known(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed torch) is newer than every release ppbackward knows
    (``2.16.0``, ``2.16.0.dev20261201``, ``3.0.0`` while :data:`SUPPORTED_TORCH` ends before 2.16)."""
    return torch_release(version)[:2] >= _MAX_EXCLUSIVE


def check_supported(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTorchError` unless ``version`` is in :data:`SUPPORTED_TORCH`.

    The message is one line that says what to do; for a torch newer than the newest known one it
    names the opt-in (Note [untested newer torch]).
    """
    text = version if version is not None else torch.__version__
    release = torch_release(text)
    if release[:2] < _MIN:
        raise UnsupportedTorchError(
            f"ppbackward does not know the pipelining calling contract of torch {text} (older than "
            f"the oldest it supports; supported: torch{SUPPORTED_TORCH}): upgrade torch, or run "
            "torch's own backward (do not call ppbackward.install())."
        )
    if is_newer_than_known(text):
        newest = _CONTRACTS[-1].name
        raise UnsupportedTorchError(
            f"ppbackward does not know the pipelining calling contract of torch {text} (newer than "
            f"the newest it was tested on, {newest}; supported: torch{SUPPORTED_TORCH}): upgrade "
            f"ppbackward, or opt in with ppbackward.install(allow_untested=True) or "
            f"{ALLOW_UNTESTED_ENV}=1 to use the torch {newest} adapter if this torch's stage.py "
            "has its shape, or run torch's own backward (do not call ppbackward.install())."
        )


def allow_untested_from_env() -> bool:
    """Whether :data:`ALLOW_UNTESTED_ENV` opts in (Note [untested newer torch]).

    ``1`` opts in; unset, empty or ``0`` does not.

    Raises:
        ValueError: any other value (named with the variable), rather than a silent guess.
    """
    value = os.environ.get(ALLOW_UNTESTED_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{ALLOW_UNTESTED_ENV}={value!r}: expected 1 (opt in), 0 or unset")


# --- what the installed stage.py looks like ------------------------------------------------------


class StageShape(NamedTuple):
    """How ``torch/distributed/pipelining/stage.py`` consumes the three functions.

    Attributes:
        unpacks_by_length: ``backward_maybe_with_nosync`` tells B's ``(grads, param_groups)`` from
            the other results by ``isinstance(result, tuple) and len(result) == 2`` (2.5), instead
            of wrapping the full and W results itself (2.6+).
        b_on_first_stage: ``backward_one_chunk(full_backward=False)`` runs B on stage 0 too, and
            ``backward_weight_one_chunk`` then runs a full backward of the same outputs (2.5);
            2.6+ skips B on stage 0.
        roots_may_be_edges: the stage keeps a ``GradientEdge`` per output it may release and drops
            the output tensor once its send completed (``release_fwd_send_outputs``), so the
            ``stage_output`` given to the full backward and to B may hold ``GradientEdge`` entries,
            and ``None`` for a released output that needs no grad (2.15); before 2.15 it holds the
            output tensors themselves. Read from a ``_PipelineStageBase.release_fwd_send_outputs``
            method or a ``get_gradient_edge`` call anywhere in the module.
    """

    unpacks_by_length: bool
    b_on_first_stage: bool
    roots_may_be_edges: bool = False


_LEGACY_SHAPE = StageShape(unpacks_by_length=True, b_on_first_stage=True)
_TUPLE_SHAPE = StageShape(unpacks_by_length=False, b_on_first_stage=False)
_EDGE_ROOTS_SHAPE = StageShape(
    unpacks_by_length=False, b_on_first_stage=False, roots_may_be_edges=True
)


def probe_stage_shape(source: str | None = None) -> StageShape | None:
    """Read the shape of a ``stage.py`` (see :class:`StageShape`) from its source.

    Args:
        source: the text of a ``torch/distributed/pipelining/stage.py``; default the installed one.

    Returns:
        The shape, or ``None`` when the source cannot be read (e.g. a bytecode-only install) or
        has no ``_PipelineStageBase`` with ``backward_maybe_with_nosync`` and
        ``backward_one_chunk``.
    """
    if source is None:
        from torch.distributed.pipelining import stage as stage_module

        try:
            source = inspect.getsource(stage_module)
        except (OSError, TypeError):
            return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    methods = {
        fn.name: fn
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "_PipelineStageBase"
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef)
    }
    unpack = methods.get("backward_maybe_with_nosync")
    chunk = methods.get("backward_one_chunk")
    if unpack is None or chunk is None:
        return None
    unpacks_by_length = any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "len"
        and any(isinstance(a, ast.Name) and a.id == "result" for a in n.args)
        for n in ast.walk(unpack)
    )
    roots_may_be_edges = "release_fwd_send_outputs" in methods or any(
        isinstance(n, ast.Call)
        and (getattr(n.func, "id", None) or getattr(n.func, "attr", None)) == "get_gradient_edge"
        for n in ast.walk(tree)
    )
    return StageShape(unpacks_by_length, not _skips_b_on_first_stage(chunk), roots_may_be_edges)


def _skips_b_on_first_stage(tree: ast.AST) -> bool:
    """True when an ``if`` testing ``self.is_first`` guards the ``"input"`` (B) backward call."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        tests_is_first = any(
            isinstance(n, ast.Attribute) and n.attr == "is_first" for n in ast.walk(node.test)
        )
        runs_b = any(
            isinstance(n, ast.Constant) and n.value == "input"
            for stmt in node.body
            for n in ast.walk(stmt)
        )
        if tests_is_first and runs_b:
            return True
    return False


# --- the known contracts -----------------------------------------------------------------------


class Contract(NamedTuple):
    """One range of torch releases with the same pipelining calling contract.

    Attributes:
        first: first ``(major, minor)`` of the range.
        last: last ``(major, minor)`` of the range (inclusive).
        shape: the :class:`StageShape` every release of the range has.
        upstream: what torch's own ``_backward.py`` of the range returns (documentation).
        adapter: the adapter kind, ``"legacy"`` (2.5) or ``"native"``.
    """

    first: tuple[int, int]
    last: tuple[int, int]
    shape: StageShape
    upstream: str
    adapter: str

    @property
    def name(self) -> str:
        a, b = (f"{m}.{n}" for m, n in (self.first, self.last))
        return a if a == b else f"{a}-{b}"


_CONTRACTS: tuple[Contract, ...] = (
    Contract(
        (2, 5),
        (2, 5),
        _LEGACY_SHAPE,
        "B returns (None unless every input requires grad, list of dicts); full and W return lists",
        "legacy",
    ),
    Contract(
        (2, 6),
        (2, 7),
        _TUPLE_SHAPE,
        "tuples; B input grads aligned with input_values (all must require grad)",
        "native",
    ),
    Contract(
        (2, 8),
        (2, 11),
        _TUPLE_SHAPE,
        "tuples; B input grads filtered to the inputs requiring grad",
        "native",
    ),
    Contract(
        (2, 12),
        (2, 14),
        _TUPLE_SHAPE,
        "tuples; input grads aligned with input_values, None for non-grad inputs",
        "native",
    ),
    Contract(
        (2, 15),
        (2, 15),
        _EDGE_ROOTS_SHAPE,
        "as 2.12-2.14; stage outputs may be GradientEdge roots (released outputs) or None",
        "native",
    ),
)


def contract_for(version: str | None = None) -> Contract:
    """The :class:`Contract` of ``version`` (default: the installed torch).

    Raises:
        UnsupportedTorchError: outside :data:`SUPPORTED_TORCH`.
    """
    check_supported(version)
    minor = torch_release(version)[:2]
    return next(c for c in _CONTRACTS if c.first <= minor <= c.last)


# --- adapters ----------------------------------------------------------------------------------


class Adapter(NamedTuple):
    """What :func:`ppbackward.install` puts into ``torch.distributed.pipelining``.

    Attributes:
        version: the torch version it was selected for.
        contract: that version's :class:`Contract`; for an untested newer torch, the newest known
            one, whose ``stage.py`` shape it was found to have.
        shape_checked: whether a ``stage.py`` shape (probed from the installed torch, or given)
            was checked against ``contract.shape``; ``False`` when the source is unavailable or
            only a version was given.
        owns_custom_nodes: whether ppbackward's B keeps owners for custom Function nodes on this
            torch (Note [custom Function nodes need an owner], ``ppbackward._node_owner``); probed
            on the installed torch. Reported only: B does it under every adapter and when called
            directly.
        functions: name -> replacement for ``stage_backward``, ``stage_backward_input`` and
            ``stage_backward_weight``; ppbackward's own functions where nothing needs reshaping.
        untested: ``version`` is newer than every known release and the adapter was taken from the
            newest contract by opt-in (Note [untested newer torch]).
    """

    version: str
    contract: Contract
    shape_checked: bool
    owns_custom_nodes: bool
    functions: dict[str, Callable[..., Any]]
    untested: bool = False

    @property
    def name(self) -> str:
        owner = "+node-owner" if self.owns_custom_nodes else ""
        untested = f", untested on torch {self.version}" if self.untested else ""
        return f"{self.contract.adapter}{owner} (torch {self.contract.name} contract{untested})"


def _shape_mismatch(text: str, contract: Contract, shape: StageShape, untested: bool) -> str:
    """The one-line refusal for a ``stage.py`` whose shape is not ``contract.shape``."""
    known = (
        f"the newest known contract, torch {contract.name}'s"
        if untested
        else f"the one ppbackward knows for torch {contract.name}"
    )
    todo = (
        "allow_untested uses an adapter only for a stage.py of the same shape: upgrade ppbackward, "
        "or run torch's own backward (do not call ppbackward.install())."
        if untested
        else f"supported: torch{SUPPORTED_TORCH} with unmodified pipelining. Run torch's own "
        "backward (do not call ppbackward.install())."
    )
    return (
        f"torch {text}: its torch/distributed/pipelining/stage.py does not have the shape "
        f"{known} (found {shape}, expected {contract.shape}); {todo}"
    )


def select_adapter(
    version: str | None = None,
    shape: StageShape | None = None,
    *,
    allow_untested: bool = False,
) -> Adapter:
    """Choose the adapter for a torch version and ``stage.py`` shape.

    Note [untested newer torch]: a torch newer than the newest known release (a nightly, the next
    minor) is refused by default: its pipelining contract is unknown. With ``allow_untested`` it gets
    the adapter of the newest known contract, but only when its ``stage.py`` has exactly that
    contract's :class:`StageShape` (read from the source; without source, or with another shape, it
    is refused all the same); :func:`ppbackward.install` then warns with
    :class:`UntestedTorchWarning`. The opt-in changes nothing for a known release.

    Args:
        version: a torch version string; default the installed torch, whose ``stage.py`` is then
            probed with :func:`probe_stage_shape`.
        shape: the ``stage.py`` shape to check against the version's contract; default the probed
            shape for the installed torch, or the contract's own shape for an explicit ``version``
            (except an untested newer one, whose shape must be given or probed).
        allow_untested: accept a torch newer than the newest known release, as above.

    Raises:
        UnsupportedTorchError: the version is outside :data:`SUPPORTED_TORCH` (a newer one without
            ``allow_untested``), or its ``stage.py`` does not have the shape ppbackward knows for
            that version (e.g. a patched build; for an untested newer one, the newest known shape,
            and a shape that cannot be read); the message names the version, the shape found and
            the shape expected.
    """
    text = version if version is not None else torch.__version__
    untested = allow_untested and is_newer_than_known(text)
    contract = _CONTRACTS[-1] if untested else contract_for(text)
    if shape is None and version is None:
        shape = probe_stage_shape()
    if untested and shape is None:
        raise UnsupportedTorchError(
            f"torch {text}: its torch/distributed/pipelining/stage.py cannot be read, so "
            f"allow_untested cannot check that it has the torch {contract.name} shape: upgrade "
            "ppbackward, or run torch's own backward (do not call ppbackward.install())."
        )
    if shape is not None and shape != contract.shape:
        raise UnsupportedTorchError(_shape_mismatch(text, contract, shape, untested))
    owner = custom_nodes_need_owner()
    if contract.adapter == "legacy":
        functions: dict[str, Callable[..., Any]] = {
            "stage_backward": legacy_stage_backward,
            "stage_backward_input": legacy_stage_backward_input,
            "stage_backward_weight": legacy_stage_backward_weight,
        }
    else:
        functions = {
            "stage_backward": _ours.stage_backward,
            "stage_backward_input": _ours.stage_backward_input,
            "stage_backward_weight": _ours.stage_backward_weight,
        }
    return Adapter(text, contract, shape is not None, owner, functions, untested)


# --- the torch 2.5 adapter ---------------------------------------------------------------------

def _tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor leaf of nested tuples/lists/dicts (explicit stack: Note [no closure cycle])."""
    found: list[torch.Tensor] = []
    todo = [tree]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            todo.extend(reversed(item))
        elif isinstance(item, dict):
            todo.extend(reversed(list(item.values())))
    return found


# Outputs that a legacy B detached in place, by id; weak values, so an entry dies with its tensor.
_DETACHED_BY_B: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _received_inputs(input_values: list) -> bool:
    """Whether ``input_values`` look like what 2.5's ``stage.py`` gives a non-first stage.

    Note [stage 0 on torch 2.5]: 2.5's ``stage.py`` runs B on every stage and, on stage 0 only,
    a full ``stage_backward`` of the same outputs at W time, so B must leave stage 0's graph
    intact. A non-first stage's inputs are its receive buffers: leaf tensors that require grad
    (``stage.py`` sets ``requires_grad_(True)`` on every one). Stage 0's are microbatch chunks of
    the user's inputs: views, or tensors that do not require grad. Anything else is handled as
    stage 0 (always correct, only slower); the reverse mistake is caught by
    :func:`legacy_stage_backward`.
    """
    return bool(input_values) and all(
        isinstance(v, torch.Tensor) and v.requires_grad and v.grad_fn is None for v in input_values
    )


def legacy_stage_backward_input(stage_outputs, output_grads, input_values, weights):
    """B for torch 2.5's ``stage.py``; Note [stage 0 on torch 2.5].

    On a non-first stage: ppbackward's B (outputs detached, unread saved tensors released). On stage
    0: nothing of the graph is freed; the input grads of inputs that require grad are computed with
    the graph retained, and the returned ``ParamGroups`` lets
    :func:`ppbackward.stage_backward_weight` run the whole weight backward from the outputs, should
    W come that way instead of as the full backward 2.5's ``stage.py`` runs there.

    Returns:
        ``(input_grads, param_groups)``: a tuple aligned with ``input_values`` (2.5's upstream
        returned ``None`` unless every input required grad; ``stage.py`` accepts both) and a
        :class:`ppbackward.ParamGroups`.
    """
    input_values = list(input_values)
    weights = list(weights)
    if _received_inputs(input_values):
        differentiable = [t for t in _tensors_in(stage_outputs) if t.grad_fn is not None]
        split = _ours.stage_backward_input(stage_outputs, output_grads, input_values, weights)
        for t in differentiable:
            if t.grad_fn is None:
                _DETACHED_BY_B[id(t)] = t
        return split
    flat = flatten_outputs_and_grads(stage_outputs, output_grads)
    result: list[torch.Tensor | None] = [None] * len(input_values)
    wanted = [
        (i, v)
        for i, v in enumerate(input_values)
        if isinstance(v, torch.Tensor) and v.requires_grad
    ]
    if flat.tensors and wanted:
        found = torch.autograd.grad(
            flat.tensors,  # type: ignore[arg-type]  # mixed tensors and edges: accepted, not in torch's stub
            [v for _, v in wanted],
            grad_outputs=flat.grads,
            retain_graph=True,
            allow_unused=True,
        )
        for (i, _), g in zip(wanted, found):
            result[i] = g
    # Views as outputs: B detaches no view, and with no input it runs no engine call and releases
    # nothing, so the graph stays whole for the full backward at W time.
    with torch.enable_grad():
        aliases = [t.view_as(t) for t in flat.tensors]  # type: ignore[union-attr, arg-type]  # all tensors here
    _, groups = _ours.stage_backward_input(aliases, flat.grads, [], weights)
    return tuple(result), groups


def legacy_stage_backward(stage_output, output_grads, input_values, outputs_with_grads_idxs=None):
    """Full backward for torch 2.5's ``stage.py``: ppbackward's, returned as a list.

    2.5's ``backward_maybe_with_nosync`` would take a 2-tuple (a stage with two inputs) for B's
    ``(grads, param_groups)``; upstream returned a list.

    Raises:
        RuntimeError: an output was detached by a B that took this stage for a non-first one (Note
            [stage 0 on torch 2.5]); running on would silently skip every gradient.
    """
    for t in _tensors_in(stage_output):
        if _DETACHED_BY_B.get(id(t)) is t:
            raise RuntimeError(
                "ppbackward on torch 2.5: stage_backward got an output that stage_backward_input "
                "already detached. torch 2.5 runs B and then a full backward on stage 0, and "
                "ppbackward took this stage for a non-first one because every input is a leaf "
                "tensor requiring grad. Pass stage 0 inputs that do not require grad, use a "
                "full-backward schedule, or run torch >= 2.6."
            )
    return list(
        _ours.stage_backward(stage_output, output_grads, input_values, outputs_with_grads_idxs)
    )


def legacy_stage_backward_weight(weights, param_groups, retain_graph=False):
    """W for torch 2.5's ``stage.py`` (called with two arguments): ppbackward's, as a list."""
    return list(_ours.stage_backward_weight(weights, param_groups, retain_graph))
