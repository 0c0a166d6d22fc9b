"""Swap ppbackward's stage backward into ``torch.distributed.pipelining`` and back.

Public names (re-exported by the package: ``ppbackward.install()``, ``ppbackward.active_adapter()``):
:func:`install`, :func:`uninstall`, :func:`is_installed`, :func:`installed`;
:func:`active_adapter` tells which adapter :func:`install` chose. The module is private (``_install``) so
that the name ``ppbackward.install`` is the function only.

``torch/distributed/pipelining/stage.py`` binds ``stage_backward``, ``stage_backward_input`` and
``stage_backward_weight`` by name at import time (``from ._backward import ...``), so the names are
replaced in both ``torch.distributed.pipelining._backward`` and
``torch.distributed.pipelining.stage``.
What goes in is chosen by ``ppbackward._compat.select_adapter`` from the torch version and the shape
of its ``stage.py``: ppbackward's own functions where ``stage.py`` consumes them as they are (torch
2.6+), thin adapters that only reshape results where it does not (torch 2.5); see
Note [adapters only reshape] in ``ppbackward._compat`` and ``docs/compatibility.md``.

Note [exact originals]: the first :func:`install` records the objects found in both modules, and
:func:`uninstall` puts exactly those objects back; repeated calls are no-ops, except that
``merge_bw`` follows the latest call. With ``merge_bw=True`` one more name is swapped: torch's
``_PipelineScheduleRuntime._prepare_schedule_with_comms`` (the lowering every runtime schedule runs
when it is built) is wrapped so that each B directly followed by its own W runs as one full backward
(Note [merged B and W] in ``ppbackward._merge``); the method found is recorded and put back exactly.

Note [install says so]: nothing else tells a user that ppbackward is in place, so the first :func:`install`
that patches torch in a process logs one ``INFO`` record on the ``ppbackward`` logger (:data:`LOGGER`):
ppbackward's version, torch's, the adapter and ``merge_bw``. Once per process (an ``uninstall`` and a new
``install`` log nothing more), and on rank 0 only, so that a job of N ranks logs it once: the rank of an
initialised ``torch.distributed``, else the ``RANK`` variable that torchrun sets (absent: a single process,
rank 0). Logging decides where it goes, as it does for torchtitan's own ``INFO`` lines: nowhere until the
program configures logging at ``INFO``; ``python -m ppbackward.run`` shows it on stderr when nothing is
configured yet (``ppbackward.run``, Note [run shows the install]).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from ppbackward import _compiled, _merge
from ppbackward._compat import (
    ALLOW_UNTESTED_ENV,
    Adapter,
    UntestedTorchWarning,
    allow_untested_from_env,
    is_newer_than_known,
    select_adapter,
)

__all__ = [
    "LOGGER", "NAMES", "active_adapter", "install", "installed", "is_installed", "merge_bw_enabled", "uninstall",
]

#: The names ``install`` replaces, in both modules of ``_MODULES``.
NAMES = ("stage_backward", "stage_backward_input", "stage_backward_weight")
_MODULES = ("torch.distributed.pipelining._backward", "torch.distributed.pipelining.stage")
_lock = threading.Lock()
_originals: dict[tuple[str, str], Any] = {}  # (module, name) -> torch's object
_active: list[Adapter] = []  # the adapter in place while installed (zero or one entry)
_merge_original: list[Any] = []  # torch's _prepare_schedule_with_comms while merge_bw is on (0 or 1 entry)
#: The logger of the one record :func:`install` logs (Note [install says so]).
LOGGER = logging.getLogger("ppbackward")
_announced: list[bool] = []  # [True] once this process logged its install (Note [install says so])


def _modules() -> list[Any]:
    return [importlib.import_module(m) for m in _MODULES]


def install(allow_untested: bool | None = None, *, merge_bw: bool | None = None) -> None:
    """Replace torch's stage backward functions with ppbackward's, in ``_backward`` and ``stage``.

    Idempotent. Call it before running a schedule step (stages look the names up at call time).
    The functions put in are those of the adapter for the installed torch (:func:`active_adapter`):
    ppbackward's own on torch 2.6 to 2.15, list-returning wrappers with a stage-0-safe B on 2.5. While
    installed, torch's zero-bubble schedules accept stages with ``torch.compile``'d modules, and on torch
    2.13+ the backward graphs AOTAutograd compiles from then on can be split into B and W (Note [compiled
    regions split in two] in ``ppbackward._compiled``).

    Args:
        allow_untested: on a torch newer than the newest known release (a nightly, the next
            minor), put in the newest known contract's adapter when the installed ``stage.py``
            has that contract's shape, warning with ``UntestedTorchWarning``; refuse otherwise
            (Note [untested newer torch] in ``ppbackward._compat``). ``None`` (default): the
            environment decides, ``PPBACKWARD_ALLOW_UNTESTED_TORCH=1`` opting in (read only on a
            newer torch). No effect on a known release.
        merge_bw: run each B that a zero-bubble schedule's compute order directly follows with its own
            W as one full backward, in schedules *built* from now on (a schedule lowers its action list
            when it is constructed). ``None`` (default): as it is (off on a first install). Exact;
            what else changes is in ``docs/api.md`` and Note [merged B and W] in
            ``ppbackward._merge``. A later call with ``True`` or ``False`` switches it for schedules
            built after that call.

    Raises:
        ppbackward.UnsupportedTorchError: the installed torch is outside
            ``ppbackward.SUPPORTED_TORCH`` (a newer one without the opt-in), or its ``stage.py``
            does not have the shape known for its version (the message names the version and the
            supported range, and for a newer torch the opt-in); nothing is patched then.
        ValueError: on a newer torch, ``PPBACKWARD_ALLOW_UNTESTED_TORCH`` is set to something other
            than 0 or 1 (and ``allow_untested`` is ``None``).
        RuntimeError: the pipelining modules lack one of the expected names, or hold ppbackward's functions
            put in by an earlier copy of this module (reloaded since), whose record of torch's is lost; or (an
            ``UnsupportedTorchError``) ``merge_bw=True`` and this torch has no
            ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` (nothing is patched then).
    """
    if merge_bw is not None and not isinstance(merge_bw, bool):
        raise TypeError(f"install(merge_bw={merge_bw!r}): expected True, False or None (leave it as it is)")
    with _lock:
        if merge_bw:
            _merge.lowering()  # raises before anything is patched on a torch without the lowering
        if _originals:
            if merge_bw is not None:
                _set_merge(merge_bw)
            return
        from_env = allow_untested is None
        if from_env:  # read only where it matters (Note [untested newer torch])
            allow_untested = is_newer_than_known() and allow_untested_from_env()
        adapter = select_adapter(allow_untested=bool(allow_untested))
        mods = _modules()
        for mod in mods:
            for name in NAMES:
                if not hasattr(mod, name):
                    raise RuntimeError(f"{mod.__name__} has no attribute {name!r}; cannot install")
        found = {(mod.__name__, name): getattr(mod, name) for mod in mods for name in NAMES}
        _refuse_ours_as_torchs(found, adapter)
        for mod in mods:
            for name in NAMES:
                setattr(mod, name, adapter.functions[name])
        _originals.update(found)
        _lift_compile_refusal()
        _compiled.enable()
        _active.append(adapter)
        _set_merge(bool(merge_bw))
    _announce(adapter, bool(merge_bw))
    if adapter.untested:
        how = f"{ALLOW_UNTESTED_ENV}=1" if from_env else "allow_untested=True"
        warnings.warn(
            f"ppbackward was not tested on torch {adapter.version}; by {how} it put in the "
            f"adapter of torch {adapter.contract.name}, whose stage.py shape this torch has. Compare "
            "grads with torch's own backward (ppbackward check) before relying on it.",
            UntestedTorchWarning,
            stacklevel=2,
        )


def _refuse_ours_as_torchs(found: dict[tuple[str, str], Any], adapter: Adapter) -> None:
    """Refuse to record ppbackward's own functions as torch's originals: found in torch's modules while this
    module records no install, they were put in by an earlier copy of this module (``importlib.reload``, IPython's
    autoreload), whose record of torch's functions is gone; recording them would make :func:`uninstall` put
    ppbackward's functions back instead of torch's. Nothing is patched then."""
    ours = [f"{mod}.{name}" for (mod, name), obj in found.items() if obj is adapter.functions[name]]
    if ours:
        raise RuntimeError(
            f"install(): {ours[0]} is already ppbackward's, put in by an earlier import of ppbackward._install "
            "(reloaded since?) whose record of torch's functions is lost, so uninstall() could not restore them; "
            "start a new interpreter (ppbackward stays installed in this one)"
        )


_SCHEDULES = "torch.distributed.pipelining.schedules"
_COMPILE_CHECK = "_check_torch_compile_compatibility"


def _compiled_stages_allowed(stages: Any, schedule_name: str) -> None:
    """Put in for torch's ``_check_torch_compile_compatibility`` while installed: ppbackward's B and W take
    stages with compiled blocks (Note [compiled regions split in two] in ``ppbackward._compiled``)."""


def _lift_compile_refusal() -> None:
    """While installed, torch's zero-bubble schedules accept stages with ``torch.compile``'d modules, which
    they refuse on their own (pytorch/pytorch#161904); recorded in ``_originals``, put back by
    :func:`uninstall`. Nothing to do on a torch without that check (2.5.1 has none)."""
    mod = importlib.import_module(_SCHEDULES)
    if hasattr(mod, _COMPILE_CHECK):
        _originals[(_SCHEDULES, _COMPILE_CHECK)] = getattr(mod, _COMPILE_CHECK)
        setattr(mod, _COMPILE_CHECK, _compiled_stages_allowed)


def _rank_zero() -> bool:
    """Whether this process is rank 0: of an initialised ``torch.distributed``, else by ``RANK`` (torchrun
    sets it; absent: one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("0", "")


def _announce(adapter: Adapter, merge_bw: bool) -> None:
    """Log that ppbackward is in place: once per process, on rank 0 (Note [install says so])."""
    if _announced or not _rank_zero():
        return
    _announced.append(True)
    from ppbackward import __version__

    LOGGER.info(
        "ppbackward %s installed: torch %s's pipeline stages run ppbackward's stage backward (%s, merge_bw %s)",
        __version__, adapter.version, adapter.name, "on" if merge_bw else "off",
    )
    compiled = _compiled.support()
    if not compiled.ok:  # Note [compiled regions split in two] in ppbackward._compiled
        LOGGER.info("ppbackward: torch.compile'd regions run whole in B, not split into B and W: %s", compiled.why)


def uninstall() -> None:
    """Put back exactly the objects :func:`install` replaced. Idempotent."""
    with _lock:
        if not _originals:
            return
        for (mod_name, name), original in _originals.items():
            setattr(importlib.import_module(mod_name), name, original)
        _originals.clear()
        _compiled.disable()
        _active.clear()
        _set_merge(False)


def _set_merge(on: bool) -> None:
    """Wrap (``on``) or restore torch's schedule lowering; called with ``_lock`` held."""
    if on == bool(_merge_original):
        return
    cls, method = _merge.lowering()
    if on:
        # the class's own entry, or None where it inherits the method: then uninstall deletes ours
        _merge_original.append(cls.__dict__.get("_prepare_schedule_with_comms"))
        setattr(cls, "_prepare_schedule_with_comms", _merge.merging(method))  # noqa: B010
        return
    original = _merge_original.pop()
    if original is None:
        delattr(cls, "_prepare_schedule_with_comms")
    else:
        setattr(cls, "_prepare_schedule_with_comms", original)  # noqa: B010


def merge_bw_enabled() -> bool:
    """True while ``install(merge_bw=True)`` is in effect (schedules built now merge B and W)."""
    return bool(_merge_original)


def is_installed() -> bool:
    """True while ppbackward's functions are swapped in."""
    return bool(_originals)


def active_adapter() -> Adapter | None:
    """The adapter :func:`install` put in place (``adapter.name``, e.g.
    ``"native (torch 2.12-2.14 contract)"``), or ``None`` while not installed."""
    return _active[0] if _active else None


@contextlib.contextmanager
def installed(allow_untested: bool | None = None, *, merge_bw: bool | None = None) -> Iterator[None]:
    """Context manager: :func:`install` (with ``allow_untested`` and ``merge_bw``) on entry; on exit,
    :func:`uninstall` unless it was already installed before entry (then ``merge_bw`` goes back to
    what it was, if ppbackward is still installed: an :func:`uninstall` inside the block stands)."""
    was, was_merging = is_installed(), merge_bw_enabled()
    install(allow_untested, merge_bw=merge_bw)
    try:
        yield
    finally:
        if not was:
            uninstall()
        else:
            _restore_merge(was_merging)


def _restore_merge(on: bool) -> None:
    """Put ``merge_bw`` back to ``on`` where ppbackward is still installed; never installs it again."""
    with _lock:
        if _originals:
            _set_merge(on)
