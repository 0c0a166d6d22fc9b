"""Which torch releases ppbackward knows the pipelining calling contract of.

Private module. ``ppbackward.install()`` calls :func:`check_supported` before patching anything.
The contract changed across releases (see ``docs/compatibility.md``); each known release range is
listed in ``_CONTRACTS`` with what differs, and anything outside is refused with a clear message.
"""

from __future__ import annotations

import re

import torch

__all__: list[str] = []  # private module

# Keep in sync with the ``torch`` requirement in pyproject.toml and docs/compatibility.md.
SUPPORTED_TORCH = ">=2.12,<2.15"
_MIN = (2, 12)
_MAX_EXCLUSIVE = (2, 15)

_REQUIRED_STAGE_NAMES = ("stage_backward", "stage_backward_input", "stage_backward_weight")


class UnsupportedTorchError(RuntimeError):
    """Raised by ``ppbackward.install()`` for a torch whose pipelining contract is unknown."""


def torch_release(version: str | None = None) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``version`` (default: the installed torch), local part dropped."""
    text = str(version if version is not None else torch.__version__)
    parts = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if parts is None:
        raise UnsupportedTorchError(f"cannot parse torch version {text!r}")
    return (int(parts.group(1)), int(parts.group(2)), int(parts.group(3) or 0))


def check_supported(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTorchError` unless ``version`` is in :data:`SUPPORTED_TORCH`."""
    text = version if version is not None else torch.__version__
    release = torch_release(text)
    if not (_MIN <= release[:2] < _MAX_EXCLUSIVE):
        raise UnsupportedTorchError(
            f"ppbackward does not know the pipelining calling contract of torch {text}; "
            f"supported: torch{SUPPORTED_TORCH}. Upgrade ppbackward, or run torch's own backward "
            "(do not call ppbackward.install())."
        )
