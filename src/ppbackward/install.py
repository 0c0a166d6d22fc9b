"""Swap ppbackward's stage backward into ``torch.distributed.pipelining`` and back.

``torch/distributed/pipelining/stage.py`` binds ``stage_backward``, ``stage_backward_input`` and
``stage_backward_weight`` by name at import time (``from ._backward import ...``), so the names are
replaced in both ``torch.distributed.pipelining._backward`` and ``torch.distributed.pipelining.stage``.

Note [exact originals]: the first :func:`install` records the objects found in both modules, and
:func:`uninstall` puts exactly those objects back; repeated calls are no-ops.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any

from ppbackward import backward as _ours
from ppbackward._compat import check_supported

__all__ = ["install", "uninstall", "is_installed", "installed"]

_NAMES = ("stage_backward", "stage_backward_input", "stage_backward_weight")
_MODULES = ("torch.distributed.pipelining._backward", "torch.distributed.pipelining.stage")
_lock = threading.Lock()
_originals: dict[tuple[str, str], Any] = {}  # (module, name) -> torch's object


def _modules() -> list[Any]:
    return [importlib.import_module(m) for m in _MODULES]


def install() -> None:
    """Replace torch's stage backward functions with ppbackward's, in ``_backward`` and ``stage``.

    Idempotent. Call it before running a schedule step (stages look the names up at call time).

    Raises:
        ppbackward.UnsupportedTorchError: the installed torch's pipelining contract is unknown (the
            message names the version and the supported range); nothing is patched then.
        RuntimeError: the pipelining modules lack one of the expected names.
    """
    with _lock:
        if _originals:
            return
        check_supported()
        mods = _modules()
        for mod in mods:
            for name in _NAMES:
                if not hasattr(mod, name):
                    raise RuntimeError(f"{mod.__name__} has no attribute {name!r}; cannot install")
        found = {(mod.__name__, name): getattr(mod, name) for mod in mods for name in _NAMES}
        for mod in mods:
            for name in _NAMES:
                setattr(mod, name, getattr(_ours, name))
        _originals.update(found)


def uninstall() -> None:
    """Put back exactly the objects :func:`install` replaced. Idempotent."""
    with _lock:
        if not _originals:
            return
        for (mod_name, name), original in _originals.items():
            setattr(importlib.import_module(mod_name), name, original)
        _originals.clear()


def is_installed() -> bool:
    """True while ppbackward's functions are swapped in."""
    return bool(_originals)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Context manager: :func:`install` on entry; on exit, :func:`uninstall` unless it was already
    installed before entry."""
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
